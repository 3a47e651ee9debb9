"""ZeroCheckpointIO: the Lightning CheckpointIO plugin over the async saver, and the one door of the
checkpoint package for ZeroLowLevelStrategy (the staging fence, finalizing, the coordination group)."""

from __future__ import annotations

import os
from typing import Any

from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from typing_extensions import override

from lightning_zero import _compat
from lightning_zero.checkpoint import saver
from lightning_zero.checkpoint.modes import Mode, validate_mode
from lightning_zero.checkpoint.scheduler import checkpointer
from lightning_zero.checkpoint.stats import SaveStats
from lightning_zero.checkpoint.team import set_up_coordination
from lightning_zero.checkpoint.trainer_state import MARKER_FIELDS, TREE_TAG
from lightning_zero.checkpoint.tuning import DEFAULT_TUNING, CheckpointTuning


class ZeroCheckpointIO(CheckpointIO):
    """Writes ZeroLowLevelStrategy checkpoints asynchronously through fsspec.

    Args:
        mode: ``"local"`` (each rank its own shard, no collectives on the training thread, loads
            at the same world size only), ``"sharded"`` (reshardable: loads at any world size) or
            ``"full"`` (one file on rank 0 that plain ``torch.load`` and
            ``LightningModule.load_from_checkpoint`` read).
        async_save: return from ``save_checkpoint`` once the save is queued; tensors are copied
            off the live state in the background, before the next optimizer step.
        storage_options: passed to fsspec (S3 endpoint, profile, credentials). Never written into
            a checkpoint or a log.
        tuning: the I/O knobs (writer and reader threads, page-cache writeback, the collector pause);
            the defaults of :class:`~lightning_zero.checkpoint.CheckpointTuning` when not given.
    """

    def __init__(self, mode: Mode = "sharded", async_save: bool = True,
                 storage_options: dict[str, Any] | None = None, tuning: CheckpointTuning | None = None) -> None:
        self.mode: Mode = validate_mode(mode)
        self.async_save = async_save
        self.storage_options = dict(storage_options or {})
        self.tuning = tuning or DEFAULT_TUNING
        self._plain = TorchCheckpointIO()
        # Paths this plugin has saved to (queued, in flight or committed) and not removed since.
        self._claimed: set[str] = set()

    def __repr__(self) -> str:  # storage_options may hold credentials: not shown
        return f"ZeroCheckpointIO(mode={self.mode!r}, async_save={self.async_save})"

    @property
    def last_save_stats(self) -> SaveStats | None:
        """This rank's figures (time blocked, staging, write, commit, bytes) of its newest committed save,
        None before the first commit. The same as :func:`lightning_zero.checkpoint.last_save_stats`."""
        return saver.last_save_stats()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """(every rank) ``checkpoint`` is the tree ZeroLowLevelStrategy built for this plugin's mode."""
        if checkpoint.get(TREE_TAG) != self.mode:
            # Not a tree from ZeroLowLevelStrategy (e.g. the spawn launcher handing weights to the
            # main process): an ordinary synchronous single-file save by this rank.
            self._plain.save_checkpoint(checkpoint, path, storage_options=storage_options)
            self._claimed.add(_claim_key(path))
            return
        self._claimed.add(_claim_key(path))
        options = {**self.storage_options, **(storage_options or {})}
        tree = {k: v for k, v in checkpoint.items() if k != MARKER_FIELDS}
        saver.async_save(tree, os.fspath(path), mode=self.mode, storage_options=options,
                         marker_fields=checkpoint.get(MARKER_FIELDS), tuning=self.tuning)
        if not self.async_save:
            self.finalize()

    @override
    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """A single-file checkpoint (``full`` mode, or any ordinary one). Sharded checkpoints are loaded
        by ZeroLowLevelStrategy itself (``trainer.fit(ckpt_path=...)``) or ``checkpoint.load``."""
        return _compat.plain_checkpoint_load(self._plain, path, map_location, weights_only)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """(one rank) Removal waits until the save in flight has committed, and is dropped if it fails."""
        saver.remove(os.fspath(path), self.storage_options)
        self._claimed.discard(_claim_key(path))

    def is_claimed(self, path: Any) -> bool:
        """Whether this process saved to ``path`` and has not removed it: a name that is taken although
        an async save has not committed there yet (Lightning's ``ModelCheckpoint`` asks whether a
        file exists to pick its ``-vN`` name; ZeroLowLevelStrategy makes it ask this too)."""
        return _claim_key(path) in self._claimed

    def set_up(self, local_ranks: int | None = None) -> None:
        """(collective, every rank, training thread) Create the group background saves coordinate over,
        so that no save has to make a collective on the training thread. ``local_ranks``: the ranks on
        this node, which share its CPUs between their reader threads."""
        set_up_coordination(local_ranks)

    def wait_for_staging(self) -> None:
        """Block until the save in flight has copied its tensors: the optimizer's pre-update fence."""
        checkpointer().wait_for_staging()

    def note_blocked(self, seconds: float) -> None:
        """The caller's measure of the training thread's time in the newest save (tree building included)."""
        checkpointer().note_blocked(seconds)

    def finalize(self, blocking: bool = True) -> bool:
        """Finish the save in flight (``blocking``) or check on it; True when none is left. Raises
        :class:`~lightning_zero.checkpoint.CheckpointSaveError` if it failed."""
        return checkpointer().finalize(blocking)

    def link(self, path: Any, link_path: Any) -> None:
        """(one rank) Make ``link_path`` another name of the checkpoint at ``path`` once it has committed."""
        saver.link(os.fspath(path), os.fspath(link_path), self.storage_options)

    @override
    def teardown(self) -> None:
        self.finalize()

    def release(self) -> None:
        """(every rank, after the last save was finalized) End the worker thread and the coordination
        group (the next save or load makes them again)."""
        saver.release()


def _claim_key(path: Any) -> str:
    return os.fspath(path).rstrip("/")
