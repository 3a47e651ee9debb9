"""Checkpoint benchmark: how long async saves block training, how fast they write, how fast they load.

Two gloo CPU processes (127.0.0.1) run a ``ZeroEngine`` (stage 2) over an MLP sized so that the
checkpointed state (fp32 master shards + AdamW's ``exp_avg`` and ``exp_avg_sq``, 12 bytes per
parameter) is ``--size-mb`` MiB in total over the ranks, after one AdamW step. Side by side, in
one run, with each measurement repeated and interleaved (median of the repeats, slowest rank):

1. how long the save call blocks the training thread: ``lightning_zero.checkpoint.async_save``
   (``local``, ``sharded``), the synchronous ``save`` of the same state, Lightning's
   ``AsyncCheckpointIO(TorchCheckpointIO())`` writing the equivalent full state dict from rank 0,
   and ``torch.distributed.checkpoint.async_save`` of the same shards (plain tensors, see
   :func:`per_rank_state`);
2. an in-memory clone of every tensor of the tree: the floor of any save that snapshots state;
3. with a real training step after the save call: how long ``wait_for_staging()`` (which the
   strategy calls right before the optimizer step) then blocked, and how much slower training
   steps run while the background write goes on;
4. background write throughput, bytes / (commit - end of staging), beside the disk's raw
   sequential write + fsync rate measured in the same run;
5. load time of the ``sharded`` checkpoint at world size 2, and resharded at 1 (and 3) ranks,
   with the page cache of the checkpoint files dropped first.

Usage::

    .venv/bin/python bench/checkpoint.py                 # 512 MiB of state, 5 repeats (make bench)
    .venv/bin/python bench/checkpoint.py --quick         # 64 MiB, smoke run
    .venv/bin/python bench/checkpoint.py --size-mb 1024 --repeats 5 --reshard-world-sizes 1 3
    .venv/bin/python bench/checkpoint.py --integrity     # only: write/load rate with and without checksums
    .venv/bin/python bench/checkpoint.py --hybrid        # only: a 2 x 2 hybrid save beside a flat 4-rank one
    .venv/bin/python bench/checkpoint.py --tiered        # only: tiered saves beside S3 and local ones (tiered_checkpoint.py)

The markdown report goes to stdout and to ``bench/out/checkpoint.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _ckpt_common import (
    MB,
    MIB,
    OUT_DIR,
    Check,
    bench_command,
    busy_cpu_seconds,
    describe_machine,
    drop_page_cache,
    max_over_ranks,
    median,
    ms,
    now,
    own_cpu_seconds,
    peak_rss_bytes,
    publish,
    raw_throughput,
    run_world,
    runs,
    scratch_root,
    slowest,
    throughput,
    write_raw,
)
from torch import Tensor, nn

from lightning_zero.checkpoint import (
    FlatShard,
    async_save,
    engine_tree,
    load,
    maybe_finalize_async_calls,
    save,
    wait_for_staging,
)
from lightning_zero.checkpoint.formats.tree import is_tensor_leaf, map_leaves, walk
from lightning_zero.checkpoint.runtime.team import set_up_coordination
from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.optimizer import ZeroOptimizer

RAW_WRITE_CHUNK = 64 * MIB
MAX_STEPS_DURING_WRITE = 6
BLOCKS = 4

# Targets from the issue; every check below reads these names.
MAX_BLOCK_VS_COPY = 1.5
MAX_BLOCK_VS_SYNC = 0.10
MIN_WRITE_VS_RAW = 0.70
MAX_RESHARD_VS_SAME = 1.5

@dataclass(frozen=True)
class Settings:
    size_mb: int
    """MiB of checkpointed tensors over all ranks (masters + AdamW's two moments)."""
    repeats: int
    """Interleaved repetitions of every measurement; the report gives the median."""
    root: str
    """Directory the checkpoints are written to (deleted at the end)."""
    reshard_world_sizes: tuple[int, ...]
    """World sizes that load the 2-rank ``sharded`` checkpoint (resharding)."""
    batch: int = 16
    """Rows per rank in the simulated training step."""
    world_size: int = 2
    seed: int = 0


# ---- model and training step ----------------------------------------------------------------


def model_width(size_mb: int) -> int:
    """Width of a ``BLOCKS``-block MLP (8 w^2 weights per block) whose checkpoint is >= size_mb MiB:
    12 bytes per parameter (fp32 master + exp_avg + exp_avg_sq)."""
    params = size_mb * MIB / 12
    return math.ceil(math.sqrt(params / (8 * BLOCKS)) / 64) * 64


def build_model(width: int, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        # LayerNorm's small parameters give the tree odd-sized shards beside the big ones.
        layers += [nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)]
    return nn.Sequential(*layers)


@dataclass
class Trainer:
    model: nn.Sequential
    engine: ZeroEngine
    opt: ZeroOptimizer
    batch: Tensor
    meta: dict[str, Any]
    """``module_meta`` computed once, as ZeroLowLevelStrategy does at setup: computed at each save
    it would wait for the step's overlapped parameter gathers (``state.module_meta``)."""

    def tree(self, for_load: bool = False) -> dict[str, Any]:
        """The tree a save writes or a load fills, as the strategy builds it."""
        return engine_tree.zero_state_dict(self.engine, self.model, for_load=for_load, meta=self.meta)

    def forward_backward(self) -> None:
        self.model(self.batch).square().mean().backward()
        self.engine.ensure_flushed()

    def optimizer_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()


def build_trainer(settings: Settings, rank: int, shard_group_size: int | None = None) -> Trainer:
    model = build_model(model_width(settings.size_mb), settings.seed)
    engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters(), lr=1e-4)],
                        ZeroConfig(stage=2, shard_group_size=shard_group_size))
    generator = torch.Generator().manual_seed(settings.seed + 1 + rank)
    batch = torch.randn(settings.batch, model_width(settings.size_mb), generator=generator)
    return Trainer(model, engine, engine.optimizers[0], batch, engine_tree.module_meta(model))


