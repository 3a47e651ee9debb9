"""Training cases run twice: N ranks through ZeroEngine, and one plain PyTorch process.

The reference sees the same global batch. Each step's loss is the mean over N equal slices
(the average DDP computes), which for a model without data-dependent branches is the
ordinary loss of the whole batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero import ZeroConfig, ZeroEngine


class Net(nn.Module):
    """Parameter sizes chosen not to divide by 2 or 3; every awkward kind of parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(7, 11)  # weight also used transposed at the output (tied)
        self.hidden = nn.Linear(11, 13)
        self.branch = nn.Linear(13, 13)  # used only by slices whose first input is positive
        self.dropped = nn.Linear(13, 13)  # never called: layer drop
        self.frozen = nn.Linear(13, 13)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(13, 11)
        self.scale = nn.Parameter(torch.tensor(1.5))  # a 1-element parameter: empty on most ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        h = torch.tanh(self.hidden(h))
        if x[0, 0] > 0:
            h = h + torch.tanh(self.branch(h))
        h = h + self.frozen(h)
        h = self.head(h) * self.scale
        return F.linear(h, self.embed.weight.t())  # tied weight, used a second time


@dataclass(frozen=True)
class Case:
    optimizer: str = "adamw"
    steps: int = 4
    accumulate: int = 1
    clip_norm: float | None = None
    clip_value: float | None = None
    scheduler: bool = False
    stage: int = 2
    bucket_size_mb: float = 0.0005  # ~500 bytes: several buckets even for this tiny model
    overlap: bool = True
    overlap_param_gather: bool = True
    reduce_dtype: str | None = None
    skip_branch_at: tuple[tuple[int, int], ...] = ()
    """(step, micro) pairs whose global batch makes *no* slice take ``Net.branch``."""
    extra: dict[str, Any] = field(default_factory=dict, hash=False)


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    if name == "sgd":
        return torch.optim.SGD([{"params": decay}, {"params": rest, "lr": 0.05}], lr=0.1, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam([{"params": decay, "weight_decay": 0.01}, {"params": rest}], lr=0.01)
    if name == "adamw":
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 0.02}], lr=0.01
        )
    raise ValueError(name)


