"""What each checkpoint save cost, and the callback that puts it into Lightning's loggers.

The background saver fills one :class:`SaveStats` per save on every rank (see ``saver._save_job``);
a save's figures become readable once it has committed (:func:`~lightning_zero.checkpoint.last_save_stats`).
:class:`CheckpointMetrics` (which ``ZeroLowLevelStrategy`` adds to every ``fit`` that saves with
:class:`~lightning_zero.ZeroCheckpointIO`) logs rank 0's figures of each committed save at the next
train batch end, or at the end of ``fit`` for the saves ``teardown`` finalized. Reading them makes no
collective: every rank's figures are its own, and rank 0 writes the commit marker last, so its
``committed_after_s`` is when the checkpoint became loadable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

METRIC_PREFIX = "checkpoint/"


@dataclass
class SaveStats:
    """One save as this rank saw it. Times in seconds, measured with ``time.perf_counter``.

    ``blocked_s`` and ``staging_wait_s`` are what the training thread paid; the other times run on
    the background thread while training goes on."""

    url: str
    mode: str
    step: int | None = None
    """``global_step`` of the Lightning checkpoint (None for the functional API)."""
    blocked_s: float = 0.0
    """The training thread inside the save call (``ZeroLowLevelStrategy.save_checkpoint`` when it made the
    call: building the tree included, and waiting for the previous save to finalize when it had not)."""
    staging_wait_s: float = 0.0
    """How long the next optimizer update waited for this save's tensors to be copied."""
    staging_s: float = 0.0
    """Copying the tensors off the live state (background)."""
    write_s: float = 0.0
    """Serializing and writing this rank's files (background)."""
    commit_s: float = 0.0
    """From the end of this rank's writes until the commit marker is written and every rank knows it."""
    committed_after_s: float = 0.0
    """From the save call until committed."""
    bytes_written: int = 0
    """Tensor bytes this rank wrote, file overhead excluded (``local``: every tensor of its file;
    ``sharded``: its shards, and on rank 0 the replicated tensors, which DCP writes once; ``full``: rank 0
    the whole state, the others 0)."""

    @property
    def blocked_total_s(self) -> float:
        """Everything the training loop waited for this save."""
        return self.blocked_s + self.staging_wait_s

    @property
    def throughput_mb_s(self) -> float:
        """This rank's write rate, MB (10^6 bytes) per second of ``write_s``."""
        return self.bytes_written / self.write_s / 1e6 if self.write_s > 0 else 0.0

    def as_metrics(self, prefix: str = METRIC_PREFIX) -> dict[str, float]:
        """The figures as logger metrics (milliseconds for times)."""
        metrics = {
            "blocked_ms": self.blocked_s * 1e3,
            "staging_wait_ms": self.staging_wait_s * 1e3,
            "staging_ms": self.staging_s * 1e3,
            "write_ms": self.write_s * 1e3,
            "commit_ms": self.commit_s * 1e3,
            "committed_after_ms": self.committed_after_s * 1e3,
            "bytes": float(self.bytes_written),
            "throughput_mb_s": self.throughput_mb_s,
        }
        if self.step is not None:
            metrics["step"] = float(self.step)
        return {f"{prefix}{name}": value for name, value in metrics.items()}


class CheckpointMetrics(Callback):
    """Logs the figures of every committed checkpoint save from rank 0 to each of ``trainer.loggers``
    (``checkpoint/blocked_ms``, ``checkpoint/write_ms``, ``checkpoint/bytes``, ... at the trainer's
    ``global_step``; ``checkpoint/step`` is the step the save was made at).

    ``ZeroLowLevelStrategy`` adds one by itself; add your own instance to choose ``prefix`` or to show
    the newest save's time blocked and time to commit in the progress bar (``prog_bar=True``). No
    collective: each rank only drains its own records (so they do not pile up), and rank 0 logs."""

    def __init__(self, prefix: str = METRIC_PREFIX, prog_bar: bool = False) -> None:
        self.prefix = prefix
        self.prog_bar = prog_bar

    def _log_committed(self, trainer: Trainer, pl_module: LightningModule, in_step: bool) -> None:
        from lightning_zero.checkpoint import saver

        committed = saver.take_committed_stats()
        if not trainer.is_global_zero:
            return
        for stats in committed:
            metrics = stats.as_metrics(self.prefix)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        if self.prog_bar and in_step and committed:
            newest = committed[-1]
            # Rank 0 only (rank_zero_only): no reduction, and so no collective; the bar keeps the value.
            for name, value in (("ckpt_blocked_ms", newest.blocked_total_s), ("ckpt_commit_ms", newest.committed_after_s)):
                pl_module.log(name, value * 1e3, prog_bar=True, logger=False, on_step=True, on_epoch=False,
                              rank_zero_only=True)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._log_committed(trainer, pl_module, in_step=True)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After the strategy's teardown, which finalized the saves still in flight; before the loggers
        # are finalized (Lightning's teardown hooks come next). `self.log` is not allowed here.
        self._log_committed(trainer, pl_module, in_step=False)
