"""Async checkpoints of ZeRO state: ``local``, ``sharded`` (reshardable) and ``full`` modes.

The package by concern, each layer importing only the ones before it (tests/test_code_layout.py holds it):

* ``store/``: where bytes go (one object per kind of store behind a registry, locations, files, write-back);
* ``formats/``: what they mean (the ZeRO tree, CRCs, DeepSpeed's files);
* ``dcp/``, ``runtime/``: torch DCP for ``sharded``; the worker thread, staging, coordination, figures;
* ``modes/``: each mode one object (its writes, the load it prepares, its whole read), registered once by name;
  the verbs and the front ends ask it and never compare mode names;
* ``tiered/``: the local tier, its replicas, recovery and reshard;
* the verbs at this level: ``saver`` (when and how a save runs), ``loader`` (the load dispatch), ``opening``
  (what a path holds), ``reader`` (any checkpoint read whole), ``engine_tree`` (the engine's state as a tree),
  ``trainer_state`` (Lightning's non-tensor state, weights-only);
* ``lightning/``, ``interop/``: the front ends (the Lightning plugin, the Trainer's and Fabric's mappings,
  the resume, metrics) and the writers of other systems' layouts.

Users import from here; the names below are the public ones."""

from lightning_zero.checkpoint.engine_tree import zero_state_dict
from lightning_zero.checkpoint.formats.deepspeed_in import DeepSpeedCheckpoint, read_deepspeed
from lightning_zero.checkpoint.formats.tree import FlatShard
from lightning_zero.checkpoint.interop.convert import convert, save_pretrained
from lightning_zero.checkpoint.interop.dcp_out import to_dcp
from lightning_zero.checkpoint.interop.deepspeed_out import to_deepspeed
from lightning_zero.checkpoint.lightning.metrics import CheckpointMetrics, SaveStats
from lightning_zero.checkpoint.lightning.plugin import ZeroCheckpointIO
from lightning_zero.checkpoint.lightning.resume import load_weights, load_zero_state_dict
from lightning_zero.checkpoint.loader import load, read_mode
from lightning_zero.checkpoint.reader import read_lightning_checkpoint
from lightning_zero.checkpoint.runtime.stats import TierLoad
from lightning_zero.checkpoint.saver import (
    CheckpointSaveError,
    async_save,
    last_save_stats,
    link,
    maybe_finalize_async_calls,
    remove,
    remove_incomplete,
    save,
    wait_for_staging,
)
from lightning_zero.checkpoint.store.storage import CheckpointCorruptError, CheckpointNotFoundError
from lightning_zero.checkpoint.store.tuning import CheckpointTuning
from lightning_zero.checkpoint.tiered.tiers import LocalTier

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
