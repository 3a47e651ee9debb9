"""Scale simulation: one process stands in for one rank of a world of 8 to 1024 ranks.

torch's fake process group (``torch.testing._internal.distributed.fake_pg``) accepts every
collective and returns at once without writing the outputs. Where the engine reads an output, this
script fills it the way the real collective would if every rank had contributed what this rank did
(:func:`filled_collectives`): the reduce-scatter leaves ``world_size x`` this rank's chunk (flags
included, so the presence logic runs for real), the all-gather writes this rank's shard into every
row (finite values, the same bytes a real gather writes). What is left is the engine's own host
work at that world size: hooks, packing, flag handling, the inner optimizer on 1/ws of the
elements, gather bookkeeping and row copies, and the per-rank bytes of its shards.

The model has the tensor count of a 7B LLaMA-style transformer (32 blocks of q/k/v/o, gate/up/down
and two norms, plus embedding, final norm and an untied head: 291 tensors), narrowed to d_model 64
so it fits in memory; a variant with 8 blocks (75 tensors) separates growth in tensor count from
growth in world size. Times are per step (forward, backward, ``ensure_flushed``, ``step``,
``finish_param_gather``, ``zero_grad``) and for the same model with plain PyTorch (no engine, the
optimizer over the full parameters), alternating step by step with the engine's, medians of the
timed steps and of the per-round difference, one thread.

Checkpoint planning (:func:`simulate_planning`): DCP plans a ``sharded`` save in three steps, each
rank's local plan, the coordinator's global plan over every rank's local plan (deduplication,
validation, ``.metadata``), and each rank's final plan; a load plans each rank's reads against
``.metadata``, which every loading rank unpickles (timed here) after the coordinator read it and
broadcast it ([Note: shared metadata]). None of it needs a collective, so the simulation runs the real planners
(:class:`~lightning_zero.checkpoint.dcp.adapter.FlatChunkSavePlanner`, DCP's file writer,
:class:`~lightning_zero.checkpoint.dcp.adapter.FlatChunkLoadPlanner`) on the tree every rank hands DCP
(fp32 master, ``exp_avg`` and ``exp_avg_sq`` of every tensor as flat chunks, AdamW's ``step``
counters as replicated scalars), one rank after the other in this process, and times the steps as
one rank (the slowest: rank 0, also the coordinator) would run them. The bytes that DCP's gathers
carry are measured as the pickles it sends.

Usage::

    .venv/bin/python bench/scale.py                   # world sizes 8 64 512 1024, 8 and 32 blocks
    .venv/bin/python bench/scale.py --quick           # 2 timed steps, world sizes 8 and 1024

The markdown report goes to stdout and to ``bench/out/scale.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import describe_machine, load_average
from torch import Tensor, nn

from lightning_zero.engine import DEFAULT_BUCKET_MB, MIN_CHUNK_NUMEL, ZeroConfig, ZeroEngine
from lightning_zero.engine import collectives as comm
from lightning_zero.engine.comm_pool import MAX_IN_FLIGHT
from lightning_zero.engine.sharding import EvenShard, assign_buckets

OUT_DIR = Path(__file__).resolve().parent / "out"
MIB = 1024 * 1024


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    """LLaMA's block, narrowed: 9 parameter tensors (4 attention, 3 MLP, 2 norms)."""

    def __init__(self, d: int, ff: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.mlp_norm = RMSNorm(d)
        self.gate, self.up = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.down = nn.Linear(ff, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (proj(h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for proj in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class NarrowLlama(nn.Module):
    def __init__(self, blocks: int, d: int = 64, ff: int = 172, heads: int = 4, vocab: int = 512) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, ff, heads) for _ in range(blocks))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), targets.flatten())


@contextlib.contextmanager
def filled_collectives(rank: int, world_size: int) -> Iterator[None]:
    """Make the fake group's outputs what the engine would read from a real one (module docstring)."""
    reduce_scatter, all_gather = comm._reduce_scatter, comm._all_gather

    def filled_reduce_scatter(output: Tensor, input: Tensor, **kwargs: Any) -> Any:
        work = reduce_scatter(output, input, **kwargs)
        output.copy_(input.view(world_size, -1)[rank]).mul_(world_size)
        return work

    def filled_all_gather(output: Tensor, input: Tensor, **kwargs: Any) -> Any:
        work = all_gather(output, input, **kwargs)
        output.view(world_size, -1).copy_(input.expand(world_size, -1))
        return work

    comm._reduce_scatter, comm._all_gather = filled_reduce_scatter, filled_all_gather  # type: ignore[assignment]
    try:
        yield
    finally:
        comm._reduce_scatter, comm._all_gather = reduce_scatter, all_gather  # type: ignore[assignment]