# ---- tree helpers ---------------------------------------------------------------------------


def local_tensors(tree: Any) -> list[Tensor]:
    return [leaf.local if isinstance(leaf, FlatShard) else leaf for _, leaf in walk(tree) if is_tensor_leaf(leaf)]


def tree_bytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in local_tensors(tree))


def digest(t: Tensor) -> str:
    return hashlib.sha1(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def tree_digests(tree: Any) -> dict[str, str]:
    """SHA-1 of every tensor leaf's local bytes, keyed by path."""
    return {"/".join(path): digest(leaf.local if isinstance(leaf, FlatShard) else leaf)
            for path, leaf in walk(tree) if is_tensor_leaf(leaf)}


def gather_to_rank0(shard: FlatShard) -> Tensor | None:
    """The full tensor on rank 0 (what ZeroLowLevelStrategy hands a plain CheckpointIO)."""
    layout = shard.layout
    padded = torch.zeros(layout.chunk, dtype=shard.local.dtype)
    padded[: shard.local.numel()] = shard.local
    gathered = [torch.empty_like(padded) for _ in range(shard.world_size)] if shard.rank == 0 else None
    dist.gather(padded, gathered, dst=0)
    return torch.cat(gathered)[: layout.numel].reshape(shard.shape) if gathered is not None else None


def lightning_full_checkpoint(trainer: Trainer) -> dict[str, Any]:
    """Lightning's checkpoint layout with full tensors, gathered to rank 0 (None elsewhere)."""
    tree = {
        "epoch": 0,
        "global_step": 1,
        "state_dict": trainer.tree()["model"],
        "optimizer_states": engine_tree.full_optimizer_states(trainer.engine),
    }
    return map_leaves(tree, lambda leaf: gather_to_rank0(leaf) if isinstance(leaf, FlatShard) else leaf)


def per_rank_state(tree: Any, rank: int) -> dict[str, Tensor]:
    """The tree's tensors for DCP as plain tensors under per-rank keys (DCP would keep only one
    copy of a plain tensor saved under the same key by every rank).

    Not as DTensors: in torch 2.13 both DCP stagers fail ("Attempted to call copy_() on an invalid
    python storage") on a DTensor whose local tensor has a storage offset, and every master shard is
    a view into its bucket's flat buffer (BENCHMARKS.md, Checkpoints)."""
    return {f"rank{rank}/" + "/".join(path): (leaf.local if isinstance(leaf, FlatShard) else leaf).detach()
            for path, leaf in walk(tree) if is_tensor_leaf(leaf)}


# ---- the world-size-2 run -------------------------------------------------------------------


@dataclass
class Ctx:
    settings: Settings
    rank: int
    world_size: int
    trainer: Trainer
    dcp_group: Any
    raw_chunk: memoryview
    rank_bytes: int
    records: dict[str, list[list[dict[str, float]]]] = field(default_factory=dict)
    """phase -> one entry per repeat -> one dict per rank."""

    def barrier(self) -> None:
        dist.barrier()

    def record(self, phase: str, values: dict[str, float]) -> None:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, values)
        self.records.setdefault(phase, []).append(gathered)

    def path(self, repeat: int, label: str) -> str:
        return os.path.join(self.settings.root, f"r{repeat}-{label}", "ckpt")

    def cleanup(self, repeat: int, label: str) -> None:
        """Delete a checkpoint outside any timed region, then line the ranks up again."""
        self.barrier()
        if self.rank == 0:
            shutil.rmtree(os.path.dirname(self.path(repeat, label)), ignore_errors=True)
        self.barrier()


RAW_KINDS = ("raw_single", "raw_per_rank", "raw_per_rank_writeback")


def measure_raw_disk(ctx: Ctx, first: bool) -> None:
    """The disk's sequential write + fsync rate, three ways: rank 0 writes one file of the whole
    checkpoint's size; every rank writes its share at once (as the checkpoint writers do); and the
    same with the writers' early writeback ([Note: early writeback]), the disk's best sequential
    rate. Each file is deleted before the next write, as the checkpoint phases delete theirs. Twice
    per repeat, in alternating order: on this VM the page-cache copy that dominates a write varies 3x
    from one write to the next, so raw needs as many samples as the writes it is compared with."""
    for kind in RAW_KINDS if first else RAW_KINDS[::-1]:
        writes = ctx.rank == 0 or kind != "raw_single"
        nbytes = ctx.rank_bytes * ctx.world_size if kind == "raw_single" else ctx.rank_bytes
        path = os.path.join(ctx.settings.root, f"{kind}-rank{ctx.rank}.bin")
        ctx.barrier()
        if writes:
            start, end = write_raw(path, nbytes, ctx.raw_chunk, writeback=kind == "raw_per_rank_writeback")
        ctx.record(kind, {"start": start, "end": end, "bytes": nbytes} if writes else {})
        if writes:
            os.unlink(path)
    ctx.barrier()


def measure_clone(ctx: Ctx) -> None:
    tree = ctx.trainer.tree()
    tensors = local_tensors(tree)
    ctx.barrier()
    start = now()
    copies = [t.clone() for t in tensors]
    end = now()
    del copies
    ctx.record("clone", {"block": end - start})


