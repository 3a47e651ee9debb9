"""Programs written elsewhere, as they use a strategy (tests/checkpoint/test_client_programs.py).

``fabric_pretrain_loop`` is the shape of litgpt's Fabric loops: ``fabric.setup_module`` then
``fabric.setup_optimizers``, a few steps, ``fabric.save(path, {"model": ..., "optimizer": ..., "iter_num": ...})``;
the file is then read the way litgpt's tools read it, ``torch.load(path)["model"]`` into a fresh module with
``strict=True``. ``RopeNet`` has a buffer registered with ``persistent=False`` (litgpt's rope ``cos``/``sin``),
which ``state_dict()`` leaves out, and a persistent one.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from fabric_cases import make_fabric
from lifecycle_cases import as_torchrun
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader

from lightning_zero import ZeroLowLevelStrategy
from lightning_zero.checkpoint import ZeroCheckpointIO

STEPS = 3
ROWS = 6


class RopeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(5, 8)
        self.head = nn.Linear(8, 5)
        self.register_buffer("cos", torch.arange(8.0).cos(), persistent=False)
        self.register_buffer("scale", torch.full((8,), 0.9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x)) * self.cos * self.scale)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(ROWS, 5, generator=g), torch.randn(ROWS, 5, generator=g)


def _fabric_strategy(strategy: str) -> Any:
    if strategy == "ddp":
        from lightning.fabric.strategies import DDPStrategy as FabricDDP

        return FabricDDP()
    from lightning_zero.fabric import ZeroLowLevelStrategy as FabricZero

    return FabricZero(stage=int(strategy[-1]), bucket_size_mb=0.0001)


def fabric_pretrain_loop(rank: int, world_size: int, strategy: str, mode: str, path: str) -> dict[str, Any]:
    """litgpt's loop shape; saves at the end and returns the module's ``state_dict`` and the optimizer's state."""
    plugins = [ZeroCheckpointIO(mode=mode, async_save=True)] if strategy != "ddp" else None  # type: ignore[arg-type]
    fabric = make_fabric(rank, world_size, _fabric_strategy(strategy), plugins=plugins)
    model = fabric.setup_module(RopeNet())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1))
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    state = {"model": model, "optimizer": optimizer, "iter_num": STEPS, "step_count": STEPS,
             "train_dataloader": {"position": STEPS * ROWS}}
    fabric.save(path, state)
    weights = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    if strategy != "ddp":
        fabric.strategy.teardown()  # the save in flight is finished here
    else:
        fabric.barrier()
    return {"weights": weights}


def fabric_load_back(rank: int, world_size: int, path: str, resave: str | None = None) -> dict[str, Any]:
    """``fabric.load(path)`` (no state: the whole checkpoint) and ``fabric.load(path, state)`` into a fresh
    zero2 loop: what a resume gets. ``resave``: the loaded state saved again there, as one full file."""
    plugins = [ZeroCheckpointIO(mode="full", async_save=False)] if resave else None
    fabric = make_fabric(rank, world_size, _fabric_strategy("zero2"), plugins=plugins)
    whole = fabric.load(path)
    model = fabric.setup_module(RopeNet())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "iter_num": 0, "step_count": 0,
                             "train_dataloader": {}}
    fabric.load(path, state)
    weights = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    if resave:
        fabric.save(resave, state)
    fabric.strategy.teardown()
    return {"whole_keys": sorted(whole), "whole_model": {k: v.clone() for k, v in whole["model"].items()},
            "iter_num": state["iter_num"], "dataloader": state["train_dataloader"], "weights": weights}


