"""Lightning's whole lifecycle on ranks that stay alive between Trainer calls (as under torchrun).

``run_distributed`` workers already hold a gloo group; with ``LOCAL_RANK``/``WORLD_SIZE`` set,
Lightning sees processes created externally (torchrun's contract), launches nothing and keeps
the group, so ``fit``, ``save_checkpoint``, ``validate`` ... run one after another on every rank,
as a user's script does. Functions here run inside those workers, so they live in a module.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from checkpoint_cases import metadata_opens
from engine_cases import global_batch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning_cases import NetModule, loader, local_slice
from torch import nn

from lightning_zero import ZeroLowLevelStrategy
from lightning_zero.checkpoint import ZeroCheckpointIO, read_lightning_checkpoint

STEPS = 4


def as_torchrun(rank: int, world_size: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size), RANK=str(rank))


class EvalNet(NetModule):
    """NetModule with validation/test/predict steps whose loss is the MSE on the whole global batch."""

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = local_slice(self, batch)
        return F.mse_loss(self.net(x.to(self.dtype)), y.to(self.dtype))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = local_slice(self, batch)
        return self.net(x.to(self.dtype))


def trainer(world_size: int, mode: str, root: str, *, callbacks: list[Callback] | None = None,
            precision: str = "32-true", logger: Any = False, **strategy_kwargs: Any) -> Trainer:
    return Trainer(
        accelerator="cpu", devices=world_size, max_steps=STEPS, precision=precision,  # type: ignore[arg-type]
        strategy=ZeroLowLevelStrategy(stage=2, bucket_size_mb=0.0005, **strategy_kwargs),
        plugins=[ZeroCheckpointIO(mode=mode)],  # type: ignore[arg-type]
        callbacks=callbacks or [], logger=logger,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks or []),
        use_distributed_sampler=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, num_sanity_val_steps=0,
    )


def fit_then_save_everywhere(rank: int, world_size: int, root: str, mode: str) -> dict[str, Any]:
    """fit (ModelCheckpoint at the last step), save_checkpoint after fit, then validate/test/predict
    and a save after each. What rank 0 reads back from every file, and the weights after fit."""
    as_torchrun(rank, world_size)
    module = EvalNet(scheduler=True)
    callback = ModelCheckpoint(dirpath=f"{root}/ckpts", every_n_train_steps=STEPS, filename="last-step")
    t = trainer(world_size, mode, root, callbacks=[callback])
    t.fit(module, loader(STEPS, 1, world_size))
    t.save_checkpoint(f"{root}/after-fit.ckpt")
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    t.validate(module, loader(1, 1, world_size), verbose=False)
    t.save_checkpoint(f"{root}/after-validate.ckpt")
    t.test(module, loader(1, 1, world_size), verbose=False)
    t.save_checkpoint(f"{root}/after-test.ckpt")
    t.predict(module, loader(1, 1, world_size))
    t.save_checkpoint(f"{root}/after-predict.ckpt")
    dist.barrier()
    if rank != 0:
        return {}
    names = ("ckpts/last-step.ckpt", "after-fit.ckpt", "after-validate.ckpt", "after-test.ckpt", "after-predict.ckpt")
    return {"weights": weights, **{name: read_lightning_checkpoint(f"{root}/{name}") for name in names}}


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.metrics["val_loss"] = float(trainer.callback_metrics["val_loss"])

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.metrics["test_loss"] = float(trainer.callback_metrics["test_loss"])


def reference_loss(weights: dict[str, torch.Tensor], world_size: int) -> float:
    """Plain PyTorch: the MSE of these weights on global batch 0, averaged over ``world_size`` slices."""
    module = EvalNet()
    module.load_state_dict(weights)
    x, y = global_batch(0, 0, world_size)
    with torch.no_grad():
        losses = [F.mse_loss(module.net(xs), ys) for xs, ys in zip(x.chunk(world_size), y.chunk(world_size))]
    return float(torch.stack(losses).mean())


def evaluate_from(rank: int, world_size: int, root: str, mode: str, path: str) -> dict[str, Any]:
    """In fresh processes: validate, test and predict from ``path`` with a module of other weights."""
    as_torchrun(rank, world_size)
    module = EvalNet()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(3.0)  # the checkpoint must overwrite every weight
    recorder = LossRecorder()
    t = trainer(world_size, mode, root, callbacks=[recorder])
    with metadata_opens() as opened:
        t.validate(module, loader(1, 1, world_size), ckpt_path=path, verbose=False)
        t.test(module, loader(1, 1, world_size), ckpt_path=path, verbose=False)
        predictions = t.predict(module, loader(1, 1, world_size), ckpt_path=path)
    return {**recorder.metrics, "weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "prediction": predictions[0] if predictions else None, "metadata_opens": len(opened)}


class BNNet(NetModule):
    """The engine cases' Net behind a BatchNorm, fed different data on each rank."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.bn = nn.BatchNorm1d(7)
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        # Buffers at the start of the step: rank 0's after the broadcast.
        self.seen.append(torch.cat([self.bn.running_mean, self.bn.running_var]).clone())
        x, y = local_slice(self, batch)
        x = x + self.global_rank  # different statistics on every rank
        return F.mse_loss(self.net(self.bn(x)), y)