def measure_async(ctx: Ctx, repeat: int, mode: str) -> None:
    """Save call, then wait for staging and commit at once (the training thread idles)."""
    path = ctx.path(repeat, f"async-{mode}")
    ctx.barrier()
    start = now()
    tree = ctx.trainer.tree()  # as the strategy does
    async_save(tree, path, mode=mode)
    returned = now()
    wait_for_staging()
    staged = now()
    maybe_finalize_async_calls(blocking=True)
    committed = now()
    ctx.record(f"async_{mode}", {"block": returned - start, "staging": staged - returned, "staged_at": staged,
                                 "committed_at": committed, "after_call": committed - returned})
    ctx.cleanup(repeat, f"async-{mode}")


def measure_sync(ctx: Ctx, repeat: int, mode: str) -> None:
    path = ctx.path(repeat, f"sync-{mode}")
    ctx.barrier()
    start = now()
    save(ctx.trainer.tree(), path, mode=mode)
    ctx.record(f"sync_{mode}", {"block": now() - start})
    ctx.cleanup(repeat, f"sync-{mode}")


def measure_idle_step(ctx: Ctx) -> None:
    ctx.barrier()
    start = now()
    ctx.trainer.forward_backward()
    middle = now()
    ctx.trainer.optimizer_step()
    ctx.record("idle_step", {"forward_backward": middle - start, "step": now() - start})


def measure_overlap(ctx: Ctx, repeat: int, mode: str, keep: bool) -> dict[str, str] | None:
    """Save call, a real forward/backward, ``wait_for_staging`` where the optimizer step would call
    it, the step, then more training steps while the write is in flight. With ``keep`` the
    checkpoint stays for the load measurements; returns the digests of what it must contain."""
    label = f"overlap-{mode}"
    path = ctx.path(repeat, label)
    expected = tree_digests(ctx.trainer.tree()) if keep else None
    ctx.barrier()
    start = now()
    async_save(ctx.trainer.tree(), path, mode=mode)
    returned = now()
    ctx.trainer.forward_backward()
    backward_done = now()
    wait_for_staging()
    staged = now()
    ctx.trainer.optimizer_step()  # mutates the masters and moments the save holds
    stepped = now()
    during: list[float] = []
    for _ in range(MAX_STEPS_DURING_WRITE):
        # Every rank must run the same number of steps (backward has collectives): go on while
        # any rank's write is still in flight.
        done = torch.tensor([int(maybe_finalize_async_calls(blocking=False))])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item():
            break
        step_start = now()
        ctx.trainer.forward_backward()
        ctx.trainer.optimizer_step()
        during.append(now() - step_start)
    maybe_finalize_async_calls(blocking=True)
    ctx.record(label, {"block": returned - start, "forward_backward": backward_done - returned,
                       "wait": staged - backward_done, "step": stepped - staged, "whole_step": stepped - start,
                       "steps_during_write": float(len(during)),
                       "step_during_write": statistics.median(during) if during else float("nan"),
                       "committed": now() - start})
    if not keep:
        ctx.cleanup(repeat, label)
    return expected


def measure_lightning_async_io(ctx: Ctx, repeat: int, io: Any) -> None:
    path = ctx.path(repeat, "lightning")
    ctx.barrier()
    start = now()
    full = lightning_full_checkpoint(ctx.trainer)
    gathered = now()
    values: dict[str, float] = {"gather": gathered - start}
    if ctx.rank == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        call = now()
        io.save_checkpoint(full, path)
        returned = now()
        io.teardown()  # the only way AsyncCheckpointIO offers to wait for its write
        values.update(block=returned - call, after_call=now() - returned,
                      bytes=float(tree_bytes(full)))
    del full
    ctx.record("lightning_async_io", values)
    ctx.cleanup(repeat, "lightning")


def measure_dcp(ctx: Ctx, repeat: int, async_staging: bool) -> None:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    label = "dcp-async-staging" if async_staging else "dcp"
    path = ctx.path(repeat, label)
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=True, use_non_blocking_copy=False)) if async_staging else None
    ctx.barrier()
    start = now()
    state = per_rank_state(ctx.trainer.tree(), ctx.rank)
    response = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True),
                              process_group=ctx.dcp_group, async_stager=stager)
    returned = now()
    if async_staging:
        response.staging_completion.result()
        staged = now()
        response.upload_completion.result()
    else:
        staged = returned  # FileSystemWriter stages inside async_save, on the calling thread
        response.result()
    committed = now()
    if stager is not None:
        stager.close()
    ctx.record(label.replace("-", "_"), {"block": returned - start, "staging": staged - returned,
                                         "staged_at": staged, "committed_at": committed,
                                         "after_call": committed - returned})
    ctx.cleanup(repeat, label)


def measure_load(ctx: Ctx, path: str, label: str) -> dict[str, str]:
    ctx.barrier()
    if ctx.rank == 0:
        drop_page_cache(os.path.dirname(path))
    ctx.barrier()
    start = now()
    tree = ctx.trainer.tree(for_load=True)
    load(tree, path)
    ctx.record(label, {"load": now() - start})
    return tree_digests(tree)


