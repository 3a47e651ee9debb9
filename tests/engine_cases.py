"""Training cases run twice: N ranks through ZeroEngine, and one plain PyTorch process.

The reference sees the same global batch. Each step's loss is the mean over N equal slices
(the average DDP computes), which for a model without data-dependent branches is the
ordinary loss of the whole batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from lightning_zero import ZeroConfig, ZeroEngine
from lightning_zero.engine import collectives as comm


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
    native_reduce_scatter: bool = False
    """Take the reduce-scatter path of NCCL (gloo runs it too, only slower than its all-reduce)."""
    native_all_gather: bool = False
    """Take the all-gather path of NCCL (gloo runs it too; it gathers by broadcasts: [Note: gloo all-gather])."""
    shard_group_size: int | None = None
    """Hybrid sharding: shard within groups of this many ranks (None: the whole world)."""
    skip_branch_at: tuple[tuple[int, int], ...] = ()
    """(step, micro) pairs whose global batch makes *no* slice take ``Net.branch``."""
    branch_slices: tuple[int, ...] | None = None
    """If set, exactly these slices (ranks) take ``Net.branch`` in every batch not in ``skip_branch_at``."""
    zero_grad_every: int = 1
    """``zero_grad`` before every n-th step only: the gradients of the steps between accumulate, as in PyTorch."""
    set_to_none: bool = True
    """The engine's ``zero_grad(set_to_none=...)`` (the reference's is always True: no ``.grad`` after it either way)."""
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
    skip = (step, micro) in case.skip_branch_at
    x, y = global_batch(step, micro, world_size, skip_branch=skip)
    if case.branch_slices is not None and not skip:
        x[0::4, 0] = -1.0
        for index in case.branch_slices:
            x[4 * index, 0] = 1.0
    return x, y


def initial_model() -> Net:
    torch.manual_seed(0)
    return Net()


def run_zero(rank: int, world_size: int, case: Case) -> dict[str, Any]:
    model = initial_model()
    if rank != 0:  # the engine must broadcast rank 0's weights
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    native = mock.patch.object(comm, "has_native_reduce_scatter", return_value=True)
    gather = mock.patch.object(comm, "broadcast_sources", return_value=None)
    with native if case.native_reduce_scatter else contextlib.nullcontext(), \
            gather if case.native_all_gather else contextlib.nullcontext():
        engine = ZeroEngine(model, [make_optimizer(case.optimizer, model)],
                            ZeroConfig(case.stage, case.bucket_size_mb, case.overlap, case.overlap_param_gather,
                                       case.reduce_dtype, case.shard_group_size))
    assert engine.reducer.reduce_scatter == case.native_reduce_scatter
    assert (engine.gatherer.broadcast_sources is None) == case.native_all_gather
    opt = engine.optimizers[0]
    sched = torch.optim.lr_scheduler.StepLR(opt.inner, step_size=1, gamma=0.7) if case.scheduler else None
    for step in range(case.steps):
        if step % case.zero_grad_every == 0:
            opt.zero_grad(set_to_none=case.set_to_none)
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
            opt.clip_grad_value_(case.clip_value)
        opt.step()
        if sched is not None:
            sched.step()
    # Through the module first: that read finishes the last step's overlapped gathers.
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    masters_match = all(
        torch.equal(sp.master.detach(), sp.param.detach().reshape(-1)[sp.layout.local_slice(sp.rank)])
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
        if step % case.zero_grad_every == 0:
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
    local_grads_finite = all(bool(sp.master.grad.isfinite().all()) for sp in opt.sharded_params
                             if sp.master.grad is not None)
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


# ---- parameter gather overlap, memory bounds, reduce dtype ------------------------------------


class Deep(nn.Module):
    """Six layers, each several buckets at ``DEEP_BUCKET_MB``; ``skip`` leaves out ``layers[3]``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(7 if i == 0 else 16, 16) for i in range(6))
        self.out = nn.Linear(16, 7)

    def forward(self, x: torch.Tensor, skip: bool = False, early_exit: bool = False) -> torch.Tensor:
        """``early_exit``: only the first three layers (the rest of the buckets are never read)."""
        for i, layer in enumerate(self.layers):
            if early_exit and i == 3:
                return x[..., :7]
            if not (skip and i == 3):
                x = torch.tanh(layer(x))
        return self.out(x)