def batchnorm_run(rank: int, world_size: int, root: str, mode: str) -> dict[str, Any]:
    as_torchrun(rank, world_size)
    module = BNNet()
    t = trainer(world_size, mode, root)
    t.fit(module, loader(STEPS, 1, world_size))
    t.save_checkpoint(f"{root}/bn.ckpt")
    final = torch.cat([module.bn.running_mean, module.bn.running_var]).clone()
    dist.barrier()
    saved = read_lightning_checkpoint(f"{root}/bn.ckpt")["state_dict"] if rank == 0 else None
    return {"seen": torch.stack(module.seen), "final": final, "saved": saved}


def lr_monitor_keys(rank: int, world_size: int, root: str) -> list[str]:
    from lightning.pytorch.loggers import CSVLogger

    as_torchrun(rank, world_size)
    monitor = LearningRateMonitor(logging_interval="step")
    t = trainer(world_size, "sharded", root, callbacks=[monitor], logger=CSVLogger(root))
    t.fit(NetModule(scheduler=True), loader(STEPS, 1, world_size))
    return sorted(monitor.lrs)


class StagingClock(Callback):
    """Slows this process's staging and records when it ends and when training steps start."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.events: list[tuple[str, float]] = []

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        from lightning_zero.checkpoint.runtime.staging import Stager

        real_stage = Stager.stage

        def slow_stage(stager: Stager, tree: Any, *args: Any, **kwargs: Any) -> Any:
            time.sleep(self.delay)
            staged = real_stage(stager, tree, *args, **kwargs)
            self.events.append(("staged", time.perf_counter()))
            return staged

        Stager.stage = slow_stage  # type: ignore[method-assign]

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.events.append(("batch_start", time.perf_counter()))

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self.events.append(("save", time.perf_counter()))


class TimedNet(NetModule):
    def __init__(self, clock: StagingClock) -> None:
        super().__init__()
        self.clock = clock

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.clock.events.append(("training_step", time.perf_counter()))
        return super().training_step(batch, batch_idx)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        self.clock.events.append(("updated", time.perf_counter()))


def staging_overlap(rank: int, world_size: int, root: str, delay: float) -> list[tuple[str, float]]:
    as_torchrun(rank, world_size)
    clock = StagingClock(delay)
    callback = ModelCheckpoint(dirpath=f"{root}/ckpts", every_n_train_steps=1, save_top_k=-1)
    t = trainer(world_size, "local", root, callbacks=[callback, clock])
    t.fit(TimedNet(clock), loader(STEPS, 1, world_size))
    return clock.events


def fit_steps(rank: int, world_size: int, root: str, mode: str, precision: str, max_steps: int,
              ckpt_path: str | None = None, save: bool = False) -> dict[str, torch.Tensor]:
    """Fit NetModule (AdamW, StepLR) to ``max_steps`` at ``precision``, 2 steps an epoch (a resume
    at an epoch boundary sees the same batches as the uninterrupted run); the weights afterwards.
    ``save``: a checkpoint at every epoch's end."""
    as_torchrun(rank, world_size)
    module = NetModule(scheduler=True)
    callbacks: list[Callback] = [ModelCheckpoint(dirpath=f"{root}/ckpts", save_top_k=-1)] if save else []
    t = trainer(world_size, mode, root, callbacks=callbacks, precision=precision)
    # Stop by epochs (2 steps each), as a resumed run is normally configured.
    t.fit_loop.epoch_loop.max_steps = -1
    t.fit_loop.max_epochs = max_steps // 2
    t.fit(module, loader(2, 1, world_size), ckpt_path=ckpt_path)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}