def world_run(rank: int, world_size: int, settings: Settings) -> dict[str, Any]:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    trainer = build_trainer(settings, rank)
    set_up_coordination()  # as ZeroLowLevelStrategy.setup: the coordination group and the device mesh
    trainer.forward_backward()
    trainer.optimizer_step()  # AdamW builds its moments on the first step
    tree = trainer.tree()
    ctx = Ctx(settings, rank, world_size, trainer, dist.new_group(backend="gloo"),
              memoryview(os.urandom(RAW_WRITE_CHUNK)), tree_bytes(tree))
    del tree
    io = AsyncCheckpointIO(TorchCheckpointIO())
    log = print if rank == 0 else (lambda *a, **k: None)

    # Warm-up, not recorded: process groups, DCP imports and planners, first-touch of the
    # staging memory (a VM maps fresh pages slowly the first time).
    for mode in ("local", "sharded"):
        async_save(trainer.tree(), ctx.path(-1, mode), mode=mode)
        maybe_finalize_async_calls(blocking=True)
        ctx.cleanup(-1, mode)
    measure_dcp(ctx, -1, async_staging=False)
    measure_idle_step(ctx)
    ctx.records.clear()

    expected: dict[str, dict[str, str]] = {}
    for repeat in range(settings.repeats):
        t = now()
        measure_raw_disk(ctx, first=True)
        measure_clone(ctx)
        measure_idle_step(ctx)
        last = repeat == settings.repeats - 1
        # Alternate which mode goes first, so neither always meets the fresher page cache.
        modes = ("local", "sharded") if repeat % 2 == 0 else ("sharded", "local")
        for mode in modes:
            measure_async(ctx, repeat, mode)
        for mode in modes:
            measure_sync(ctx, repeat, mode)
        measure_lightning_async_io(ctx, repeat, io)
        measure_dcp(ctx, repeat, async_staging=False)
        measure_dcp(ctx, repeat, async_staging=True)
        measure_clone(ctx)
        measure_raw_disk(ctx, first=False)
        for mode in modes:
            digests = measure_overlap(ctx, repeat, mode, keep=last)
            if digests is not None:
                expected[mode] = digests
        log(f"  repeat {repeat + 1}/{settings.repeats}: {now() - t:.1f} s", flush=True)

    last = settings.repeats - 1
    loaded_ok = {}
    for repeat in range(settings.repeats):
        for mode in ("sharded", "local") if repeat % 2 == 0 else ("local", "sharded"):
            loaded = measure_load(ctx, ctx.path(last, f"overlap-{mode}"), f"load_{mode}")
            loaded_ok[mode] = loaded_ok.get(mode, True) and loaded == expected[mode]
    gathered_ok: list[Any] = [None] * world_size
    dist.all_gather_object(gathered_ok, loaded_ok)
    gathered_expected: list[Any] = [None] * world_size
    dist.all_gather_object(gathered_expected, expected["sharded"])
    return {"records": ctx.records, "rank_bytes": ctx.rank_bytes, "loaded_ok": gathered_ok,
            "expected_sharded": gathered_expected, "sharded_path": ctx.path(last, "overlap-sharded"),
            "peak_rss": max_over_ranks(peak_rss_bytes())}


# ---- the cost of the checksums (--integrity) ---------------------------------------------------


