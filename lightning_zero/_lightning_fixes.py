"""Work-arounds for Lightning behaviour that breaks sharded, remote checkpoints, each citing its issue."""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import _compat


class _RemoteLastLookup:
    """``ModelCheckpoint._find_last_checkpoints`` that keeps the ``s3://`` (any protocol) prefix.

    Lightning #18261: the lookup behind ``ckpt_path="last"`` lists the checkpoint directory with
    fsspec, whose ``ls`` returns paths without the protocol; Lightning then checks
    ``bucket/run/last.ckpt`` on the *local* filesystem, finds nothing, and trains from scratch with
    only a warning. A picklable callable (spawned workers receive the callback by pickling).
    """

    def __init__(self, callback: ModelCheckpoint) -> None:
        self.callback = callback

    def __call__(self, trainer: Any) -> set[str]:
        # The class's method, not a bound one: the instance attribute is this object.
        found = type(self.callback)._find_last_checkpoints(self.callback, trainer)
        # Lightning takes every name containing "last": a full-mode save killed mid-write leaves
        # `last.ckpt.tmp-<id>`, which is never a checkpoint.
        found = {p for p in found if ".tmp-" not in os.path.basename(p)}
        dirpath = str(self.callback.dirpath or "")
        if "://" in dirpath:
            protocol = dirpath.split("://", 1)[0]
            found = {p if "://" in p else f"{protocol}://{p}" for p in found}
        if not found and dirpath:
            # With a local tier the durable tier usually has no `last*` file: no warning for that.
            found = newest_complete_checkpoint(trainer, dirpath, self.callback.FILE_EXTENSION,
                                               warn=not _has_local_tier(trainer))
        return tiered_last(trainer, found)


def tiered_last(trainer: Any, found: set[str]) -> set[str]:
    """With a local tier: the durable ``last`` candidates go to the plugin, which picks the tier
    collectively when the strategy loads (``StrategyLink.resolve_last``); Lightning is handed this
    node's tier directory, which only has to exist. Without any checkpoint on this node's tier or the
    durable path, nothing is resumed, as Lightning does."""
    from lightning_zero.checkpoint import ZeroCheckpointIO
    from lightning_zero.checkpoint.lightning.entry import link_of

    strategy = trainer.strategy
    io = getattr(strategy, "checkpoint_io", None)
    if not isinstance(io, ZeroCheckpointIO) or io.local_tier is None:
        return found
    link = link_of(io)
    link.place(strategy.node_rank, strategy.local_rank)
    root = link.tier_root()
    assert root is not None
    # Every rank goes on to the collective choice, even one whose node lost its storage and sees nothing:
    # another node may hold its files. When no tier holds anything, nothing is loaded (_ResumeNothing).
    link.offer_last(found)
    os.makedirs(root, exist_ok=True)
    connector = _compat.checkpoint_connector(trainer)
    if not isinstance(connector.__dict__.get("resume_start"), _ResumeNothing):
        connector.resume_start = _ResumeNothing(connector)
    return {root}


class _ResumeNothing:
    """The checkpoint connector's ``resume_start`` that, when the tiered ``ckpt_path="last"`` finds no
    checkpoint on any tier (``NothingToResume``, raised on every rank alike), loads nothing, as Lightning's
    own "last" does when there is no checkpoint."""

    def __init__(self, connector: Any) -> None:
        self.connector = connector

    def __call__(self, checkpoint_path: Any = None, weights_only: Any = None) -> None:
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        from lightning_zero.checkpoint.tiered.recovery import NothingToResume

        try:
            type(self.connector).resume_start(self.connector, checkpoint_path, weights_only=weights_only)
        except NothingToResume as exc:
            rank_zero_warn(f"{exc} No checkpoint will be loaded.")
            self.connector._ckpt_path = None
            self.connector._loaded_checkpoint = {}


def _has_local_tier(trainer: Any) -> bool:
    return getattr(getattr(trainer.strategy, "checkpoint_io", None), "local_tier", None) is not None


def newest_complete_checkpoint(trainer: Any, dirpath: str, extension: str, warn: bool = True) -> set[str]:
    """The newest checkpoint of ``dirpath`` that committed, when no ``last*`` one survived.

    A job killed while its first ``last.ckpt`` was being written (or a deleted ``last.ckpt``) leaves
    complete ``epoch=...`` checkpoints beside it; Lightning's ``ckpt_path="last"`` then finds nothing
    and silently trains from step 0. An uncommitted save has no marker (or only a ``.tmp-`` file in
    ``full`` mode), so every name listed here whose marker reads is a complete checkpoint."""
    from lightning_zero.checkpoint.lightning.plugin import ZeroCheckpointIO
    from lightning_zero.checkpoint.store import cleanup, storage

    io = getattr(trainer.strategy, "checkpoint_io", None)
    options = io.storage_options if isinstance(io, ZeroCheckpointIO) else {}
    for candidate in cleanup.newest_siblings(storage.resolve(f"{dirpath.rstrip('/')}/last{extension}", options)):
        if not candidate.endswith(extension):
            continue
        try:
            storage.read_marker(storage.resolve(candidate, options))
        except Exception:  # damaged or not a checkpoint: try the next newest
            continue
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        if warn:
            rank_zero_warn(f'ckpt_path="last": no last checkpoint survived in {dirpath!r}; resuming from {candidate!r},'
                           " the newest complete checkpoint there.")
        return {candidate}
    return set()