class RopeModule(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = RopeNet()

    def training_step(self, batch_: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch_
        ws, rank = self.trainer.world_size, self.global_rank
        return F.mse_loss(self.net(x.chunk(ws)[rank]), y.chunk(ws)[rank])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _trainer(world_size: int, strategy: str, mode: str, root: str, max_steps: int,
             callbacks: list[Callback] | None = None) -> Trainer:
    if strategy == "ddp":
        chosen: Any = DDPStrategy()
        plugins: list[Any] = []
    else:
        chosen = ZeroLowLevelStrategy(stage=int(strategy[-1]), bucket_size_mb=0.0001)  # type: ignore[arg-type]
        plugins = [ZeroCheckpointIO(mode=mode)]  # type: ignore[arg-type]
    return Trainer(accelerator="cpu", devices=world_size, strategy=chosen, plugins=plugins, max_steps=max_steps,
                   callbacks=callbacks,
                   logger=False, enable_checkpointing=False, use_distributed_sampler=False,
                   enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)


def trainer_fit_save_resume(rank: int, world_size: int, strategy: str, mode: str, root: str) -> dict[str, Any]:
    """Fit, ``trainer.save_checkpoint`` after fit, then a fresh Trainer resumes from that file and fits on."""
    as_torchrun(rank, world_size)
    data = DataLoader([batch(step) for step in range(2 * STEPS)], batch_size=None)
    path = os.path.join(root, f"{strategy}-{mode}.ckpt")
    module = RopeModule()
    trainer = _trainer(world_size, strategy, mode, root, STEPS)
    trainer.fit(module, data)
    trainer.save_checkpoint(path)
    trainer.strategy.barrier()
    resumed = RopeModule()
    second = _trainer(world_size, strategy, mode, root, 2 * STEPS)
    second.fit(resumed, data, ckpt_path=path)
    return {"path": path, "global_step": second.global_step,
            "weights": {k: v.detach().clone() for k, v in resumed.state_dict().items()}}


FABRIC_RUNS = [("ddp", "full"), ("zero1", "full"), ("zero2", "full"), ("zero2", "sharded"), ("zero2", "local")]
TRAINER_RUNS = [("ddp", "full"), ("zero1", "full"), ("zero2", "full"), ("zero2", "sharded"), ("zero2", "local")]


def fabric_runs(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Every Fabric run in one start of the ranks, then each zero checkpoint loaded back by a fresh loop."""
    out: dict[str, Any] = {}
    for strategy, mode in FABRIC_RUNS:
        path = os.path.join(root, f"fabric-{strategy}-{mode}.pth")
        out[f"{strategy}-{mode}"] = {"path": path, **fabric_pretrain_loop(rank, world_size, strategy, mode, path)}
    for strategy, mode in FABRIC_RUNS[1:]:
        out[f"{strategy}-{mode}"]["loaded"] = fabric_load_back(rank, world_size, out[f"{strategy}-{mode}"]["path"])
    # A run that saved under Fabric's DDP goes on under zero2: its file loads, and saves again the same.
    out["ddp-full"]["loaded"] = fabric_load_back(rank, world_size, out["ddp-full"]["path"],
                                                 resave=os.path.join(root, "ddp-full-resaved.pth"))
    return out


def trainer_runs(rank: int, world_size: int, root: str) -> dict[str, Any]:
    return {f"{s}-{m}": trainer_fit_save_resume(rank, world_size, s, m, root) for s, m in TRAINER_RUNS}


class TypeKeyedState(Callback):
    """Lightning's ``OldStatefulCallback`` (tests_pytorch/callbacks/test_callbacks.py): its state is keyed by its
    class, an object a ``weights_only`` load refuses, so only ``weights_only=False`` resumes it."""

    def __init__(self, state: int) -> None:
        self.state = state

    @property
    def state_key(self) -> Any:
        return type(self)

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict["state"]


WEIGHTS_ONLY_RUNS = [("ddp", "full"), ("zero2", "full"), ("zero2", "sharded"), ("zero1", "local")]


def weights_only_resumes(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Each run saves with a TypeKeyedState(111), then fresh Trainers resume with ``weights_only`` None, True
    and False; returns the callback's state after each resume, or the error."""
    as_torchrun(rank, world_size)
    data = DataLoader([batch(step) for step in range(2 * STEPS)], batch_size=None)
    out: dict[str, Any] = {}
    for strategy, mode in WEIGHTS_ONLY_RUNS:
        path = os.path.join(root, f"weights-only-{strategy}-{mode}.ckpt")
        first = _trainer(world_size, strategy, mode, root, 1, callbacks=[TypeKeyedState(111)])
        first.fit(RopeModule(), data)
        first.save_checkpoint(path)
        first.strategy.barrier()
        for weights_only in (None, True, False):
            callback = TypeKeyedState(222)
            second = _trainer(world_size, strategy, mode, root, 2, callbacks=[callback])
            try:
                second.fit(RopeModule(), data, ckpt_path=path, weights_only=weights_only)
                outcome: Any = callback.state
            except Exception as exc:  # every rank fails alike (the load agrees before any state is used)
                outcome = f"{type(exc).__name__}: {exc}"
            out[f"{strategy}-{mode}-{weights_only}"] = outcome
    return out