def integrity_run(rank: int, world_size: int, settings: Settings) -> dict[str, Any]:
    """Synchronous save, then load (page cache dropped), of the same state in every mode, with the
    CRC32 checksums (lightning_zero.checkpoint.formats.integrity) and without them, interleaved."""
    from lightning_zero.checkpoint.formats import integrity

    trainer = build_trainer(settings, rank)
    set_up_coordination()
    trainer.forward_backward()
    trainer.optimizer_step()
    tree = trainer.tree()
    ctx = Ctx(settings, rank, world_size, trainer, None, memoryview(b""), tree_bytes(tree))
    del tree
    for repeat in range(-1, settings.repeats):  # -1: warm-up, not recorded
        modes = MODES_ALL if repeat % 2 == 0 else MODES_ALL[::-1]
        for mode in modes:
            for checked in (True, False) if repeat % 2 == 0 else (False, True):
                label = f"{mode}-{'crc' if checked else 'nocrc'}"
                path = ctx.path(repeat, label)
                guard = contextlib.nullcontext() if checked else integrity.checksums_disabled()
                with guard:
                    ctx.barrier()
                    start = now()
                    save(trainer.tree(), path, mode=mode)
                    saved = now() - start
                    ctx.barrier()
                    if rank == 0:
                        drop_page_cache(os.path.dirname(path))
                    ctx.barrier()
                    start = now()
                    load(trainer.tree(for_load=True), path)
                    loaded = now() - start
                if repeat >= 0:
                    ctx.record(f"integrity_{label}", {"save": saved, "load": loaded})
                ctx.cleanup(repeat, label)
    sample = torch.randn(64 * MIB // 4)
    start = now()
    integrity.crc32_of(sample)
    crc_rate = sample.numel() * 4 / (now() - start)
    return {"records": ctx.records, "rank_bytes": ctx.rank_bytes, "crc_rate": crc_rate}


MODES_ALL = ("local", "sharded", "full")


def build_integrity_report(settings: Settings, result: dict[str, Any], command: str, elapsed: float,
                           machine: str) -> str:
    total = result["rank_bytes"] * settings.world_size
    lines = [
        "# Checkpoint integrity: the cost of the CRC32 checksums", "",
        f"Command: `{command}` ({elapsed:.0f} s). {machine}", "",
        f"{total / MIB:.0f} MiB of state over {settings.world_size} gloo ranks; synchronous `save` then `load` of"
        f" the same state (page cache dropped before each load), median of {settings.repeats} interleaved"
        " repeats, slowest rank. Rate = all ranks' bytes / time. `zlib.crc32` alone:"
        f" {result['crc_rate'] / MB:.0f} MB/s on one core.", "",
        "| mode | save MB/s with | save MB/s without | save cost | load MB/s with | load MB/s without | load cost |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode in MODES_ALL:
        rates = {}
        for checked in ("crc", "nocrc"):
            records = result["records"][f"integrity_{mode}-{checked}"]
            rates[checked] = {key: total / median(slowest(records, key)) / MB for key in ("save", "load")}
        cost = {key: rates["nocrc"][key] / rates["crc"][key] - 1 for key in ("save", "load")}
        lines.append(f"| {mode} | {rates['crc']['save']:.0f} | {rates['nocrc']['save']:.0f} | {cost['save']:+.0%} |"
                     f" {rates['crc']['load']:.0f} | {rates['nocrc']['load']:.0f} | {cost['load']:+.0%} |")
    lines += ["", "Cost = how much longer the operation takes with checksums (+10% = 1.1x the time)."]
    return "\n".join(lines) + "\n"


# ---- the resharding loads -------------------------------------------------------------------


def reshard_run(rank: int, world_size: int, settings: Settings, path: str,
                expected: list[dict[str, str]]) -> dict[str, Any]:
    """Load the 2-rank ``sharded`` checkpoint at another world size and check every byte; as a
    control, save the same state at this world size and load that (no resharding)."""
    trainer = build_trainer(settings, rank)
    set_up_coordination()
    for opt in trainer.engine.optimizers:
        engine_tree.materialize_optimizer_state(opt, {sp.fqn for sp in opt.sharded_params})
    tree = trainer.tree(for_load=True)
    load(tree, path)
    matches = matches_saved_shards(tree, expected)
    control = os.path.join(settings.root, f"control-{world_size}", "ckpt")
    save(trainer.tree(), control, mode="sharded")
    times: dict[str, list[float]] = {"reshard": [], "control": []}
    for repeat in range(settings.repeats):
        order = ("reshard", "control") if repeat % 2 == 0 else ("control", "reshard")
        for which in order:
            source = path if which == "reshard" else control
            dist.barrier()
            if rank == 0:
                drop_page_cache(os.path.dirname(source))
            dist.barrier()
            start = now()
            load(trainer.tree(for_load=True), source)
            times[which].append(max_over_ranks(now() - start))
    return {**times, "matches": matches, "peak_rss": max_over_ranks(peak_rss_bytes())}


def matches_saved_shards(tree: Any, expected: list[dict[str, str]]) -> bool:
    """(collective) Whether the loaded tensors equal, byte for byte, what the saving ranks held:
    every loaded shard is gathered to rank 0, which cuts the full tensor at the saving world
    size's shard boundaries and compares digests. The answer is rank 0's."""
    from lightning_zero.engine.sharding import EvenShard

    saved_ws = len(expected)
    ok = True
    for path, leaf in walk(tree):
        key = "/".join(path)
        if isinstance(leaf, FlatShard):
            full = gather_to_rank0(leaf)
            if full is not None:
                saved = EvenShard(leaf.numel, saved_ws)
                flat = full.reshape(-1)
                ok &= all(digest(flat[saved.start(r): saved.end(r)]) == expected[r][key] for r in range(saved_ws))
        elif isinstance(leaf, Tensor):
            ok &= digest(leaf) == expected[0][key]
    return ok


def build_report(settings: Settings, result: dict[str, Any], reshard: dict[int, dict[str, Any]], command: str,
                 elapsed: float, machine: str) -> str:
    rec = result["records"]
    total = result["rank_bytes"] * settings.world_size
    width = model_width(settings.size_mb)
    n_params = sum(p.numel() for p in build_model(width, 0).parameters())

    def med(phase: str, key: str) -> float:
        return median(slowest(rec[phase], key))

    def mbps(bytes_per_s: float) -> str:
        return f"{bytes_per_s / MB:,.0f}"

    clone = med("clone", "block")
    raw_single_runs = raw_throughput(rec["raw_single"])
    raw_ranks_runs = raw_throughput(rec["raw_per_rank"])
    raw_single, raw_ranks = median(raw_single_runs), median(raw_ranks_runs)
    raw = max(raw_single, raw_ranks)  # the stricter denominator
    raw_writeback_runs = raw_throughput(rec["raw_per_rank_writeback"])
    raw_writeback = median(raw_writeback_runs)

    save_rows = []
    for label, phase in (
        ('lightning_zero `async_save(mode="local")`', "async_local"),
        ('lightning_zero `async_save(mode="sharded")`', "async_sharded"),
        ("DCP `async_save` (FileSystemWriter stages on the caller)", "dcp"),
        ("DCP `async_save` + `DefaultStager(use_async_staging=True)`", "dcp_async_staging"),
    ):
        tput = throughput(rec[phase], total)
        save_rows.append(f"| {label} | {ms(med(phase, 'block'))} | {runs(slowest(rec[phase], 'block'))} |"
                         f" {ms(med(phase, 'staging'))} | {med(phase, 'after_call'):.2f} | {mbps(median(tput))}"
                         f" ({runs(tput, 1 / MB)}) | {median(tput) / raw:.0%} |")
    lio = [ranks[0] for ranks in rec["lightning_async_io"]]
    lio_write = [r["bytes"] / r["after_call"] for r in lio]
    save_rows.append(
        f"| Lightning `AsyncCheckpointIO(TorchCheckpointIO())` on rank 0, one full file, after a"
        f" {ms(med('lightning_async_io', 'gather'))} ms gather to rank 0 | {ms(median([r['block'] for r in lio]))} |"
        f" {runs([r['block'] for r in lio])} | (clones in the call) | {median([r['after_call'] for r in lio]):.2f} |"
        f" {mbps(median(lio_write))} ({runs(lio_write, 1 / MB)}), no fsync | {median(lio_write) / raw:.0%} |")
    for mode in ("local", "sharded"):
        phase = f"sync_{mode}"
        save_rows.append(f'| lightning_zero `save(mode="{mode}")`, synchronous | {ms(med(phase, "block"))} |'
                         f" {runs(slowest(rec[phase], 'block'))} | | | {mbps(total / med(phase, 'block'))}"
                         " (whole save) | |")
    save_rows += [
        f"| in-memory clone of every tensor of the tree (the floor; 2 per repeat) | {ms(clone)} |"
        f" {runs(slowest(rec['clone'], 'block'))} | | | {mbps(total / clone)} (memory) | |",
        f"| raw disk: one {total / MB:,.0f} MB file, 64 MiB writes + fsync (2 per repeat) | | | | |"
        f" {mbps(raw_single)} ({runs(raw_single_runs, 1 / MB)}) | {raw_single / raw:.0%} |",
        "| raw disk: one file per rank, both at once, 64 MiB writes + fsync (2 per repeat) | | | | |"
        f" {mbps(raw_ranks)} ({runs(raw_ranks_runs, 1 / MB)}) | {raw_ranks / raw:.0%} |",
        "| raw disk: the same with early writeback, as the checkpoint writers do (2 per repeat) | | | | |"
        f" {mbps(raw_writeback)} ({runs(raw_writeback_runs, 1 / MB)}) | {raw_writeback / raw:.0%} |",
    ]

    idle_fb, idle_step = med("idle_step", "forward_backward"), med("idle_step", "step")
    overlap_rows = []
    for mode in ("local", "sharded"):
        phase = f"overlap-{mode}"
        stall = [max(x["block"] + x["wait"] for x in ranks) for ranks in rec[phase]]
        during = [v for v in slowest(rec[phase], "step_during_write") if not math.isnan(v)]
        steps = sum(int(ranks[0]["steps_during_write"]) for ranks in rec[phase])
        overlap_rows.append(
            f"| {mode} | {ms(med(phase, 'block'))} | {ms(med(phase, 'forward_backward'))} | {ms(idle_fb)} |"
            f" **{ms(med(phase, 'wait'))}** ({runs(slowest(rec[phase], 'wait'))}) | {ms(median(stall))} |"
            f" {ms(med(phase, 'whole_step'))} | {ms(idle_step)} |"
            f" {f'{ms(median(during))} ({steps} steps)' if during else 'none: the write ended first'} |"
            f" {med(phase, 'committed'):.2f} |")

    def ok(flag: bool) -> str:
        return "yes" if flag else "**NO**"

    load_same = med("load_sharded", "load")
    load_rows = [
        f"| `sharded`, saved at 2, loaded at 2 | 2 | {load_same:.2f} | {runs(slowest(rec['load_sharded'], 'load'), 1)} |"
        f" {mbps(total / load_same)} | {ok(all(o['sharded'] for o in result['loaded_ok']))} |",
        f"| `local`, saved at 2, loaded at 2 | 2 | {med('load_local', 'load'):.2f} |"
        f" {runs(slowest(rec['load_local'], 'load'), 1)} | {mbps(total / med('load_local', 'load'))} |"
        f" {ok(all(o['local'] for o in result['loaded_ok']))} |",
    ]
    for ws, res in sorted(reshard.items()):
        t, c = median(res["reshard"]), median(res["control"])
        load_rows += [
            f"| `sharded`, saved at 2, loaded at {ws} (reshard) | {ws} | {t:.2f} | {runs(res['reshard'], 1)} |"
            f" {mbps(total / t)} | {ok(res['matches'])} |",
            f"| `sharded`, saved at {ws}, loaded at {ws} (control: no reshard) | {ws} | {c:.2f} |"
            f" {runs(res['control'], 1)} | {mbps(total / c)} | |",
        ]

    checks, stall_checks, control_checks = [], [], []
    sync = {m: med(f"sync_{m}", "block") for m in ("local", "sharded")}
    for mode in ("local", "sharded"):
        block = med(f"async_{mode}", "block")
        checks += [
            Check(f"async `{mode}` save call vs in-memory clone", block / clone, MAX_BLOCK_VS_COPY, True,
                  f"{ms(block)} ms vs {ms(clone)} ms"),
            Check(f"async `{mode}` save call vs synchronous `{mode}` save", block / sync[mode], MAX_BLOCK_VS_SYNC,
                  True, f"{ms(block)} ms vs {ms(sync[mode])} ms"),
        ]
        stall = median([max(x["block"] + x["wait"] for x in ranks) for ranks in rec[f"overlap-{mode}"]])
        stall_checks += [
            Check(f"`{mode}`: save call + next optimizer step's wait vs in-memory clone", stall / clone,
                  MAX_BLOCK_VS_COPY, True, f"{ms(stall)} ms vs {ms(clone)} ms"),
            Check(f"`{mode}`: save call + next optimizer step's wait vs synchronous save", stall / sync[mode],
                  MAX_BLOCK_VS_SYNC, True, f"{ms(stall)} ms vs {ms(sync[mode])} ms"),
        ]
    for mode in ("local", "sharded"):
        tput = median(throughput(rec[f"async_{mode}"], total))
        checks.append(Check(f"async `{mode}` background write vs raw disk", tput / raw, MIN_WRITE_VS_RAW, False,
                            f"{mbps(tput)} vs {mbps(raw)} MB/s, the better of the two plain raw medians"))
        control_checks.append(Check(f"async `{mode}` background write vs raw disk with early writeback",
                                    tput / raw_writeback, MIN_WRITE_VS_RAW, False,
                                    f"{mbps(tput)} vs {mbps(raw_writeback)} MB/s"))
    for ws, res in sorted(reshard.items()):
        t, c = median(res["reshard"]), median(res["control"])
        checks.append(Check(f"`sharded` load resharded 2 -> {ws} vs the same checkpoint loaded at 2", t / load_same,
                            MAX_RESHARD_VS_SAME, True, f"{t:.2f} s vs {load_same:.2f} s"))
        control_checks.append(Check(f"`sharded` load resharded 2 -> {ws} vs saved and loaded at {ws}", t / c,
                                    MAX_RESHARD_VS_SAME, True, f"{t:.2f} s vs {c:.2f} s"))
    peak = max([result["peak_rss"], *(r["peak_rss"] for r in reshard.values())])

    lines = [
        f"Command: `{command}`  ",
        f"Machine: {machine}  ",
        f"State: **{total / MB:,.1f} MB** ({total / MIB:,.1f} MiB) of tensors over 2 ranks"
        f" ({result['rank_bytes'] / MB:,.1f} MB per rank): an MLP of {BLOCKS} blocks (LayerNorm, Linear"
        f" {width}->{4 * width}, GELU, Linear {4 * width}->{width}), {n_params / 1e6:.2f}M fp32 parameters,"
        " `ZeroEngine` stage 2, AdamW after one step. The saved tree is `zero_state_dict(engine, model)`:"
        " fp32 master shards, `exp_avg`, `exp_avg_sq` (+ AdamW's `step` scalars and param groups).  ",
        f"Timing: {settings.repeats} interleaved repeats; every value is the slowest rank's (training waits"
        " for it); tables give the median, the single runs follow in brackets in run order. One torch thread"
        f" per rank. Whole run {elapsed:.0f} s; peak RSS of one process {peak / 2**30:.1f} GiB.",
        "",
        "**Save.** *call blocks*: time from the save call until it returns to the training loop (tree"
        " building included, as `ZeroLowLevelStrategy.save_checkpoint` does it). *write MB/s*: all ranks'"
        " bytes / (last rank's commit - last rank's end of staging), with the training thread idle.",
        "",
        "| save | call blocks (ms) | runs (ms) | staging after the call (ms) | call return -> committed (s) |"
        " write MB/s (runs) | of raw |",
        "| --- | ---: | --- | ---: | ---: | --- | ---: |",
        *save_rows,
        "",
        "**Save overlapped with training.** After the save call: forward + backward of the engine's model,"
        " `wait_for_staging()` where the optimizer step calls it, the optimizer step (which mutates the"
        " saved tensors), then more training steps while the write is still in flight.",
        "",
        "| mode | save call (ms) | forward + backward with the save in flight (ms) | idle (ms) |"
        " **next optimizer step waited** (ms) (runs) | call + wait (ms) | whole step incl. the save (ms) |"
        " idle step (ms) | later steps during the write (ms) | call -> committed (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
        *overlap_rows,
        "",
        "**Load** of the checkpoints written in the overlapped runs, page cache of the checkpoint dropped"
        " first (`posix_fadvise(DONTNEED)`; the VM's host may still cache); tree building + `load()`:",
        "",
        "| load | ranks | s | runs (s) | MB/s | every byte equals the state at save time |",
        "| --- | ---: | ---: | --- | ---: | --- |",
        *load_rows,
        "",
        "Targets:",
        "",
        *[c.line() for c in checks],
        "",
        "The save call returns before staging, so the training thread's stall is really the call plus the"
        " wait in the next optimizer step; the same targets on that:",
        "",
        *[c.line() for c in stall_checks],
        "",
        "Controls: the write targets against the raw rate with early writeback (the stricter"
        " denominator, since the writers use it), and the reshard target against the same number of"
        " loading processes without resharding:",
        "",
        *[c.line() for c in control_checks],
        "",
    ]
    return "\n".join(lines)


# ---- main -----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=None, help="MiB of checkpointed state over both ranks (512)")
    parser.add_argument("--quick", action="store_true", help="64 MiB, 3 repeats, reshard to 1 rank only")
    parser.add_argument("--repeats", type=int, default=None, help="repeats of every measurement (5; --quick: 3)")
    parser.add_argument("--reshard-world-sizes", type=int, nargs="+", default=None,
                        help="world sizes that load the 2-rank checkpoint (default: 1 3; --quick: 1)")
    parser.add_argument("--dir", default="/tmp", help="parent of the checkpoint directory (default /tmp)")
    parser.add_argument("--out", type=Path, default=None,
                        help="report file (default bench/out/checkpoint.md; --integrity: checkpoint-integrity.md)")
    parser.add_argument("--hybrid", action="store_true",
                        help="only: sharded saves of a 2 x 2 hybrid engine (shard_group_size=2) and a flat one at"
                             " 4 ranks: bytes per rank and write rate (64 MiB, 3 repeats)")
    parser.add_argument("--peers", action="store_true",
                        help="only: our sharded async save beside DeepSpeed ZeRO-2's save_checkpoint (64 MiB, 3 repeats;"
                             " DeepSpeed from make bench-peers, see bench/checkpoint_peers.py)")
    parser.add_argument("--tiered", action="store_true",
                        help="only: a tiered save (local tier + replica + S3) beside sharded saves to S3 and a local path")
    parser.add_argument("--tier-dir", default=None,
                        help="with --tiered: parent of the local tier's directories (default /dev/shm)")
    parser.add_argument("--integrity", action="store_true",
                        help="only the cost of the checksums: save/load rate with and without (128 MiB, 3 repeats)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.tiered:
        from tiered_checkpoint import main_tiered

        main_tiered(args, argv, Settings)
        return
    if args.integrity:
        main_integrity(args, argv)
        return
    if args.hybrid:
        main_hybrid(args, argv)
        return
    if args.peers:
        from checkpoint_peers import main_peers

        main_peers(args, argv)
        return
    args.out = args.out or OUT_DIR / "checkpoint.md"
    size_mb = args.size_mb or (64 if args.quick else 512)
    reshard = tuple(args.reshard_world_sizes or ((1,) if args.quick else (1, 3)))
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 5)
    if size_mb < 1 or repeats < 1 or any(ws < 1 or ws == 2 for ws in reshard):
        raise ValueError(f"--size-mb and --repeats must be >= 1 and --reshard-world-sizes must not hold 2 (the"
                         f" saving world size); got {size_mb}, {repeats}, {reshard}")
    command = " ".join([".venv/bin/python", "bench/checkpoint.py", *(argv if argv is not None else sys.argv[1:])])
    os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="lz-ckpt-bench-", dir=args.dir)
    settings = Settings(size_mb=size_mb, repeats=repeats, root=root, reshard_world_sizes=reshard)
    machine = describe_machine(root)
    start, busy_start, own_start = now(), busy_cpu_seconds(), own_cpu_seconds()
    try:
        print(f"world size 2: {size_mb} MiB of state, {settings.repeats} repeats, checkpoints under {root}", flush=True)
        result = run_world(world_run, settings.world_size, settings)
        resharded = {}
        for ws in reshard:
            print(f"loading the 2-rank checkpoint at world size {ws}", flush=True)
            resharded[ws] = run_world(reshard_run, ws, settings, result["sharded_path"], result["expected_sharded"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    elapsed = now() - start
    others = max(0.0, (busy_cpu_seconds() - busy_start) - (own_cpu_seconds() - own_start))
    machine += (f" Other processes used {others:.0f} CPU-s during the run ({others / elapsed:.2f} of"
                f" {len(os.sched_getaffinity(0))} cores on average); load average at the end"
                f" {', '.join(f'{x:.1f}' for x in os.getloadavg())}.")
    text = build_report(settings, result, resharded, command, elapsed, machine)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


HYBRID_LAYOUTS = {"2 x 2 (shard_group_size=2)": 2, "flat (shard_group_size=None)": None}
HYBRID_WORLD_SIZE = 4


def hybrid_run(rank: int, world_size: int, settings: Settings) -> dict[str, Any]:
    """Per layout: ``repeats`` synchronous ``sharded`` saves after one step; this rank's bytes and write seconds."""
    from lightning_zero.checkpoint import last_save_stats, save

    out: dict[str, Any] = {}
    for label, size in HYBRID_LAYOUTS.items():
        trainer = build_trainer(settings, rank, shard_group_size=size)
        trainer.forward_backward()
        trainer.optimizer_step()
        trainer.engine.finish_param_gather()
        tree = trainer.tree()
        runs = []
        for repeat in range(settings.repeats):
            path = os.path.join(settings.root, f"hybrid-{size}-{repeat}", "ckpt")
            save(tree, path, mode="sharded")
            stats = last_save_stats()
            assert stats is not None
            runs.append((stats.bytes_written, stats.write_s))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        out[label] = {"runs": runs, "state_bytes": tree_bytes(tree)}
        trainer.engine.close()
    everyone: list[Any] = [None] * world_size  # run_world hands back rank 0's result only
    dist.all_gather_object(everyone, out)
    return everyone


def run_variant(args: argparse.Namespace, name: str, run: Callable[..., Any], size_mb: int,
                world_size: int = 2) -> tuple[Any, Settings, str, float]:
    """One ``--<name>`` variant's world over fresh files: (result, settings, machine, seconds)."""
    start = now()
    with scratch_root(args.dir, name) as root:
        settings = Settings(size_mb=args.size_mb or size_mb, repeats=args.repeats or 3, root=root,
                            reshard_world_sizes=(), world_size=world_size)
        machine = describe_machine(root)
        result = run_world(run, world_size, settings)
    return result, settings, machine, now() - start


def main_hybrid(args: argparse.Namespace, argv: Sequence[str] | None) -> None:
    command = bench_command(argv)
    ranks, settings, machine, seconds = run_variant(args, "hybrid", hybrid_run, 64, HYBRID_WORLD_SIZE)
    lines = [
        f"# Hybrid sharded save ({settings.size_mb} MiB of state, {HYBRID_WORLD_SIZE} gloo ranks,"
        f" {settings.repeats} repeats, median)", "", f"Command: `{command}` ({seconds:.0f} s). {machine}", "",
        "| layout | state held per rank MiB | written per rank MiB (min-max) | total written MiB | max/mean"
        " | write rate per rank MB/s (slowest) | aggregate MB/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label in HYBRID_LAYOUTS:
        written = [statistics.median(b for b, _ in r[label]["runs"]) for r in ranks]
        seconds = [statistics.median(t for _, t in r[label]["runs"]) for r in ranks]
        held = max(r[label]["state_bytes"] for r in ranks)
        total = sum(written)
        mean = total / len(written)
        lines.append(
            f"| {label} | {held / MIB:.1f} | {min(written) / MIB:.1f}-{max(written) / MIB:.1f} | {total / MIB:.1f}"
            f" | {max(written) / mean:.3f} | {min(w / t for w, t in zip(written, seconds)) / 1e6:.0f}"
            f" | {total / max(seconds) / 1e6:.0f} |")
    lines += ["", "Each rank of the 2 x 2 run holds half the state (two replica groups hold a copy each); the"
              " sharded save writes each shard once, spread over the replica groups, so the total equals one"
              " copy, as in the flat run. Write rate: this rank's bytes over DCP's write phase (SaveStats.write_s)."]
    text = "\n".join(lines) + "\n"
    publish(text, args.out, "hybrid")


def main_integrity(args: argparse.Namespace, argv: Sequence[str] | None) -> None:
    result, settings, machine, seconds = run_variant(args, "integrity", integrity_run, 128)
    publish(build_integrity_report(settings, result, bench_command(argv), seconds, machine), args.out, "integrity")

if __name__ == "__main__":
    main()
