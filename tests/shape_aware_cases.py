"""Shape-aware (Muon, Adafactor) and declared optimizers: N gloo ranks against one plain process.

The model's matrices have element counts that divide by neither 2 nor 3, it has tall and wide
matrices (Muon transposes one of them), a 1-element parameter and a layer that is never called (an
unused parameter: no gradient on any rank, so no update and no state).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn

import lightning_zero
from lightning_zero import ZeroConfig, ZeroEngine


class MixNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 7)  # weight 7x5 = 35 elements (tall)
        self.hidden = nn.Linear(7, 11)  # 11x7 = 77 (tall)
        self.unused = nn.Linear(11, 11)  # never called
        self.out = nn.Linear(11, 5)  # 5x11 = 55 (wide)
        self.scale = nn.Parameter(torch.tensor([1.25]))  # one element: empty on every rank but 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        h = torch.tanh(self.hidden(h))
        return self.out(h) * self.scale


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): elementwise (sign of an interpolated momentum), unknown to ZeRO
    until declared."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = state["exp_avg"].mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                state["exp_avg"].mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return None


class TrustRatioSGD(torch.optim.Optimizer):
    """LARS-like: each parameter's step is scaled by ||p|| / ||g|| (a whole-parameter norm)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["ratio"] = p.norm() / p.grad.norm().clamp(min=1e-12)  # whole: a 0-dim tensor
                p.add_(p.grad * state["ratio"], alpha=-group["lr"])
        return None


class AdamWithOwnStep(torch.optim.Adam):
    """A subclass that overrides ``step``: ZeRO cannot tell what it does."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        return super().step(closure)


class AdamWithDefaults(torch.optim.Adam):
    """A subclass that only fixes defaults: still Adam."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.02)


# Declared at import, so every process (spawned, forked, the Trainer's) knows them.
lightning_zero.register_optimizer(Lion, kind="elementwise")
lightning_zero.register_optimizer(TrustRatioSGD, kind="shape_aware")


def initial_mixnet() -> MixNet:
    torch.manual_seed(0)
    return MixNet()


def _matrices(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    matrices = [p for p in model.parameters() if p.ndim == 2]
    return matrices, [p for p in model.parameters() if p.ndim != 2]


ELEMENTWISE = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=True),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=0.01),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=0.01),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=0.01),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=0.05, t0=1),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=0.01),
    "lion": lambda ps: Lion(ps, lr=0.01, weight_decay=0.1),
    "adam-subclass": lambda ps: AdamWithDefaults(ps),
}


def make_optimizers(name: str, model: nn.Module) -> list[torch.optim.Optimizer]:
    """``muon-adamw``: Muon for the matrices, AdamW for the rest, as Muon is used."""
    matrices, rest = _matrices(model)
    if name == "muon-adamw":
        return [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1),
                torch.optim.AdamW(rest, lr=0.01, weight_decay=0.0)]
    if name == "muon-nesterov-off":
        return [torch.optim.Muon(matrices, lr=0.05, nesterov=False, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(rest, lr=0.01)]
    if name == "adafactor":  # two groups: the vectors get no weight decay
        return [torch.optim.Adafactor([{"params": matrices, "weight_decay": 0.1}, {"params": rest}], lr=0.02)]
    if name == "trust-ratio":
        return [TrustRatioSGD(model.parameters(), lr=0.05)]
    return [ELEMENTWISE[name](list(model.parameters()))]


def batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4 * world_size, 5, generator=g), torch.randn(4 * world_size, 5, generator=g)


@dataclass(frozen=True)
class Run:
    optimizer: str
    stage: int = 2
    steps: int = 3
    shard_group_size: int | None = None
    bucket_size_mb: float = 0.0003  # a few buckets
    gather_masters: bool = False
    """Gather the masters of fp32 parameters too (as under bf16 parameters) instead of reading the module."""
    clip_norm: float | None = None
    """Clip each optimizer's gradients by their global norm before its step."""
    whole_step_group_mb: float | None = 1024.0
    """ZeroConfig's bound on a whole-matrix step's temporaries (tiny: one parameter at a time)."""
    """Gather the masters of fp32 parameters too (as under bf16 parameters) instead of reading the module."""


def build(run: Run, rank: int = 0) -> tuple[MixNet, ZeroEngine]:
    model = initial_mixnet()
    if rank:
        with torch.no_grad():  # the engine starts every rank from rank 0's weights
            for p in model.parameters():
                p.add_(1.0)
    engine = ZeroEngine(model, make_optimizers(run.optimizer, model),
                        ZeroConfig(run.stage, run.bucket_size_mb, shard_group_size=run.shard_group_size,
                                   whole_step_group_mb=run.whole_step_group_mb))
    return model, engine


