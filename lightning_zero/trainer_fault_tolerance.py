"""The Trainer's side of fault tolerance across replica groups ([Note: one step across groups] in
engine/fault_tolerance.py): what a heal carries of the fit (loop counters, LR schedulers, the data position, the
checkpoint callbacks' state), what a discarded step must leave as it was (the trainer's step, the loggers' step, the
LR schedulers, the epoch's end), how each batch is split across the groups, and which group writes the checkpoints."""

from __future__ import annotations

import functools
from typing import Any

import torch
from lightning.pytorch import Trainer

from lightning_zero import _compat
from lightning_zero.data import replica_group_samplers
from lightning_zero.engine import ZeroEngine
from lightning_zero.engine.fault_tolerance import (
    FaultTolerance,
    ReplicaGroups,
    engine_state,
    load_engine_state,
)
from lightning_zero.engine.optimizer import ZeroOptimizer


class TrainerReplicaGroups:
    """One fit's fault tolerance: made at the strategy's setup of ``fit``, closed at its teardown."""

    def __init__(self, config: FaultTolerance, trainer: Trainer, group_rank: int, group_size: int,
                 device: torch.device) -> None:
        if not trainer.lightning_module.automatic_optimization:
            raise ValueError("Fault tolerance decides each step in the optimizer step of automatic optimization;"
                             " with `automatic_optimization = False` turn fault_tolerance off.")
        for name in ("val_check_interval", "limit_train_batches"):
            value = getattr(trainer, name)
            if isinstance(value, float) and value != 1.0:
                given = "overfit_batches" if name == "limit_train_batches" and trainer.overfit_batches else name
                raise ValueError(
                    f"Trainer({given}={value}) is a fraction of the epoch's batches, and with fault tolerance their"
                    " number changes with the replica groups taking part (each step takes participants x ranks x"
                    f" batch samples of the epoch): give `{given}` as a whole number of batches instead.")
        self.trainer = trainer
        self.groups = ReplicaGroups(config, group_rank, group_size, device)
        self._undo_schedulers: list[tuple[Any, dict[str, Any]]] = []
        self._undo_hyper: list[dict[str, Any]] | None = None
        self._engine: ZeroEngine | None = None

    def serve(self, engine: ZeroEngine) -> None:
        """What a heal transfers ([Note: healing] in engine/fault_tolerance.py), and the commit decision before each
        update (after the staging fence the strategy registered first)."""
        self._engine = engine
        self.groups.register_state("engine", lambda: engine_state(engine), lambda state: load_engine_state(engine, state))
        self.groups.register_state("trainer", self._save, self._load)
        self.groups.on_commit(self._samplers_follow)
        for optimizer in engine.optimizers:
            optimizer.register_pre_update_hook(functools.partial(self._decide, optimizer))

    def join(self) -> None:
        """``on_train_start``: a group behind the others heals before its first forward."""
        self.groups.join()

    def before_batch(self) -> None:
        """``on_train_batch_start``: the epoch's end where its order ends, a discarded step's scheduler steps
        undone, and this step's quorum asked for (the lighthouse answers while the forward runs)."""
        if any(sampler.last_batch_drawn for sampler in replica_group_samplers(self.trainer)):
            _compat.mark_last_batch(self.trainer, True)  # the epoch's order ends with this batch, if it commits
        self._undo_scheduler_steps()
        self.groups.start_step()

    def data_split(self) -> tuple[int, int]:
        """(ranks, rank) of the next batch across the replica groups (``ReplicaGroups.data_split``)."""
        return self.groups.data_split()

    def writes_checkpoints(self) -> bool:
        return self.groups.writes_checkpoints()

    def close(self) -> None:
        self.groups.close()

    def _save(self) -> dict[str, Any]:
        trainer = self.trainer
        return {"loops": _compat.loop_counters(trainer),
                "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
                "data": [(sampler.epoch, sampler.start) for sampler in replica_group_samplers(trainer)],
                "checkpoints": {callback.state_key: _compat.checkpoint_callback_state(callback)
                                for callback in trainer.checkpoint_callbacks}}

    def _load(self, state: dict[str, Any]) -> None:
        trainer = self.trainer
        _compat.load_loop_counters(trainer, state["loops"], in_step=not self.groups.joining)
        for config, saved in zip(trainer.lr_scheduler_configs, state["lr_schedulers"], strict=True):
            config.scheduler.load_state_dict(saved)
        in_step_ranks = None if self.groups.joining else self.data_split()[0]  # the quorum is loaded first
        for sampler, (epoch, start) in zip(replica_group_samplers(trainer), state["data"], strict=True):
            sampler.heal(epoch, start, in_step_ranks)
        # What the writing group's ModelCheckpoint wrote and keeps (its `last`, its top k, the step it saved last), so
        # that this group, once it writes, replaces and removes those files instead of versioning its own beside them
        # (`last-v1.ckpt`). Only a callback writing to the same directory: another group's directory is not this
        # group's to remove files from (each group's default directory is its own logger's).
        for callback in trainer.checkpoint_callbacks:
            saved = state["checkpoints"].get(callback.state_key)
            if saved is not None and saved["state"]["dirpath"] == callback.dirpath:
                _compat.load_checkpoint_callback_state(callback, saved)

    def _samplers_follow(self, committed: bool) -> None:
        for sampler in replica_group_samplers(self.trainer):
            sampler.commit(committed)

    def _decide(self, optimizer: ZeroOptimizer) -> None:
        if self.groups.decide(optimizer):
            return
        trainer = self.trainer
        _compat.discard_optimizer_step(trainer)
        _compat.mark_last_batch(trainer, False)  # the epoch goes on: its last batch is drawn again
        # The Trainer steps the LR schedulers after this step all the same: undone before the next batch.
        self._undo_schedulers = [(config.scheduler, config.scheduler.state_dict())
                                 for config in trainer.lr_scheduler_configs if config.interval == "step"]
        self._undo_hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]

    def _undo_scheduler_steps(self) -> None:
        """Back to the LR schedulers and hyper-parameters of before a discarded step's scheduler step."""
        if self._undo_hyper is None:
            return
        for scheduler, state in self._undo_schedulers:
            scheduler.load_state_dict(state)
        assert self._engine is not None
        for group, hyper in zip(self._engine.optimizers[0].param_groups, self._undo_hyper, strict=True):
            group.update(hyper)
        self._undo_schedulers, self._undo_hyper = [], None