DEEP_BUCKET_MB = 0.0005
"""About 125 fp32 elements: 16x16 weights get a bucket each, so the gathers queue up."""


def _deep_engine(overlap_param_gather: bool, stage: int = 2) -> tuple[Deep, ZeroEngine]:
    model = Deep()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    return model, ZeroEngine(model, [opt], ZeroConfig(stage, DEEP_BUCKET_MB, overlap_param_gather=overlap_param_gather))


def _deep_step(model: Deep, engine: ZeroEngine, step: int, rank: int, world_size: int) -> None:
    x, y = global_batch(step, 0, world_size)
    # Rank 1 skips a layer in odd steps: its gathers for that layer are finished by the backward.
    skip = rank == 1 and step % 2 == 1
    loss = F.mse_loss(model(x.chunk(world_size)[rank], skip=skip), y.chunk(world_size)[rank])
    loss.backward()
    engine.ensure_flushed()
    engine.optimizers[0].step()
    engine.optimizers[0].zero_grad()


def run_gather_overlap(rank: int, world_size: int, steps: int = 4) -> dict[str, Any]:
    """The same training with the gathers overlapped and not, plus what each forced read sees."""
    from lightning_zero.engine.comm_pool import MAX_IN_FLIGHT

    model, engine = _deep_engine(overlap_param_gather=True)
    plain_model, plain_engine = _deep_engine(overlap_param_gather=False)
    in_flight: list[int] = []
    engine.gatherer.launch_hook = lambda g: in_flight.append(g.in_flight)
    last_layer_weight = model.layers[5].weight  # a reference taken before the step: exact only after finish
    observations: dict[str, Any] = {"max_in_flight_allowed": MAX_IN_FLIGHT}
    for step in range(steps):
        _deep_step(model, engine, step, rank, world_size)
        _deep_step(plain_model, plain_engine, step, rank, world_size)
    expected = {n: p.detach().clone() for n, p in plain_model.named_parameters()}
    observations["pending_after_step"] = engine.gatherer.pending
    # Only the first layer's parameters: the gathers of the later layers must still be pending.
    first = model.layers[0].weight.detach().clone()
    observations["first_layer_exact"] = torch.equal(first, expected["layers.0.weight"])
    observations["pending_after_first_layer"] = engine.gatherer.pending
    with torch.no_grad():  # an evaluation forward finishes whatever it reads
        x, _ = global_batch(99, 0, world_size)
        observations["eval_exact"] = torch.equal(model(x), plain_model(x))
    observations["pending_after_eval"] = engine.gatherer.pending

    # state_dict forces the gathers too.
    _deep_step(model, engine, steps, rank, world_size)
    _deep_step(plain_model, plain_engine, steps, rank, world_size)
    observations["pending_before_state_dict"] = engine.gatherer.pending
    # A checkpoint's tree needs only the masters: building it (as every save does) waits for nothing.
    from lightning_zero.checkpoint.engine_tree import zero_state_dict

    zero_state_dict(engine, model, meta={})
    observations["pending_after_checkpoint_tree"] = engine.gatherer.pending
    state = model.state_dict()
    observations["state_dict_exact"] = all(torch.equal(state[k], v) for k, v in plain_model.state_dict().items())

    # And finish_param_gather, idempotently.
    _deep_step(model, engine, steps + 1, rank, world_size)
    _deep_step(plain_model, plain_engine, steps + 1, rank, world_size)
    engine.finish_param_gather()
    engine.finish_param_gather()
    observations["finish_exact"] = torch.equal(last_layer_weight.detach(), plain_model.layers[5].weight.detach())
    observations["bit_identical"] = all(
        torch.equal(p.detach(), q.detach()) for p, q in zip(model.parameters(), plain_model.parameters(), strict=True)
    )
    observations["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    observations["in_flight"] = in_flight
    observations["buckets"] = len(engine.buckets)
    engine.close()
    plain_engine.close()
    return observations


def deep_reference(world_size: int, steps: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch on the global batch, with the same layer skipped on rank 1's slice."""
    model = Deep()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(steps):
        x, y = global_batch(step, 0, world_size)
        loss = sum(F.mse_loss(model(xs, skip=(r == 1 and step % 2 == 1)), ys)
                   for r, (xs, ys) in enumerate(zip(x.chunk(world_size), y.chunk(world_size), strict=True)))
        (loss / world_size).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_memory_bounds(rank: int, world_size: int, stage: int, steps: int = 3) -> dict[str, Any]:
    """Which buffers the collectives of backward and step write (per step), and what the pool holds
    while the step's gathers run and once they are finished (between steps)."""
    from lightning_zero.engine import collectives as comm

    model, engine = _deep_engine(overlap_param_gather=True, stage=stage)
    seen: dict[str, list[tuple[int, int]]] = {"gather": [], "reduce": []}
    per_step: list[set[int]] = []  # storages the collectives wrote, per step

    def storage(t: torch.Tensor) -> tuple[int, int]:
        return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()

    originals = comm.all_gather, comm.all_reduce, comm.reduce_scatter, comm.all_gather_by_broadcasts

    recording = [False]  # from step 1 on: step 0 grows the pool's slots to the largest bucket

    def record(kind: str, written: torch.Tensor) -> None:
        if recording[0]:
            seen[kind].append(storage(written))
            per_step[-1].add(storage(written)[0])

    def all_gather(output: torch.Tensor, input: torch.Tensor, *args: Any) -> Any:
        record("gather", output)
        return originals[0](output, input, *args)

    def all_reduce(tensor: torch.Tensor, *args: Any) -> Any:
        record("reduce", tensor)
        return originals[1](tensor, *args)

    def all_gather_by_broadcasts(output_rows: torch.Tensor, input: torch.Tensor, *args: Any) -> Any:
        record("gather", output_rows)  # gloo's gathers ([Note: gloo all-gather])
        return originals[3](output_rows, input, *args)

    comm.all_gather, comm.all_reduce = all_gather, all_reduce  # type: ignore[assignment]
    comm.all_gather_by_broadcasts = all_gather_by_broadcasts  # type: ignore[assignment]
    pool_bytes, pool_bytes_between_steps = [], []
    try:
        for step in range(steps):
            recording[0] = step > 0
            per_step.append(set())
            _deep_step(model, engine, step, rank, world_size)
            pool_bytes.append(engine.pool.nbytes)  # the step's gathers may still run
            engine.finish_param_gather()
            pool_bytes_between_steps.append(engine.pool.nbytes)
    finally:
        (comm.all_gather, comm.all_reduce, comm.reduce_scatter,  # type: ignore[assignment]
         comm.all_gather_by_broadcasts) = originals
    itemsize = 4
    largest = max(max(b.shard_size * b.reduce_numel, b.shard_size * b.row_numel) for b in engine.buckets) * itemsize
    result = {
        "gather_storages": len({ptr for ptr, _ in seen["gather"]}),
        "reduce_storages": len({ptr for ptr, _ in seen["reduce"]}),
        "all_storages": len({ptr for ptr, _ in seen["gather"] + seen["reduce"]}),
        "storages_per_step": [len(ptrs) for ptrs in per_step[1:]],
        "pool_bytes_between_steps": pool_bytes_between_steps,
        "gathers": len(seen["gather"]),
        "reductions": len(seen["reduce"]),
        "pool_bytes": pool_bytes,
        "largest_bucket_bytes": largest,
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "buckets": len(engine.buckets),
    }
    engine.close()
    return result


def run_reduce_dtype(rank: int, world_size: int, reduce_dtype: str | None, stage: int) -> dict[str, Any]:
    """One backward of a bf16 Net; this rank's shard gradients and, computed here with plain
    PyTorch, every slice's bf16 gradient (so both sides see identical single-thread kernels)."""
    model = initial_model().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage, 0.0005, reduce_dtype=reduce_dtype))
    x, y = global_batch(0, 0, world_size)
    loss = F.mse_loss(model(x.chunk(world_size)[rank].bfloat16()), y.chunk(world_size)[rank].bfloat16())
    loss.backward()
    engine.ensure_flushed()
    engine.optimizers[0].clip_grad_norm_(1e9)  # reads the presence once, clips nothing
    shards = {sp.fqn: (sp.master.grad.clone() if sp.master.grad is not None else None,
                       sp.layout.start(rank), sp.layout.end(rank)) for sp in engine.sharded_params.values()}
    slice_grads = []
    for r in range(world_size):
        ref = initial_model().to(torch.bfloat16)
        F.mse_loss(ref(x.chunk(world_size)[r].bfloat16()), y.chunk(world_size)[r].bfloat16()).backward()
        slice_grads.append({n: p.grad.clone() if p.grad is not None else None for n, p in ref.named_parameters()})
    engine.close()
    return {"shards": shards, "slice_grads": slice_grads}