def train(model: nn.Module, engine: ZeroEngine, steps: range, rank: int, world_size: int,
          clip_norm: float | None = None) -> None:
    for step in steps:
        x, y = batch(step, world_size)
        loss = F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
        loss.backward()
        engine.ensure_flushed()
        for opt in engine.optimizers:
            if clip_norm is not None:
                opt.clip_grad_norm_(clip_norm)
            opt.step()
        for opt in engine.optimizers:
            opt.zero_grad()


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_zero(rank: int, world_size: int, run: Run) -> dict[str, Any]:
    from unittest import mock

    from lightning_zero.engine import whole_step

    model, engine = build(run, rank)
    with mock.patch.object(whole_step, "MASTERS_FROM_MODULE", not run.gather_masters):
        train(model, engine, range(run.steps), rank, world_size, run.clip_norm)
    result = {"params": params(model), "shard_numel": engine.optimizer_shard_numel,
              "state_bytes": state_bytes(engine),
              "gathered_bytes": sum(o.whole_step.gathered_bytes for o in engine.optimizers if o.whole_step),
              "groups_stepped": [o.whole_step.groups_stepped if o.whole_step else None for o in engine.optimizers]}
    engine.close()
    return result


def run_many(rank: int, world_size: int, runs: dict[str, Run]) -> dict[str, dict[str, Any]]:
    """Every run in one process group: starting processes is the slow part on 2 cores."""
    return {name: run_zero(rank, world_size, run) for name, run in runs.items()}


def state_bytes(engine: ZeroEngine) -> int:
    """Bytes of master shards and optimizer state tensors this rank holds between steps."""
    total = sum(sp.master.numel() * sp.master.element_size() for sp in engine.sharded_params.values())
    for opt in engine.optimizers:
        for state in opt.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return total


def reference(optimizer: str, world_sizes: list[int], clip_norm: float | None = None) -> dict[str, torch.Tensor]:
    """Plain PyTorch, one process: step ``i`` on the global batch of ``world_sizes[i]`` ranks."""
    model = initial_mixnet()
    return plain_train(model, make_optimizers(optimizer, model), dict(enumerate(world_sizes)), clip_norm)


def plain_train(model: nn.Module, opts: list[torch.optim.Optimizer], world_sizes: dict[int, int],
                clip_norm: float | None = None) -> dict[str, torch.Tensor]:
    """Plain PyTorch steps ``{step: world size whose global batch it sees}``; the parameters after."""
    for step, world_size in world_sizes.items():
        x, y = batch(step, world_size)
        loss = sum(F.mse_loss(model(xs), ys) for xs, ys in zip(x.chunk(world_size), y.chunk(world_size), strict=True))
        (loss / world_size).backward()
        for opt in opts:
            if clip_norm is not None:
                torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip_norm)
            opt.step()
        for opt in opts:
            opt.zero_grad()
    return params(model)


# ---- checkpoints ----------------------------------------------------------------------------


def save_midway(rank: int, world_size: int, run: Run, root: str, modes: tuple[str, ...]) -> dict[str, Any]:
    """Train 2 steps, save in every mode, train 2 more: the uninterrupted result."""
    from lightning_zero.checkpoint import engine_tree, save

    model, engine = build(run, rank)
    train(model, engine, range(2), rank, world_size)
    for mode in modes:
        save(engine_tree.zero_state_dict(engine, model), f"{root}/{mode}.ckpt", mode=mode)
    train(model, engine, range(2, 4), rank, world_size)
    result = params(model)
    engine.close()
    return result


def resume(rank: int, world_size: int, run: Run, path: str) -> dict[str, Any]:
    """A fresh engine (other initial weights) resumed from ``path``, then steps 2 and 3."""
    from lightning_zero.checkpoint import load_zero_state_dict

    model, engine = build(run, rank)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    load_zero_state_dict(engine, model, path)
    train(model, engine, range(2, 4), rank, world_size)
    result = params(model)
    engine.close()
    return result


# ---- through the Trainer ----------------------------------------------------------------------


class GlobalBatches(torch.utils.data.Dataset):
    """Item i is global batch i; every rank slices its part (``use_distributed_sampler=False``)."""

    def __init__(self, steps: int, world_size: int) -> None:
        self.items = [batch(step, world_size) for step in range(steps)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.items[index]


class MixModule(LightningModule):
    """``muon-adamw`` steps two optimizers by manual optimization (Lightning's automatic
    optimization takes one); other optimizers step automatically."""

    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.net = initial_mixnet()
        self.optimizer_name = optimizer
        self.automatic_optimization = optimizer != "muon-adamw"

    def training_step(self, batch_: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        x, y = batch_
        ws, rank = self.trainer.world_size, self.global_rank
        loss = F.mse_loss(self.net(x.chunk(ws)[rank]), y.chunk(ws)[rank])
        if self.automatic_optimization:
            return loss
        opts = self.optimizers()
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in opts:
            opt.step()
        return None

    def configure_optimizers(self) -> Any:
        return make_optimizers(self.optimizer_name, self.net)
