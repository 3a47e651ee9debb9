"""What each checkpoint save cost, and the callback that puts it into Lightning's loggers.

The background saver fills one :class:`SaveStats` per save on every rank (see ``saver._save_job``);
a save's figures become readable once it has committed (:func:`~lightning_zero.checkpoint.last_save_stats`).
:class:`CheckpointMetrics` (which ``ZeroLowLevelStrategy`` adds to every ``fit`` that saves with
:class:`~lightning_zero.ZeroCheckpointIO`) logs rank 0's figures of each committed save at the next
train batch end, or at the end of ``fit`` for the saves ``teardown`` finalized. Reading them makes no
collective: every rank's figures are its own, and rank 0 writes the commit marker last, so its
``committed_after_s`` is when the checkpoint became loadable. After a resume through the local tier's
choice (``ckpt_path="last"``), the first optimizer step completes the recovery's timeline
(``checkpoint/recovery/*``, kept on ``ZeroCheckpointIO.last_load``), which rank 0 logs once.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_zero.checkpoint.lightning.plugin import ZeroCheckpointIO, link_of
from lightning_zero.checkpoint.runtime.scheduler import checkpointer
from lightning_zero.checkpoint.runtime.stats import METRIC_PREFIX, SaveStats

__all__ = ["METRIC_PREFIX", "CheckpointMetrics", "SaveStats"]


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
        self._start_step = 0

    def _log_committed(self, trainer: Trainer, pl_module: LightningModule, in_step: bool) -> None:
        committed = checkpointer().take_committed()
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

    def _log_recovery(self, trainer: Trainer) -> None:
        """The first optimizer step after a resume through the local tier's choice completes the recovery's
        timeline ([Note: a recovery's timeline] in runtime/stats.py); rank 0 logs it once."""
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, ZeroCheckpointIO) or trainer.global_step <= self._start_step:
            return
        done = link_of(io).record_first_step()  # None without a resume, or once the timeline is complete
        if done is None or not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            logger.log_metrics(done.as_metrics(self.prefix), step=trainer.global_step)
        parts = [f"{name} {value:.3f} s" for name, value in (
            ("restart", done.restart_s), ("startup", done.startup_s), ("choose", done.choose_s),
            ("reshard", done.reshard_s), ("load", done.load_s), ("first step", done.first_step_s)) if value is not None]
        whole = done.failure_to_step_s
        rank_zero_info(f"Recovered at step {trainer.global_step} from the {done.tier} tier"
                       + (f" {whole:.3f} s after the newest local-tier save" if whole is not None else "")
                       + f": {', '.join(parts)}; {done.steps_lost} checkpointed step(s) lost.")

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start_step = trainer.global_step  # the step resumed at, whichever checkpoint gave it

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._log_recovery(trainer)
        self._log_committed(trainer, pl_module, in_step=True)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After the strategy's teardown, which finalized the saves still in flight; before the loggers
        # are finalized (Lightning's teardown hooks come next). `self.log` is not allowed here.
        self._log_committed(trainer, pl_module, in_step=False)