@dataclass
class ScaleResult:
    world_size: int
    blocks: int
    tensors: int
    numel: int
    buckets: int
    engine_step_ms: float
    plain_step_ms: float
    overhead_ms: float  # median over rounds of (engine step - plain step)
    master_bytes: int
    state_bytes: int
    grad_shard_bytes: int

    def per_rank_vs_even(self, nbytes: int, bytes_per_element: int) -> float:
        return nbytes / (self.numel * bytes_per_element / self.world_size)


def batch(step: int, vocab: int = 512) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(vocab, (1, 9), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def one_step(model: nn.Module, engine: ZeroEngine | None, optimizer: torch.optim.Optimizer, step: int) -> float:
    start = time.perf_counter()
    model(*batch(step)).backward()
    if engine is not None:
        engine.ensure_flushed()
    optimizer.step()
    if engine is not None:
        engine.finish_param_gather()
    optimizer.zero_grad()
    return time.perf_counter() - start


def paired_steps(plain: tuple[nn.Module, torch.optim.Optimizer], zero: tuple[nn.Module, ZeroEngine, Any],
                 steps: int) -> tuple[float, float, float]:
    """Plain and engine steps alternate (a load spike hits both); medians of the plain step, the
    engine step and the per-round difference, in ms. Step 0 of each warms up (lazy state, pool)."""
    plain_s, zero_s = [], []
    for step in range(steps + 1):
        p = one_step(plain[0], None, plain[1], step)
        z = one_step(zero[0], zero[1], zero[2], step)
        if step:
            plain_s.append(p)
            zero_s.append(z)
    diffs = [z - p for z, p in zip(zero_s, plain_s, strict=True)]
    return (statistics.median(plain_s) * 1000, statistics.median(zero_s) * 1000, statistics.median(diffs) * 1000)


def simulate(world_size: int, blocks: int, steps: int, bucket_size_mb: float | None) -> ScaleResult:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rank = 0  # the busiest rank: it owns a full chunk of every tensor
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        plain = NarrowLlama(blocks)
        model = NarrowLlama(blocks)
        with filled_collectives(rank, world_size):
            engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters(), lr=1e-3)],
                                ZeroConfig(stage=2, bucket_size_mb=bucket_size_mb))
            opt = engine.optimizers[0]
            plain_ms, engine_ms, overhead_ms = paired_steps(
                (plain, torch.optim.AdamW(plain.parameters(), lr=1e-3)), (model, engine, opt), steps)
        state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                          if isinstance(v, Tensor) and v.dim() > 0)
        result = ScaleResult(
            world_size=world_size, blocks=blocks, tensors=len(list(model.parameters())),
            numel=sum(p.numel() for p in model.parameters()), buckets=len(engine.buckets),
            engine_step_ms=engine_ms, plain_step_ms=plain_ms, overhead_ms=overhead_ms,
            master_bytes=sum(b.master_shard.numel() * b.master_shard.element_size() for b in engine.buckets),
            state_bytes=state_bytes,
            # A backward takes a master-sized gradient shard; reading b.grad_shard here would allocate one.
            grad_shard_bytes=sum(b.master_shard.numel() * b.master_shard.element_size() for b in engine.buckets),
        )
        engine.close()
        return result
    finally:
        dist.destroy_process_group()


@dataclass
class SavePlanTimes:
    """What a ``sharded`` save's planning costs rank 0, which is also the coordinator."""

    items_per_rank: int
    local_save_ms: float
    """Rank 0's local save plan (its planner and DCP's file writer)."""
    global_save_ms: float
    """The coordinator: global plan (deduplication, validation, metadata) and the writer's file names."""
    cached_local_save_ms: float
    """Rank 0's local plan at the next save of the same tree ([Note: cached save plans]): compared with
    its cached one, an empty plan is sent."""
    cached_global_save_ms: float
    """The coordinator's global plan at that save, from every rank's empty plan."""
    cached_gathered_bytes: int
    global_save_collector_ms: float = 0.0
    """The coordinator's global plan as above (no cache), with Python's collector running during it."""