def run_device_audit(rank: int, world_size: int, stage: int) -> dict[str, Any]:
    """Train with torch's default device set to ``meta`` while every collective is watched.

    The engine must create every tensor on an explicit device (the bucket's, the module's or the
    group's): one created without a device lands on ``meta`` here, and a collective receiving it,
    or an op mixing it with the CPU parameters, shows the CPU assumption that would break NCCL.
    """
    import torch.distributed as dist

    violations: list[str] = []
    expected = comm.group_device(None)

    def audited(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            for arg in [*args, *kwargs.values()]:
                tensors = arg if isinstance(arg, (list, tuple)) else [arg]
                for t in tensors:
                    if isinstance(t, torch.Tensor) and t.device != expected:
                        violations.append(f"{name} got a tensor on {t.device}, its group serves {expected}")
            return fn(*args, **kwargs)

        return call

    patches = [mock.patch.object(dist, n, audited(n, getattr(dist, n))) for n in ("all_reduce", "broadcast")]
    patches += [mock.patch.object(comm, n, audited(n, getattr(comm, n))) for n in ("_reduce_scatter", "_all_gather")]
    batches = [global_batch(step, 0, world_size) for step in range(3)]
    model = initial_model()
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        torch.set_default_device("meta")
        try:
            engine = ZeroEngine(model, [make_optimizer("sgd", model)], ZeroConfig(stage, 0.0005))
            opt = engine.optimizers[0]
            for step, (x, y) in enumerate(batches):
                loss = F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
                loss.backward()
                engine.ensure_flushed()
                opt.clip_grad_norm_(0.05)
                opt.step()
                opt.zero_grad()
                if step == 1:
                    model.state_dict()  # a forced gather
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            empty = ZeroEngine(nn.Module(), [], ZeroConfig(stage))
            fallback_device = empty.device
            empty.close()
            engine.close()
        finally:
            torch.set_default_device(None)
    return {"violations": violations, "params": params, "fallback_device": str(fallback_device),
            "devices": sorted({str(t.device) for t in params.values()})}


def run_collective_mid_step(rank: int, world_size: int, steps: int, shared_group: bool = False) -> dict[str, Any]:
    """Rank 1 exits after three layers in odd steps, so its forward launches fewer gathers than
    rank 0's; between forward and backward every rank all-reduces its loss on the default group
    (what ``self.log(..., sync_dist=True)`` does). ``shared_group`` puts the gathers on the
    default group as well, to show what the dedicated group prevents."""
    import torch.distributed as dist

    from lightning_zero.engine import zero_engine as engine_module

    patch = mock.patch.object(engine_module, "_gather_group", lambda group, *_: group)
    with patch if shared_group else contextlib.nullcontext():
        model, engine = _deep_engine(overlap_param_gather=True)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, 0, world_size)
        early = rank == 1 and step % 2 == 1
        loss = F.mse_loss(model(x.chunk(world_size)[rank], early_exit=early), y.chunk(world_size)[rank])
        synced = loss.detach().clone()
        dist.all_reduce(synced)
        losses.append(synced.item())
        loss.backward()
        engine.ensure_flushed()
        engine.optimizers[0].step()
        engine.optimizers[0].zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.close()
    return {"params": params, "losses": losses}


