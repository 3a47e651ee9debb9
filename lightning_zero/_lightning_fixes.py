"""Work-arounds for Lightning behaviour that breaks sharded, remote checkpoints, each citing its issue."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint


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
        dirpath = str(self.callback.dirpath or "")
        if "://" not in dirpath:
            return found
        protocol = dirpath.split("://", 1)[0]
        return {p if "://" in p else f"{protocol}://{p}" for p in found}


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
        return type(self.launcher).launch(self.launcher, function, *args, trainer=trainer, **kwargs)