@dataclass
class PlanResult:
    world_size: int
    tensors: int
    save: SavePlanTimes
    local_plan_bytes: int
    """Rank 0's local plan as DCP pickles it for the gather to the coordinator."""
    gathered_bytes: int
    """Every rank's local plan: what the coordinator receives."""
    metadata_bytes: int
    """``.metadata`` with one storage record per written item, pickled."""
    metadata_unpickle_ms: float
    """Unpickling those bytes as every loading rank does (``dcp_integrity.unpickle_metadata``)."""
    metadata_unpickle_collector_ms: float
    """The same with Python's collector running (``pause_gc=False``: the side-by-side control)."""
    local_load_ms: float
    """Rank 0's read plan against that ``.metadata``, loading at the same world size."""
    reshard_load_ms: float
    """The same, loading at half the world size (every target chunk overlaps two saved ones)."""
    local_load_collector_ms: float
    """Rank 0's read plan at the same world size with Python's collector running."""


def rank_dcp_state(shapes: Sequence[tuple[str, tuple[int, ...]]], rank: int, world_size: int) -> dict[str, Any]:
    """What ``rank`` hands DCP in a ``sharded`` save of this model (``modes.sharded.split_for_dcp``)."""
    from lightning_zero.checkpoint.formats.tree import FlatShard
    from lightning_zero.checkpoint.modes import sharded

    tree: dict[str, Any] = {}
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        tree[kind] = {name: FlatShard(torch.empty(EvenShard(math.prod(shape), world_size).shard_numel(rank)), shape,
                                      rank, world_size) for name, shape in shapes}
    tree["step"] = {name: torch.zeros(()) for name, _ in shapes}
    tensors, _ = sharded.split_for_dcp(tree)
    return tensors


@dataclass
class PlannedSave:
    shapes: list[tuple[str, tuple[int, ...]]]
    plans: list[Any]
    """Every rank's local plan, as the coordinator receives them."""
    global_plans: list[Any]
    metadata: Any
    times: SavePlanTimes