def deep_early_exit_reference(world_size: int, steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = Deep()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, 0, world_size)
        slices = [F.mse_loss(model(xs, early_exit=(r == 1 and step % 2 == 1)), ys)
                  for r, (xs, ys) in enumerate(zip(x.chunk(world_size), y.chunk(world_size), strict=True))]
        losses.append(sum(float(v.detach()) for v in slices))
        (sum(slices) / world_size).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses



def live_storage_bytes(exclude: list[torch.Tensor]) -> dict[int, int]:
    """Every CPU tensor storage Python can reach (data pointer -> bytes), less those of ``exclude``."""
    import gc
    import warnings

    gc.collect()
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    found: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # isinstance on torch.distributed's deprecated aliases
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip and storage.nbytes():
            found[storage.data_ptr()] = storage.nbytes()
    return found


def settled_storage_bytes(exclude: list[torch.Tensor], seconds: float = 2.0) -> dict[int, int]:
    """:func:`live_storage_bytes` once two counts 20 ms apart agree (within ``seconds``). gloo's worker thread
    drops its reference to a finished collective's tensors a moment after ``wait()`` returns, so a count
    taken at once may still see the last gathers' pool slots, which are freed by then; memory that is really
    kept is counted by every try."""
    import time

    deadline = time.monotonic() + seconds
    found = live_storage_bytes(exclude)
    while time.monotonic() < deadline:
        time.sleep(0.02)
        again = live_storage_bytes(exclude)
        if again == found:
            break
        found = again
    return found


