"""Fabric loops run on N gloo ranks through ``Fabric(strategy="zero1"/"zero2")``, and their plain-PyTorch
reference in one process (tests/fabric/test_fabric.py, tests/fabric/test_fabric_checkpoint.py).

Each rank runs in a process made by tests/_dist.py, whose process group Fabric finds already initialized;
the environment is torchrun's, so ``fabric.launch()`` starts no process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from engine_cases import Net, make_optimizer
from lightning.fabric import Fabric
from torch import nn

from lightning_zero.checkpoint import ZeroCheckpointIO

GLOBAL_ROWS = 12
"""Rows of every global batch: divides by 1, 2 and 3 ranks, so any of them sees the same batch."""


@dataclass(frozen=True)
class FabricCase:
    strategy: str = "zero2"
    optimizer: str = "adamw"
    steps: int = 4
    accumulate: int = 1
    clip_norm: float | None = None
    clip_value: float | None = None
    scheduler: bool = True
    precision: str = "32-true"
    setup: str = "joint"
    """``joint``: ``fabric.setup(model, optimizer)``; ``separate``: ``setup_module`` then ``setup_optimizers``."""
    bucket_size_mb: float | None = 0.0005  # several buckets even for this tiny model
    shard_group_size: int | None = None
    model: str = "net"
    """``net``: engine_cases.Net; ``batchnorm``: BatchNormNet (buffers that forward changes per rank)."""
    branch_on_rank0_only: bool = False
    """Only rank 0's slice takes ``Net.branch`` (a parameter with a gradient on some ranks only)."""
    rank0_eval: bool = False
    """After the first step rank 0 alone samples from the model without gradients, in ``eval()``, and is left in
    ``eval()`` (a rank-0-only generation that returns early): the other ranks keep training mode."""