def global_batch(step: int, micro: int, world_size: int,
                 skip_branch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(4 * world_size, 7, generator=g)
    # Make slice 0 take the branch and the last slice skip it (when there are 2+ slices).
    x[0, 0] = 1.0
    x[-4, 0] = -1.0
    if skip_branch:  # the first row of every 4-row slice decides: no slice takes the branch
        x[0::4, 0] = -1.0
    return x, torch.randn(4 * world_size, 7, generator=g)


def case_batch(case: Case, step: int, micro: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return global_batch(step, micro, world_size, skip_branch=(step, micro) in case.skip_branch_at)


def initial_model() -> Net:
    torch.manual_seed(0)
    return Net()


def run_zero(rank: int, world_size: int, case: Case) -> dict[str, Any]:
    model = initial_model()
    if rank != 0:  # the engine must broadcast rank 0's weights
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    engine = ZeroEngine(model, [make_optimizer(case.optimizer, model)],
                        ZeroConfig(case.stage, case.bucket_size_mb, case.overlap, case.overlap_param_gather,
                                   case.reduce_dtype))
    opt = engine.optimizers[0]
    sched = torch.optim.lr_scheduler.StepLR(opt.inner, step_size=1, gamma=0.7) if case.scheduler else None
    for step in range(case.steps):
        opt.zero_grad()
        for micro in range(case.accumulate):
            x, y = case_batch(case, step, micro, world_size)
            xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            last = micro == case.accumulate - 1
            with contextlib.nullcontext() if last else engine.no_sync():
                loss = F.mse_loss(model(xs), ys) / case.accumulate
                loss.backward()
                engine.ensure_flushed()
        if case.clip_norm is not None:
            opt.clip_grad_norm_(case.clip_norm)
        if case.clip_value is not None:
            torch.nn.utils.clip_grad_value_([p for g in opt.param_groups for p in g["params"]], case.clip_value)
        opt.step()
        if sched is not None:
            sched.step()
    # Through the module first: that read finishes the last step's overlapped gathers.
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    masters_match = all(
        torch.equal(sp.master.detach(), sp.param.detach().reshape(-1)[sp.layout.start(rank):sp.layout.end(rank)])
        for sp in engine.sharded_params.values()
    )
    fqn_of_master = {sp.master: sp.fqn for sp in engine.sharded_params.values()}
    return {
        "params": params,
        "shard_numel": engine.optimizer_shard_numel,
        "masters_match": masters_match,
        "state_names": sorted(fqn_of_master[m] for m, state in opt.state.items() if state),
    }


def run_reference(world_size: int, case: Case) -> dict[str, torch.Tensor]:
    return run_reference_with_state(world_size, case)[0]


def run_reference_with_state(world_size: int, case: Case) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Plain PyTorch on the global batch; also the names of parameters that have optimizer state."""
    model = initial_model()
    opt = make_optimizer(case.optimizer, model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7) if case.scheduler else None
    for step in range(case.steps):
        opt.zero_grad()
        for micro in range(case.accumulate):
            x, y = case_batch(case, step, micro, world_size)
            loss = sum(F.mse_loss(model(xs), ys) for xs, ys in zip(x.chunk(world_size), y.chunk(world_size), strict=True))
            (loss / world_size / case.accumulate).backward()
        if case.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip_norm)
        if case.clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), case.clip_value)
        opt.step()
        if sched is not None:
            sched.step()
    names = {p: n for n, p in model.named_parameters()}
    return (
        {n: p.detach().clone() for n, p in model.named_parameters()},
        sorted(names[p] for p, state in opt.state.items() if state),
    )


def run_cases(rank: int, world_size: int, cases: dict[str, Case]) -> dict[str, dict[str, Any]]:
    """All cases in one process group: spawning is the slow part on 2 cores."""
    return {name: run_zero(rank, world_size, case) for name, case in cases.items()}


BALANCE_SIZES = (1, 7, 100, 1000, 4097)
"""Five parameters of very different sizes, none divisible by 8: whole-parameter partitioning
(ZeroRedundancyOptimizer) would leave three of eight ranks without optimizer state."""


class FiveParams(nn.Module):
    def __init__(self, sizes: tuple[int, ...] = BALANCE_SIZES) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(n)) for n in sizes)

    def forward(self) -> torch.Tensor:
        return sum((w * w).sum() for w in self.weights)


def run_balance(rank: int, world_size: int) -> dict[str, Any]:
    """One Adam step of :class:`FiveParams`; what this rank holds."""
    model = FiveParams()
    engine = ZeroEngine(model, [torch.optim.Adam(model.parameters(), lr=0.1)], ZeroConfig(stage=2))
    opt = engine.optimizers[0]
    model().backward()
    engine.ensure_flushed()
    opt.step()
    state_numel: dict[str, int] = {}
    for state in opt.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                state_numel[key] = state_numel.get(key, 0) + value.numel()
    return {
        "shard_numel": engine.optimizer_shard_numel,
        "per_param": [engine.sharded_params[p].shard_numel for p in model.weights],
        "state_numel": state_numel,
    }


def run_loss_scaling(rank: int, world_size: int, dtype_name: str, clip_norm: float) -> dict[str, Any]:
    """fp16-style dynamic loss scaling through ``engine.grad_scaler``.

    Step 0: rank 1 alone finds an inf in its shard of ``head.weight``'s gradient; step 1 is
    clean (unscaled, clipped by the global norm, stepped). Uses SGD, whose update is not
    invariant to the gradient's scale, so a missing unscale shows.
    """
    dtype = getattr(torch, dtype_name)
    model = initial_model().to(dtype)
    engine = ZeroEngine(model, [make_optimizer("sgd", model)], ZeroConfig(2, 0.0005))
    opt = engine.optimizers[0]
    scaler = engine.grad_scaler(init_scale=1024)

    def scaled_backward(step: int) -> None:
        x, y = global_batch(step, 0, world_size)
        xs, ys = x.chunk(world_size)[rank].to(dtype), y.chunk(world_size)[rank].to(dtype)
        scaler.scale(F.mse_loss(model(xs), ys)).backward()
        engine.ensure_flushed()

    def params() -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    initial = params()
    scaled_backward(0)
    local_grads_finite = all(bool(m.grad.isfinite().all()) for m in opt.inner.param_groups[0]["params"]
                             if m.grad is not None)
    poisoned = next(sp for sp in engine.sharded_params.values() if sp.fqn == "head.weight")
    if rank == 1:
        assert poisoned.shard_numel > 0 and poisoned.master.grad is not None
        poisoned.master.grad[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    after_skip = params()
    scale_after_skip = scaler.get_scale()
    state_after_skip = sum(len(s) for s in opt.state.values())

    opt.zero_grad()
    scaled_backward(1)
    scaler.unscale_(opt)
    opt.clip_grad_norm_(clip_norm)
    scaler.step(opt)
    scaler.update()
    return {
        "initial": initial,
        "local_grads_finite": local_grads_finite,
        "after_skip": after_skip,
        "scale_after_skip": scale_after_skip,
        "state_after_skip": state_after_skip,
        "after_clean": params(),
        "scale_after_clean": scaler.get_scale(),
        "master_dtypes": sorted({str(sp.master.dtype) for sp in engine.sharded_params.values()}),
        "masters_match": all(
            torch.equal(sp.master.detach().to(dtype),
                        sp.param.detach().reshape(-1)[sp.layout.start(rank):sp.layout.end(rank)])
            for sp in engine.sharded_params.values()
        ),
    }


def reference_one_step(world_size: int, step: int, clip_norm: float) -> dict[str, torch.Tensor]:
    """Plain PyTorch: one SGD step on global batch ``step`` from the initial model, clipped."""
    model = initial_model()
    opt = make_optimizer("sgd", model)
    x, y = global_batch(step, 0, world_size)
    loss = sum(F.mse_loss(model(xs), ys) for xs, ys in zip(x.chunk(world_size), y.chunk(world_size), strict=True))
    (loss / world_size).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
