"""Async checkpoints of ZeRO state: ``local``, ``sharded`` (reshardable) and ``full`` modes."""

from lightning_zero.checkpoint.convert import convert, save_pretrained
from lightning_zero.checkpoint.dcp_out import to_dcp
from lightning_zero.checkpoint.deepspeed_in import DeepSpeedCheckpoint, read_deepspeed
from lightning_zero.checkpoint.deepspeed_out import to_deepspeed
from lightning_zero.checkpoint.engine_tree import zero_state_dict
from lightning_zero.checkpoint.lightning_tree import load_weights, load_zero_state_dict
from lightning_zero.checkpoint.metrics import CheckpointMetrics, SaveStats
from lightning_zero.checkpoint.plugin import ZeroCheckpointIO
from lightning_zero.checkpoint.reader import read_lightning_checkpoint
from lightning_zero.checkpoint.saver import (
    CheckpointSaveError,
    async_save,
    last_save_stats,
    link,
    load,
    maybe_finalize_async_calls,
    read_mode,
    remove,
    remove_incomplete,
    save,
    wait_for_staging,
)
from lightning_zero.checkpoint.stats import TierLoad
from lightning_zero.checkpoint.storage import CheckpointCorruptError, CheckpointNotFoundError
from lightning_zero.checkpoint.tiers import LocalTier
from lightning_zero.checkpoint.tree import FlatShard
from lightning_zero.checkpoint.tuning import CheckpointTuning

__all__ = [
    "CheckpointCorruptError",
    "CheckpointMetrics",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CheckpointTuning",
    "DeepSpeedCheckpoint",
    "FlatShard",
    "LocalTier",
    "SaveStats",
    "TierLoad",
    "ZeroCheckpointIO",
    "async_save",
    "convert",
    "last_save_stats",
    "link",
    "load",
    "load_weights",
    "load_zero_state_dict",
    "maybe_finalize_async_calls",
    "read_deepspeed",
    "read_lightning_checkpoint",
    "read_mode",
    "remove",
    "remove_incomplete",
    "save",
    "save_pretrained",
    "to_dcp",
    "to_deepspeed",
    "wait_for_staging",
    "zero_state_dict",
]