def run_memory_between_steps(rank: int, world_size: int, stage: int, set_to_none: bool, release: bool = True,
                             steps: int = 3) -> dict[str, Any]:
    """Every tensor storage alive after each ``zero_grad`` (the model's own parameters and buffers
    aside) against what ZeRO says a rank holds between steps: master shards and optimizer state.
    Four 64x64 layers in buckets of one layer each (about 33 KB of gradient shard per rank at 2 ranks,
    far above the few bytes of scalars torch keeps for itself)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    engine = ZeroEngine(model, [opt], ZeroConfig(stage, bucket_size_mb=0.02, release_grad_shards=release))
    opt = engine.optimizers[0]
    own = [*model.parameters(), *model.buffers()]
    between: list[dict[str, Any]] = []
    for step in range(steps):
        x, y = (torch.randn(8, 64, generator=torch.Generator().manual_seed(step * world_size + rank))
                for _ in range(2))
        F.mse_loss(model(x), y).backward()
        engine.ensure_flushed()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        engine.finish_param_gather()
        del x, y
        live = settled_storage_bytes(own)
        masters = {b.master_shard.untyped_storage().data_ptr() for b in engine.buckets}
        state = {v.untyped_storage().data_ptr() for s in opt.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)}
        presence = {v.untyped_storage().data_ptr() for v in engine.reducer.presence._vectors.values()}
        expected = masters | state | presence
        between.append({
            "unexpected_bytes": sum(n for ptr, n in live.items() if ptr not in expected),
            "missing": len(expected - set(live)),
            "grad_shards_held": sum(b.holds_grad_shard for b in engine.buckets),
            "grad_shard_bytes": sum(b.master_shard.nbytes for b in engine.buckets if b.communicates),
            "buckets": len(engine.buckets),
        })
    engine.close()
    return {"between": between}


def run_gather_peer_stops_answering(rank: int, world_size: int, wait_seconds: float) -> dict[str, Any]:
    """Two steps' forward and backward trained together; then rank 1 stops answering (it sleeps past rank 0's
    bound on a wait, then leaves) instead of stepping, while rank 0 steps: rank 0's overlapped gathers wait
    for rank 1's rows, and its next parameter read must fail with the named cause once the bound has passed,
    not wait for the peer forever ([Note: bounded waits] in engine/collectives.py; on gloo the gathers are
    broadcasts, [Note: gloo all-gather])."""
    import time
    from datetime import timedelta

    model, engine = _deep_engine(overlap_param_gather=True)
    _deep_step(model, engine, 0, rank, world_size)
    engine.finish_param_gather()
    x, y = global_batch(1, 0, world_size)
    F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
    engine.ensure_flushed()  # the reductions, with every rank
    if rank == 1:
        time.sleep(3 * wait_seconds)
        return {}
    started = time.monotonic()
    with mock.patch.object(comm, "process_group_timeout", return_value=timedelta(seconds=wait_seconds)):
        engine.optimizers[0].step()  # launches the gathers in their thread and returns
        try:
            model(x.chunk(world_size)[rank])  # the first read waits for the first bucket
        except RuntimeError as exc:
            return {"error": str(exc), "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}


class Many(nn.Module):
    """Forty small layers, one bucket of them all at the default bucket size: whose blocks at 2 and 3 ranks are
    exact (16 and 4 elements at 2 ranks) or padded (the 1-element gains, and everything at 3 ranks), more
    parameters than one foreach copy takes ([Note: one copy a bucket] in engine/grad_bucket.py)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(40))
        self.gains = nn.ParameterList(nn.Parameter(torch.full((1,), 1.0 + i / 10)) for i in range(10))

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if not (skip and i == 17):
                x = torch.tanh(layer(x))
            if i % 4 == 3:
                x = x * self.gains[i // 4]
        return x


def _many_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(4 * world_size, 4, generator=generator), torch.randn(4 * world_size, 4, generator=generator)


def run_many_params(rank: int, world_size: int, steps: int, create_graph: bool = False) -> dict[str, torch.Tensor]:
    """ZeRO-2 over :class:`Many`; rank 1 skips a layer in odd steps (its gradient is missing there).
    ``create_graph``: every backward keeps its graph (a gradient penalty's backward: the buckets pack gradients that
    carry a history), and no layer is skipped."""
    model = Many()
    engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters(), lr=0.01)], ZeroConfig(stage=2))
    assert len(engine.buckets) == 1 and len(engine.buckets[0].params) > 32
    for step in range(steps):
        x, y = _many_batch(step, world_size)
        skip = not create_graph and rank == 1 and step % 2 == 1
        loss = F.mse_loss(model(x.chunk(world_size)[rank], skip=skip), y.chunk(world_size)[rank])
        loss.backward(create_graph=create_graph)
        engine.ensure_flushed()
        engine.optimizers[0].step()
        engine.optimizers[0].zero_grad()
    engine.finish_param_gather()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.close()
    return params


def many_params_reference(world_size: int, steps: int, skip: bool = True) -> dict[str, torch.Tensor]:
    """Plain PyTorch on the global batch, the same layer skipped on rank 1's slice (``skip``)."""
    model = Many()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(steps):
        x, y = _many_batch(step, world_size)
        loss = sum(F.mse_loss(model(xs, skip=skip and r == 1 and step % 2 == 1), ys)
                   for r, (xs, ys) in enumerate(zip(x.chunk(world_size), y.chunk(world_size), strict=True)))
        (loss / world_size).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
