"""ZeroCheckpointIO: the Lightning CheckpointIO plugin over the async saver."""

from __future__ import annotations

import os
from typing import Any

from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from typing_extensions import override

from lightning_zero import _compat
from lightning_zero.checkpoint import saver
from lightning_zero.checkpoint.metrics import SaveStats
from lightning_zero.checkpoint.saver import Mode
from lightning_zero.checkpoint.trainer_state import MARKER_FIELDS, TREE_TAG


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
    """

    def __init__(self, mode: Mode = "sharded", async_save: bool = True,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.mode: Mode = saver.validate_mode(mode)
        self.async_save = async_save
        self.storage_options = dict(storage_options or {})
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
                         marker_fields=checkpoint.get(MARKER_FIELDS))
        if not self.async_save:
            saver.maybe_finalize_async_calls(blocking=True)

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

    @override
    def teardown(self) -> None:
        saver.maybe_finalize_async_calls(blocking=True)


def _claim_key(path: Any) -> str:
    return os.fspath(path).rstrip("/")