def fix_remote_last_lookup(trainer: Any) -> None:
    """Install :class:`_RemoteLastLookup` on the trainer's ModelCheckpoint callbacks (idempotent)."""
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        lookup = callback.__dict__.get("_find_last_checkpoints")
        if isinstance(callback, ModelCheckpoint) and not isinstance(lookup, _RemoteLastLookup):
            callback._find_last_checkpoints = _RemoteLastLookup(callback)  # type: ignore[method-assign]


class LaunchWithFixes:
    """Wraps a Lightning launcher's ``launch``: Lightning resolves ``ckpt_path="last"`` inside the
    launched function, before any strategy hook runs, so the launcher is the last place to apply
    :func:`fix_remote_last_lookup`. Picklable (spawn pickles the strategy and its launcher)."""

    def __init__(self, launcher: Any) -> None:
        self.launcher = launcher

    def __call__(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if trainer is not None:
            fix_remote_last_lookup(trainer)
            fix_link_last(trainer)
        return type(self.launcher).launch(self.launcher, function, *args, trainer=trainer, **kwargs)


class _LinkAfterCommit:
    """``ModelCheckpoint._link_checkpoint`` for ``save_last="link"`` with :class:`ZeroCheckpointIO`.

    Lightning links ``last.ckpt`` to the checkpoint it has just *started* to save and, with an async
    save, would point it at a file that does not exist yet (and that may never commit); on object
    stores it refuses ``"link"`` altogether. Here rank 0 queues the link behind the save in flight:
    a relative symlink on local disks, a copy of the marker on S3 (the marker names its data
    relative to its folder, so the copy names the same data). Picklable, like the lookup above."""

    def __init__(self, callback: ModelCheckpoint) -> None:
        self.callback = callback

    def __call__(self, trainer: Any, filepath: str, linkpath: str) -> None:
        from lightning_zero.checkpoint import ZeroCheckpointIO
        from lightning_zero.checkpoint.lightning.entry import link_of

        io = trainer.strategy.checkpoint_io
        if not isinstance(io, ZeroCheckpointIO):
            type(self.callback)._link_checkpoint(trainer, filepath, linkpath)
            return
        if trainer.is_global_zero:
            link_of(io).link(filepath, linkpath)
        trainer.strategy.barrier()


class _SetupAllowingRemoteLink:
    """The callback's ``setup`` without Lightning's "link only on local paths" refusal, which
    :class:`_LinkAfterCommit` makes unnecessary. Picklable, like the lookup above (a closure is not:
    spawned and forkserver workers receive the callback by pickling)."""

    def __init__(self, callback: ModelCheckpoint) -> None:
        self.callback = callback

    def __call__(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.callback.save_last = True
        try:
            type(self.callback).setup(self.callback, trainer, pl_module, stage)
        finally:
            self.callback.save_last = "link"


def fix_link_last(trainer: Any) -> None:
    """Install :class:`_LinkAfterCommit` on ModelCheckpoints with ``save_last="link"`` (idempotent)."""
    from lightning_zero.checkpoint.lightning.plugin import ZeroCheckpointIO

    if not isinstance(getattr(trainer.strategy, "checkpoint_io", None), ZeroCheckpointIO):
        return
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        if isinstance(callback, ModelCheckpoint) and callback.save_last == "link" and not isinstance(
            callback.__dict__.get("_link_checkpoint"), _LinkAfterCommit
        ):
            callback._link_checkpoint = _LinkAfterCommit(callback)  # type: ignore[method-assign]
            callback.setup = _SetupAllowingRemoteLink(callback)  # type: ignore[method-assign]


def install_checkpoint_reader() -> None:
    """Make ``LightningModule.load_from_checkpoint`` (and ``LightningDataModule``'s) read this package's
    ``local``/``sharded`` checkpoints: Lightning opens the path with ``torch.load`` and finds a commit
    marker without ``state_dict``; here the marker is followed and the whole checkpoint assembled, in
    this process, with no process group (the reader ``lightning-zero convert`` uses). Other files go to
    Lightning's own loader unchanged. Idempotent."""
    from lightning.pytorch.core import saving

    from lightning_zero import _compat

    original = _compat.lightning_loader()
    if getattr(original, "_lightning_zero", False):
        return

    # Only the arguments the caller gave are passed on: Lightning's own defaults apply to the rest.
    # Its `weights_only` default differs by version (False before 2.6, None meaning torch's default
    # from 2.6), and Lightning before 2.6 calls this without it; a default of ours would turn an
    # ordinary `load_from_checkpoint` into a different kind of load.
    def pl_load(path_or_url: Any, *args: Any, **kwargs: Any) -> Any:
        from lightning_zero.checkpoint import reader

        if isinstance(path_or_url, (str, os.PathLike)) and reader.is_zero_checkpoint(os.fspath(path_or_url)):
            # Only an explicit `load_from_checkpoint(..., weights_only=False)` (a file the caller trusts)
            # unpickles arbitrary objects; Lightning's defaults leave this package's reads weights-only.
            trusted = kwargs.get("weights_only") is False
            checkpoint = reader.read_lightning_checkpoint(os.fspath(path_or_url), optimizer=False,
                                                          weights_only=not trusted)
            checkpoint.setdefault("pytorch-lightning_version", _lightning_version())
            return checkpoint
        return original(path_or_url, *args, **kwargs)

    pl_load._lightning_zero = True  # type: ignore[attr-defined]
    saving.pl_load = pl_load


def _lightning_version() -> str:
    import lightning

    return lightning.__version__