def plan_save(world_size: int, blocks: int) -> PlannedSave:
    """DCP's save planning of every rank of a ``sharded`` save, run here one rank after the other."""
    import pickle
    import tempfile

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.planner import SavePlan

    from lightning_zero.checkpoint.dcp.adapter import (
        FlatChunkSavePlanner,
        forget_plans,
        plan_cache_key,
        tree_signature,
    )

    shapes = [(name, tuple(p.shape)) for name, p in NarrowLlama(blocks).named_parameters()]
    # As the saver makes it: the team, the dedup rule and every rank's tree (the same names and
    # dtypes on every rank here).
    key = plan_cache_key(tuple(range(world_size)), False,
                         [tree_signature(rank_dcp_state(shapes, 0, world_size))] * world_size)
    with tempfile.TemporaryDirectory() as directory:
        writer = FileSystemWriter(directory)
        plans = []
        for rank in range(world_size):
            state = rank_dcp_state(shapes, rank, world_size)
            start = time.perf_counter()
            planner = FlatChunkSavePlanner(cache_key=key)
            planner.set_up_planner(state_dict=state, storage_meta=None, is_coordinator=rank == 0)
            writer.set_up_storage_writer(rank == 0, rank=rank)
            plans.append(writer.prepare_local_plan(planner.create_local_plan()))
            if rank == 0:
                coordinator, local_save_ms = planner, (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        global_plans, metadata = coordinator.create_global_plan(plans)
        global_plans = writer.prepare_global_plan(global_plans)
        global_save_ms = (time.perf_counter() - start) * 1e3
        # The control: the same global plan (uncached) with the collector running, the rest as above.
        control = FlatChunkSavePlanner(pause_gc=False)
        control.set_up_planner(state_dict=rank_dcp_state(shapes, 0, world_size), storage_meta=None,
                               is_coordinator=True)
        start = time.perf_counter()
        writer.prepare_global_plan(control.create_global_plan(plans)[0])
        global_save_collector_ms = (time.perf_counter() - start) * 1e3
        del control
        # DCP's plan caches are class attributes, one entry per key: in this one process only rank 0
        # may fill the local ones, as its own process would.
        coordinator.finish_plan(global_plans[0])
        # The next save of the same tree: rank 0 plans again; every other rank sends what its own
        # cache makes it send, an empty plan.
        state = rank_dcp_state(shapes, 0, world_size)
        start = time.perf_counter()
        again = FlatChunkSavePlanner(cache_key=key)
        again.set_up_planner(state_dict=state, storage_meta=None, is_coordinator=True)
        first = writer.prepare_local_plan(again.create_local_plan())
        cached_local_save_ms = (time.perf_counter() - start) * 1e3
        unchanged = [first] + [SavePlan([], usable=False) for _ in range(world_size - 1)]
        start = time.perf_counter()
        writer.prepare_global_plan(again.create_global_plan(unchanged)[0])
        cached_global_save_ms = (time.perf_counter() - start) * 1e3
        assert again.finish_plan(SavePlan([], usable=False)).items == global_plans[0].items, "cache missed"
        cached_gathered_bytes = sum(len(pickle.dumps(plan)) for plan in unchanged)
    forget_plans(key)  # the next simulated world has other plans: free these
    return PlannedSave(shapes, plans, global_plans, metadata,
                       SavePlanTimes(len(coordinator.state_dict), local_save_ms, global_save_ms, cached_local_save_ms,
                                     cached_global_save_ms, cached_gathered_bytes, global_save_collector_ms))


def simulate_planning(world_size: int, blocks: int) -> PlanResult:
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    from lightning_zero.checkpoint.dcp.adapter import FlatChunkLoadPlanner, chunk_bytes
    from lightning_zero.checkpoint.dcp.integrity import unpickle_metadata

    planned = plan_save(world_size, blocks)
    local_plan_bytes = len(pickle.dumps(planned.plans[0]))
    gathered_bytes = sum(len(pickle.dumps(plan)) for plan in planned.plans)
    # What the writers' results add to .metadata: one storage record per written item.
    storage = {}
    for rank, plan in enumerate(planned.global_plans):
        offset = 0
        for item in plan.items:
            length = chunk_bytes(item)
            storage[item.index] = _StorageInfo(f"__{rank}_0.distcp", offset, length)
            offset += length
    metadata = Metadata(state_dict_metadata=planned.metadata.state_dict_metadata,
                        planner_data=planned.metadata.planner_data, storage_data=storage)
    raw_metadata = pickle.dumps(metadata)
    metadata_bytes = len(raw_metadata)
    unpickle_ms = []
    for control in (False, True):  # the control: Python's collector running, as before the pause
        start = time.perf_counter()
        unpickle_metadata(raw_metadata, "simulated", pause_gc=not control)
        unpickle_ms.append((time.perf_counter() - start) * 1e3)
    del raw_metadata

    def load_plan_ms(load_world_size: int, pause_gc: bool = True) -> float:
        state = rank_dcp_state(planned.shapes, 0, load_world_size)
        start = time.perf_counter()
        planner = FlatChunkLoadPlanner(pause_gc=pause_gc)
        planner.set_up_planner(state, metadata, is_coordinator=True)
        planner.create_local_plan()
        return (time.perf_counter() - start) * 1e3

    local_load_ms = load_plan_ms(world_size)
    local_load_collector_ms = load_plan_ms(world_size, pause_gc=False)
    return PlanResult(world_size=world_size, tensors=len(planned.shapes), save=planned.times,
                      local_plan_bytes=local_plan_bytes, gathered_bytes=gathered_bytes, metadata_bytes=metadata_bytes,
                      metadata_unpickle_ms=unpickle_ms[0], metadata_unpickle_collector_ms=unpickle_ms[1],
                      local_load_ms=local_load_ms, reshard_load_ms=load_plan_ms(max(1, world_size // 2)),
                      local_load_collector_ms=local_load_collector_ms)


def planning_report(results: list[PlanResult]) -> list[str]:
    lines = [
        "Planning a `sharded` checkpoint (`simulate_planning`: the real planners, every rank's plan built in"
        " this process; times as rank 0, which is also the coordinator, would spend them):",
        "",
        "| world size | tensors | DCP items per rank | rank's local save plan ms | its plan, pickled KB |"
        " coordinator receives MB | coordinator's global plan ms | `.metadata` MB | next save (cached):"
        " local ms | next save: global ms | next save: coordinator receives KB | rank's load plan ms |"
        " load plan at ws/2 (reshard) ms | a rank unpickles `.metadata` ms | `.metadata` read from storage"
        " per resume, every rank twice (before) / the coordinator once (now) MB |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(f"| {r.world_size} | {r.tensors} | {r.save.items_per_rank} | {r.save.local_save_ms:.1f} |"
                     f" {r.local_plan_bytes / 1024:.0f} | {r.gathered_bytes / 1e6:.1f} | {r.save.global_save_ms:.0f} |"
                     f" {r.metadata_bytes / 1e6:.1f} | {r.save.cached_local_save_ms:.1f} | {r.save.cached_global_save_ms:.2f} |"
                     f" {r.save.cached_gathered_bytes / 1024:.0f} | {r.local_load_ms:.1f} | {r.reshard_load_ms:.1f} |"
                     f" {r.metadata_unpickle_ms:.0f} | {2 * r.world_size * r.metadata_bytes / 1e6:,.0f} /"
                     f" {r.metadata_bytes / 1e6:.1f} |")
    lines += [
        "",
        "The collector paused while DCP's plans and `.metadata` are made ([Note: no collections while planning]),"
        " against the same work with it running, in the same run:",
        "",
        "| world size | tensors | coordinator's global plan ms: paused / running | ratio | unpickle `.metadata` ms:"
        " paused / running | ratio | rank's load plan ms: paused / running | ratio |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r.world_size} | {r.tensors} | {r.save.global_save_ms:,.0f} / {r.save.global_save_collector_ms:,.0f} |"
            f" {r.save.global_save_ms / r.save.global_save_collector_ms:.2f}x |"
            f" {r.metadata_unpickle_ms:,.0f} / {r.metadata_unpickle_collector_ms:,.0f} |"
            f" {r.metadata_unpickle_ms / r.metadata_unpickle_collector_ms:.2f}x |"
            f" {r.local_load_ms:,.1f} / {r.local_load_collector_ms:,.1f} | {r.local_load_ms / r.local_load_collector_ms:.2f}x |")
    by_tensors: dict[int, list[PlanResult]] = {}
    for r in results:
        by_tensors.setdefault(r.tensors, []).append(r)
    lines.append("")
    for tensors, rows in sorted(by_tensors.items()):
        first, last = rows[0], rows[-1]
        if first is last:
            continue
        grow = last.world_size / first.world_size
        lines.append(
            f"- {tensors} tensors, {first.world_size} -> {last.world_size} ranks ({grow:.0f}x): a rank's local"
            f" save plan {last.save.local_save_ms / first.save.local_save_ms:.2f}x; the coordinator's global plan"
            f" {last.save.global_save_ms / first.save.global_save_ms:.0f}x and what it receives"
            f" {last.gathered_bytes / first.gathered_bytes:.0f}x; `.metadata`"
            f" {last.metadata_bytes / first.metadata_bytes:.0f}x; a rank's load plan"
            f" {last.local_load_ms / first.local_load_ms:.1f}x (per saved chunk of every tensor:"
            f" {last.local_load_ms * 1e3 / (last.save.items_per_rank * last.world_size):.2f} us at {last.world_size},"
            f" {first.local_load_ms * 1e3 / (first.save.items_per_rank * first.world_size):.2f} us at {first.world_size})."
        )
    return lines


POOL_WORLD_SIZES = (8, 64, 128, 256, 512, 1024)
LLAMA_7B = {"d": 4096, "ff": 11008, "blocks": 32, "vocab": 32000}


def llama_7b_numels() -> list[int]:
    """Parameter sizes of LLaMA-7B in registration order (6.74B: embedding, 32 x (norm, q, k, v, o,
    norm, gate, up, down), final norm, untied head)."""
    d, ff, vocab = LLAMA_7B["d"], LLAMA_7B["ff"], LLAMA_7B["vocab"]
    block = [d, d * d, d * d, d * d, d * d, d, d * ff, d * ff, ff * d]
    return [vocab * d, *block * LLAMA_7B["blocks"], d, vocab * d]


def old_default_bucket_numel(world_size: int, element_size: int) -> int:
    """The default before the byte ceiling: ``max(25 MiB, 1M elements x world_size)``."""
    return max(int(DEFAULT_BUCKET_MB * MIB) // element_size, MIN_CHUNK_NUMEL * world_size)


def pool_bytes(numels: Sequence[int], world_size: int, capacity: int, element_size: int) -> int:
    """What the engine's pool holds per rank while a backward or a step runs: ``MAX_IN_FLIGHT`` slots
    of the largest bucket's reduction buffer (``[ws, row + flags]`` plus the reduce-scatter output
    row, as on NCCL) or gathered buffer, whichever is larger ([Note: buffer pool] in engine/comm_pool.py)."""
    launch_order = list(reversed(numels))
    largest = 0
    for indices in assign_buckets(launch_order, world_size, capacity):
        row = sum(EvenShard(launch_order[i], world_size).chunk for i in indices)
        largest = max(largest, (row + len(indices)) * (world_size + 1), row * world_size)
    return MAX_IN_FLIGHT * largest * element_size


def pool_report(world_sizes: Sequence[int]) -> list[str]:
    """Per-rank pool bytes for a 7B-shaped model in bf16, old and new default buckets: computed from
    the bucket layout the engine builds (:func:`~lightning_zero.engine.sharding.assign_buckets`), not run."""
    numels, element_size = llama_7b_numels(), 2
    weights_gib = sum(numels) * element_size / 1024**3
    lines = [
        f"Communication pool per rank, LLaMA-7B shape ({sum(numels) / 1e9:.2f}B parameters, bf16 weights"
        f" {weights_gib:.1f} GiB), default buckets (`bucket_size_mb=None`), computed from the engine's bucket"
        f" layout: {MAX_IN_FLIGHT} slots of the largest bucket, held during backward and the step's gathers"
        " and released once the gathers end ([Note: pool between steps]): 0 between steps with both"
        " defaults now; before that release, the figure was held between steps too. A parameter larger"
        " than the bucket gets a bucket of its own, so the embedding and the head (250 MiB each) set a"
        " floor under the pool at small world sizes.",
        "",
        "| world size | old default bucket MiB | old pool MiB/rank | new default bucket MiB | new pool MiB/rank "
        "| new chunk per rank (elements) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for ws in world_sizes:
        old = old_default_bucket_numel(ws, element_size)
        new = ZeroConfig().bucket_numel(ws, element_size)
        lines.append(
            f"| {ws} | {old * element_size / MIB:,.0f} | {pool_bytes(numels, ws, old, element_size) / MIB:,.0f} "
            f"| {new * element_size / MIB:,.0f} | {pool_bytes(numels, ws, new, element_size) / MIB:,.0f} "
            f"| {new // ws:,} |"
        )
    lines += [
        "",
        "For reference, the peers' documented defaults (not measured here): Megatron-LM's distributed"
        " optimizer uses buckets of max(40M, 1M x data-parallel size) elements that are views of its"
        " contiguous gradient buffer (no separate pool); DeepSpeed ZeRO-1/2 defaults to"
        " `reduce_bucket_size` and `allgather_bucket_size` of 5e8 elements.",
    ]
    return lines


def report(results: list[ScaleResult], command: str, elapsed_s: float, bucket_size_mb: float | None,
           plans: Sequence[PlanResult] = ()) -> str:
    lines = [
        f"Command: `{command}`  ",
        f"Machine: {describe_machine().replace('backend gloo on 127.0.0.1', 'backend fake (one process)')}."
        f" Load average at the end: {load_average()}. Whole run {elapsed_s:.0f} s.  ",
        "ZeroEngine stage 2, AdamW, fp32, bucket_size_mb "
        f"{'None (scaled with the world size)' if bucket_size_mb is None else bucket_size_mb}, this process"
        " is rank 0 (the busiest: a full chunk of every tensor); batch 1 x 8 tokens, so compute is small and the engine's host work shows.",
        "",
        "| world size | blocks | tensors | parameters | buckets | engine step ms | plain PyTorch step ms "
        "| engine - plain (paired), µs per tensor | master B/rank vs total/ws | optimizer state vs total/ws "
        "| grad shard vs total/ws | padding bound (tensors x 1 element) vs total/ws |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        extra_us = r.overhead_ms * 1000 / r.tensors
        lines.append(
            f"| {r.world_size} | {r.blocks} | {r.tensors} | {r.numel:,} | {r.buckets} | {r.engine_step_ms:.1f} "
            f"| {r.plain_step_ms:.1f} | {extra_us:.0f} | {r.per_rank_vs_even(r.master_bytes, 4):.4f} "
            f"| {r.per_rank_vs_even(r.state_bytes, 8):.4f} | {r.per_rank_vs_even(r.grad_shard_bytes, 4):.4f} "
            f"| {1 + r.tensors / (r.numel / r.world_size):.4f} |"
        )
    lines += ["", *growth_lines(results)]
    lines += ["", *pool_report(POOL_WORLD_SIZES)]
    if plans:
        lines += ["", *planning_report(plans)]
    return "\n".join(lines)


def growth_lines(results: list[ScaleResult]) -> list[str]:
    """How the engine's time grows with world size (fixed tensors) and with tensors (fixed ws)."""
    out = []
    by_key = {(r.world_size, r.blocks): r for r in results}
    sizes = sorted({r.world_size for r in results})
    blocks = sorted({r.blocks for r in results})
    for b in blocks:
        first, last = by_key.get((sizes[0], b)), by_key.get((sizes[-1], b))
        if first and last:
            out.append(f"- {first.tensors} tensors: engine step {first.engine_step_ms:.1f} ms at {sizes[0]} ranks,"
                       f" {last.engine_step_ms:.1f} ms at {sizes[-1]} ranks ({last.engine_step_ms / first.engine_step_ms:.2f}x"
                       f" for {sizes[-1] // sizes[0]}x the ranks).")
    if len(blocks) >= 2:
        for ws in sizes:
            small, big = by_key.get((ws, blocks[0])), by_key.get((ws, blocks[-1]))
            if small and big:
                out.append(f"- ws={ws}: engine step {small.engine_step_ms:.1f} ms for {small.tensors} tensors,"
                           f" {big.engine_step_ms:.1f} ms for {big.tensors}"
                           f" ({big.engine_step_ms / small.engine_step_ms:.2f}x for {big.tensors / small.tensors:.2f}x"
                           f" the tensors); paired overhead over plain PyTorch {small.overhead_ms:.1f} ms and"
                           f" {big.overhead_ms:.1f} ms.")
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 timed steps, world sizes 8 and 1024")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--blocks", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 15)")
    parser.add_argument("--bucket-size-mb", type=float, default=None, help="default: scale with the world size")
    parser.add_argument("--no-planning", action="store_true", help="skip the checkpoint planning simulation")
    parser.add_argument("--out", type=Path, default=OUT_DIR / "scale.md")
    args = parser.parse_args(argv)
    if args.world_sizes is None:
        args.world_sizes = [8, 1024] if args.quick else [8, 64, 512, 1024]
    if args.steps is None:
        args.steps = 2 if args.quick else 15
    if any(ws < 2 for ws in args.world_sizes):
        parser.error(f"--world-sizes must all be >= 2, got {args.world_sizes}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    command = " ".join([".venv/bin/python", "bench/scale.py", *(sys.argv[1:] if argv is None else argv)])
    start = time.perf_counter()
    results = []
    for blocks in args.blocks:
        for ws in args.world_sizes:
            results.append(simulate(ws, blocks, args.steps, args.bucket_size_mb))
            r = results[-1]
            print(f"  ws={ws} blocks={blocks}: engine {r.engine_step_ms:.1f} ms, plain {r.plain_step_ms:.1f} ms",
                  flush=True)
    plans = []
    if not args.no_planning:
        for blocks in args.blocks:
            for ws in args.world_sizes:
                plans.append(simulate_planning(ws, blocks))
                p = plans[-1]
                print(f"  planning ws={ws} blocks={blocks}: global save plan {p.save.global_save_ms:.0f} ms,"
                      f" load plan {p.local_load_ms:.1f} ms", flush=True)
    text = report(results, command, time.perf_counter() - start, args.bucket_size_mb, plans)
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