def global_batch(step: int, micro: int, rank0_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch at every world size: every row takes ``Net.branch`` (its first input is positive),
    so the data-dependent path does not depend on how the batch is split; ``Net.dropped`` stays unused.
    ``rank0_rows``: only the first that many rows (rank 0's slice) take the branch."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(GLOBAL_ROWS, 7, generator=g)
    x[:, 0] = x[:, 0].abs() + 0.1
    if rank0_rows:
        x[rank0_rows:, 0] = -x[rank0_rows:, 0]
    return x, torch.randn(GLOBAL_ROWS, 7, generator=g)


def case_batch(case: FabricCase, step: int, micro: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return global_batch(step, micro, GLOBAL_ROWS // world_size if case.branch_on_rank0_only else 0)


def make_fabric(rank: int, world_size: int, strategy: Any, precision: str | None = "32-true",
                plugins: list[Any] | None = None) -> Fabric:
    """A launched Fabric in this rank's process (torchrun's environment: no process is started)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), GROUP_RANK="0",
                      NODE_RANK="0", LOCAL_WORLD_SIZE=str(world_size), TORCHELASTIC_RUN_ID="fabric-test")
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision=precision,  # type: ignore[arg-type]
                    plugins=plugins)
    fabric.launch()
    return fabric


def _strategy(case: FabricCase) -> Any:
    from lightning.fabric.strategies import DDPStrategy

    from lightning_zero.fabric import ZeroLowLevelStrategy

    if case.strategy == "ddp":  # Fabric's own; Net has a layer no forward calls
        return DDPStrategy(find_unused_parameters=True)
    if case.strategy in ("zero1", "zero2"):
        return ZeroLowLevelStrategy(stage=int(case.strategy[-1]), bucket_size_mb=case.bucket_size_mb,  # type: ignore[arg-type]
                                    shard_group_size=case.shard_group_size)
    return case.strategy


def _precision_plugins(case: FabricCase) -> tuple[str | None, list[Any] | None]:
    if case.precision == "16-mixed":
        # Fabric turns the string into bf16-mixed on CPU; the plugin itself keeps fp16 and its scaler.
        from lightning.fabric.plugins.precision import MixedPrecision

        return None, [MixedPrecision("16-mixed", device="cpu")]
    return case.precision, None


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(7, 11, bias=False)  # a bias before BatchNorm gets only rounding noise as gradient
        self.norm = nn.BatchNorm1d(11)
        self.head = nn.Linear(11, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(self.embed(x))))


def fresh_model(rank: int, kind: str = "net") -> nn.Module:
    torch.manual_seed(0)
    model = Net() if kind == "net" else BatchNormNet()
    if rank != 0:  # rank 0's buffers must reach every rank too
        for buffer in model.buffers():
            if buffer.is_floating_point():
                buffer.add_(0.5)
    if rank != 0:  # setup must give every rank rank 0's weights
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    return model


def make_optimizers(name: str, model: nn.Module) -> list[torch.optim.Optimizer]:
    """``two-adamw``: make_optimizer("adamw")'s two param groups as two optimizers (the same update: AdamW is
    elementwise)."""
    if name != "two-adamw":
        return [make_optimizer(name, model)]
    groups = make_optimizer("adamw", model).param_groups
    return [torch.optim.AdamW([{k: v for k, v in group.items() if k != "initial_lr"}]) for group in groups]


@dataclass
class Loop:
    fabric: Fabric
    model: Any
    optimizers: list[Any]
    schedulers: list[Any]
    raw_optimizers: list[torch.optim.Optimizer]

    @property
    def optimizer(self) -> Any:
        return self.optimizers[0]

    @property
    def scheduler(self) -> Any:
        return self.schedulers[0] if self.schedulers else None


def set_up(rank: int, world_size: int, case: FabricCase, plugins: list[Any] | None = None) -> Loop:
    precision, precision_plugins = _precision_plugins(case)
    fabric = make_fabric(rank, world_size, _strategy(case), precision, [*(precision_plugins or []), *(plugins or [])])
    model = fresh_model(rank, case.model)
    if case.setup == "joint":
        raw = make_optimizers(case.optimizer, model)
        fmodel, *foptimizers = fabric.setup(model, *raw)
    else:
        fmodel = fabric.setup_module(model)
        raw = make_optimizers(case.optimizer, fmodel.module)
        foptimizers = [fabric.setup_optimizers(opt) for opt in raw]
    schedulers = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7) for opt in raw] if case.scheduler else []
    return Loop(fabric, fmodel, foptimizers, schedulers, raw)


def train_steps(loop: Loop, case: FabricCase, rank: int, world_size: int, start: int, stop: int) -> list[float]:
    fabric, model = loop.fabric, loop.model
    norms = []
    for step in range(start, stop):
        for optimizer in loop.optimizers:
            optimizer.zero_grad()
        for micro in range(case.accumulate):
            x, y = case_batch(case, step, micro, world_size)
            xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            with fabric.no_backward_sync(model, enabled=micro < case.accumulate - 1):
                loss = F.mse_loss(model(xs).float(), ys) / case.accumulate
                fabric.backward(loss)
        for optimizer in loop.optimizers:
            if case.clip_norm is not None:
                norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=case.clip_norm)))
            if case.clip_value is not None:
                fabric.clip_gradients(model, optimizer, clip_val=case.clip_value)
            optimizer.step()
        for scheduler in loop.schedulers:
            scheduler.step()
        if case.rank0_eval and step == start and rank == 0:
            model.eval()
            with torch.no_grad():
                # DDP's wrapper decides its next broadcast by its previous forward, so a DDP user samples
                # through the inner module; ZeRO's broadcast ignores forwards without gradients.
                (model.module if case.strategy == "ddp" else model)(xs[:1])
    return norms


def params_of(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def run_fabric(rank: int, world_size: int, case: FabricCase) -> dict[str, Any]:
    loop = set_up(rank, world_size, case)
    norms = train_steps(loop, case, rank, world_size, 0, case.steps)
    params = params_of(loop.model)
    strategy = loop.fabric.strategy
    buffers = {n: b.detach().clone() for n, b in loop.model.module.named_buffers()}
    result: dict[str, Any] = {"params": params, "norms": norms, "buffers": buffers}
    if case.strategy == "ddp":
        return result
    engine = strategy.engines[0]
    result.update(
        shard_numel=strategy.optimizer_shard_numel,
        engines=len(strategy.engines),
        master_dtypes=sorted({str(sp.master.dtype) for sp in engine.sharded_params.values()}),
        params_are_masters=all(
            torch.equal(sp.master.to(sp.param.dtype), sp.param.detach().reshape(-1)[sp.layout.local_slice(sp.rank)])
            for sp in engine.sharded_params.values()),
        scaler=type(getattr(strategy.precision, "scaler", None)).__name__,
    )
    strategy.teardown()
    return result


def run_fabric_cases(rank: int, world_size: int, cases: dict[str, FabricCase]) -> dict[str, dict[str, Any]]:
    """All cases in one process group: starting ranks is the slow part on 2 cores."""
    return {name: run_fabric(rank, world_size, case) for name, case in cases.items()}


def run_reference(case: FabricCase, world_size: int = 1) -> dict[str, Any]:
    """Plain PyTorch, one process, on the global batch (the loss of N equal slices averaged)."""
    torch.manual_seed(0)
    model = Net()
    optimizers = make_optimizers(case.optimizer, model)
    schedulers = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7) for opt in optimizers] \
        if case.scheduler else []
    norms = []
    for step in range(case.steps):
        for optimizer in optimizers:
            optimizer.zero_grad()
        for micro in range(case.accumulate):
            x, y = case_batch(case, step, micro, world_size)
            loss = sum(F.mse_loss(model(xs), ys) for xs, ys in zip(x.chunk(world_size), y.chunk(world_size), strict=True))
            (loss / world_size / case.accumulate).backward()
        for optimizer in optimizers:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            if case.clip_norm is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(params, case.clip_norm)))
            if case.clip_value is not None:
                torch.nn.utils.clip_grad_value_(params, case.clip_value)
            optimizer.step()
        for scheduler in schedulers:
            scheduler.step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "norms": norms}


# ---- checkpoints ------------------------------------------------------------------------------


def run_save_and_continue(rank: int, world_size: int, case: FabricCase, mode: str, path: str, save_at: int,
                          async_save: bool = True, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train ``case.steps`` steps without interruption, saving at ``save_at``; returns the final weights."""
    io = ZeroCheckpointIO(mode=mode, async_save=async_save, storage_options=storage_options)  # type: ignore[arg-type]
    loop = set_up(rank, world_size, case, plugins=[io])
    train_steps(loop, case, rank, world_size, 0, save_at)
    state = {"model": loop.model, "optimizer": loop.optimizer, "scheduler": loop.scheduler, "step": save_at,
             "note": {"text": "fabric", "values": [1, 2]}}
    loop.fabric.save(path, state)
    saved_params = params_of(loop.model)
    train_steps(loop, case, rank, world_size, save_at, case.steps)
    params = params_of(loop.model)
    loop.fabric.strategy.teardown()
    return {"params": params, "saved_params": saved_params}


def run_load_and_continue(rank: int, world_size: int, case: FabricCase, path: str,
                          storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """A fresh loop (another world size allowed) loads ``path`` and trains to ``case.steps``."""
    loop = set_up(rank, world_size, case, plugins=[ZeroCheckpointIO(storage_options=storage_options)])
    state: dict[str, Any] = {"model": loop.model, "optimizer": loop.optimizer, "scheduler": loop.scheduler, "step": 0}
    remainder = loop.fabric.load(path, state)
    loaded_params = params_of(loop.model)
    start = state["step"]
    lr = [group["lr"] for group in loop.raw_optimizers[0].param_groups]
    train_steps(loop, case, rank, world_size, start, case.steps)
    params = params_of(loop.model)
    loop.fabric.strategy.teardown()
    return {"params": params, "loaded_params": loaded_params, "start": start, "remainder": remainder, "lr": lr}


def run_load_weights_only(rank: int, world_size: int, case: FabricCase, path: str) -> dict[str, Any]:
    """``fabric.load(path, {"model": model})``: weights only, the optimizer keeps its (empty) state; and
    ``fabric.load_raw`` into a module set up without an optimizer."""
    loop = set_up(rank, world_size, case)
    remainder = loop.fabric.load(path, {"model": loop.model}, strict=False)
    optimizer_state = sum(len(s) for s in loop.optimizer.optimizer.state.values())
    weights = params_of(loop.model)
    loop.fabric.strategy.teardown()
    fabric = make_fabric(rank, world_size, _strategy(case))
    module = fabric.setup_module(fresh_model(rank))
    fabric.load_raw(path, module)
    raw_weights = params_of(module)
    inference = fabric.setup_module(fresh_model(rank))
    inference_remainder = fabric.load(path, {"model": inference, "step": 0})
    whole = fabric.load(path)  # no state: the whole checkpoint, in Lightning's format where the mode allows
    return {"weights": weights, "raw_weights": raw_weights, "optimizer_state": optimizer_state,
            "remainder_keys": sorted(remainder), "whole_keys": sorted(whole),
            "inference_weights": params_of(inference), "inference_remainder_keys": sorted(inference_remainder)}


def run_filtered_save(rank: int, world_size: int, case: FabricCase, path: str) -> dict[str, Any]:
    """``fabric.save(..., filter={"model": ...})`` keeps only what the filter keeps."""
    loop = set_up(rank, world_size, case, plugins=[ZeroCheckpointIO(mode="sharded", async_save=False)])
    train_steps(loop, case, rank, world_size, 0, 1)
    loop.fabric.save(path, {"model": loop.model, "step": 1}, filter={"model": lambda name, _: "head" in name})
    loop.fabric.strategy.teardown()
    return {}


class NotPlain:
    """A value ``weights_only`` loading refuses (a class of this module)."""


def run_bad_saves(rank: int, world_size: int, path: str) -> list[str]:
    """Bad ``fabric.save`` input: the same clear error on every rank, before any collective (the barrier after
    each proves the ranks are still in step)."""
    case = FabricCase()
    loop = set_up(rank, world_size, case)
    second = fresh_model(rank)
    other, other_optimizer = loop.fabric.setup(second, make_optimizer("sgd", second))
    foreign = make_optimizer("sgd", fresh_model(rank))
    bad_states = [
        {"model": loop.model, "other": other},
        {"model": loop.model, "optimizer": other_optimizer},
        {"model": loop.model, "optimizer": foreign},
        {"model": loop.model, "value": NotPlain()},
        {"model": loop.model, "value": lambda: 0},
    ]
    errors = []
    for state in bad_states:
        try:
            loop.fabric.save(path, state)
        except (ValueError, TypeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        else:
            errors.append("no error")
        loop.fabric.barrier()
    loop.fabric.strategy.teardown()
    return errors


def run_strict_load(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """``fabric.load`` with a key the checkpoint lacks: an error with ``strict=True``, left as it is without."""
    loop = set_up(rank, world_size, FabricCase())
    state: dict[str, Any] = {"model": loop.model, "optimizer": loop.optimizer, "absent": 7}
    try:
        loop.fabric.load(path, state)
        strict_error = "no error"
    except KeyError as exc:
        strict_error = str(exc)
    remainder = loop.fabric.load(path, state, strict=False)
    loop.fabric.strategy.teardown()
    return {"strict_error": strict_error, "absent": state["absent"], "remainder_keys": sorted(remainder)}


# ---- Trainer <-> Fabric -----------------------------------------------------------------------


def run_fabric_resumes_trainer_checkpoint(rank: int, world_size: int, path: str, steps: tuple[int, int],
                                          epoch_steps: int = 2) -> dict[str, Any]:
    """A Fabric loop over the Trainer tests' NetModule (AdamW, StepLR every step, lightning_cases.loader's
    batches) loads a checkpoint the Trainer wrote after ``steps[0]`` steps and trains to ``steps[1]``."""
    from engine_cases import global_batch as trainer_batch
    from lightning_cases import NetModule

    fabric = make_fabric(rank, world_size, "zero2")
    module = NetModule(scheduler=True)
    optimizer = make_optimizer("adamw", module.net)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    model, optimizer = fabric.setup(module, optimizer)
    remainder = fabric.load(path, {"model": model, "optimizer": optimizer})
    scheduler.load_state_dict(remainder["lr_schedulers"][0])
    loaded = {k: v.detach().clone() for k, v in module.state_dict().items()}
    for step in range(steps[0], steps[1]):
        x, y = trainer_batch(step % epoch_steps, 0, world_size)  # the loader's epoch, again
        loss = F.mse_loss(model.net(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    fabric.strategy.teardown()
    return {"loaded": loaded, "weights": weights, "global_step": remainder["global_step"],
            "keys": sorted(remainder)}


def run_fabric_trains_like_the_trainer(rank: int, world_size: int, path: str, mode: str, steps: int = 2
                                       ) -> dict[str, Any]:
    """The Trainer tests' first epoch (NetModule, AdamW, StepLR every step) in a Fabric loop, saved to ``path``
    with ``{"model", "optimizer", "lr_schedulers"}`` as the Trainer's checkpoints name them."""
    from engine_cases import global_batch as trainer_batch
    from lightning_cases import NetModule

    fabric = make_fabric(rank, world_size, "zero2", plugins=[ZeroCheckpointIO(mode=mode)])  # type: ignore[arg-type]
    module = NetModule(scheduler=True)
    optimizer = make_optimizer("adamw", module.net)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    model, optimizer = fabric.setup(module, optimizer)
    for step in range(steps):
        x, y = trainer_batch(step, 0, world_size)
        fabric.backward(F.mse_loss(model.net(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    fabric.save(path, {"model": model, "optimizer": optimizer, "lr_schedulers": [scheduler.state_dict()],
                       "global_step": steps, "epoch": 1})
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    fabric.strategy.teardown()
    return weights


def run_load_filtered(rank: int, world_size: int, path: str, strict: bool) -> dict[str, Any]:
    """Load a checkpoint that holds only some weights (saved with ``filter``) into a set-up module: the
    outcome, the module's weights before and after."""
    loop = set_up(rank, world_size, FabricCase())
    before = {k: v.detach().clone() for k, v in loop.model.state_dict().items()}
    try:
        loop.fabric.load(path, {"model": loop.model}, strict=strict)
        outcome = "loaded"
    except Exception as exc:  # reported to the test
        outcome = f"{type(exc).__name__}: {exc}"
    after = {k: v.detach().clone() for k, v in loop.model.state_dict().items()}
    loop.fabric.strategy.teardown()
    return {"outcome": outcome, "before": before, "after": after}
