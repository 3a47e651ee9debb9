"""Async checkpoints of ZeRO state: ``local``, ``sharded`` (reshardable) and ``full`` modes."""

from lightning_zero.checkpoint.plugin import ZeroCheckpointIO
from lightning_zero.checkpoint.saver import (
    CheckpointSaveError,
    async_save,
    load,
    maybe_finalize_async_calls,
    read_mode,
    remove,
    save,
    wait_for_staging,
)
from lightning_zero.checkpoint.storage import CheckpointCorruptError, CheckpointNotFoundError
from lightning_zero.checkpoint.tree import FlatShard

__all__ = [
    "CheckpointCorruptError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "FlatShard",
    "ZeroCheckpointIO",
    "async_save",
    "load",
    "maybe_finalize_async_calls",
    "read_mode",
    "remove",
    "save",
    "wait_for_staging",
]
