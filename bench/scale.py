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
optimizer over the full parameters), median of the timed steps, one thread.

Not simulated: the save/load planning of a ``sharded`` checkpoint. DCP's planner gathers every
rank's plan to the coordinator; with the fake group this rank would see only its own plan, so the
coordinator's cost (the part that grows with world size) cannot be measured this way.

Usage::

    .venv/bin/python bench/scale.py                   # world sizes 8 64 512 1024, 8 and 32 blocks
    .venv/bin/python bench/scale.py --quick           # 2 timed steps, world sizes 8 and 1024

The markdown report goes to stdout and to ``bench/out/scale.md``.
"""

from __future__ import annotations

import argparse
import contextlib
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

from lightning_zero import _collectives as comm
from lightning_zero.engine import ZeroConfig, ZeroEngine

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
    master_bytes: int
    state_bytes: int
    grad_shard_bytes: int

    def per_rank_vs_even(self, nbytes: int, bytes_per_element: int) -> float:
        return nbytes / (self.numel * bytes_per_element / self.world_size)


def batch(step: int, vocab: int = 512) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(vocab, (1, 9), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def time_steps(model: nn.Module, engine: ZeroEngine | None, optimizer: torch.optim.Optimizer, steps: int) -> float:
    times = []
    for step in range(steps + 1):  # step 0 warms up (lazy optimizer state, pool slots)
        start = time.perf_counter()
        model(*batch(step)).backward()
        if engine is not None:
            engine.ensure_flushed()
        optimizer.step()
        if engine is not None:
            engine.finish_param_gather()
        optimizer.zero_grad()
        if step:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def simulate(world_size: int, blocks: int, steps: int, bucket_size_mb: float | None) -> ScaleResult:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rank = 0  # the busiest rank: it owns a full chunk of every tensor
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        plain = NarrowLlama(blocks)
        plain_ms = time_steps(plain, None, torch.optim.AdamW(plain.parameters(), lr=1e-3), steps)
        model = NarrowLlama(blocks)
        with filled_collectives(rank, world_size):
            engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters(), lr=1e-3)],
                                ZeroConfig(stage=2, bucket_size_mb=bucket_size_mb))
            opt = engine.optimizers[0]
            engine_ms = time_steps(model, engine, opt, steps)
        state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                          if isinstance(v, Tensor) and v.dim() > 0)
        result = ScaleResult(
            world_size=world_size, blocks=blocks, tensors=len(list(model.parameters())),
            numel=sum(p.numel() for p in model.parameters()), buckets=len(engine.buckets),
            engine_step_ms=engine_ms, plain_step_ms=plain_ms,
            master_bytes=sum(b.master_shard.numel() * b.master_shard.element_size() for b in engine.buckets),
            state_bytes=state_bytes,
            grad_shard_bytes=sum(b.grad_shard.numel() * b.grad_shard.element_size() for b in engine.buckets),
        )
        engine.close()
        return result
    finally:
        dist.destroy_process_group()


def report(results: list[ScaleResult], command: str, elapsed_s: float, bucket_size_mb: float | None) -> str:
    lines = [
        f"Command: `{command}`  ",
        f"Machine: {describe_machine().replace('backend gloo on 127.0.0.1', 'backend fake (one process)')}."
        f" Load average at the end: {load_average()}. Whole run {elapsed_s:.0f} s.  ",
        "ZeroEngine stage 2, AdamW, fp32, bucket_size_mb "
        f"{'None (scaled with the world size)' if bucket_size_mb is None else bucket_size_mb}, this process"
        " is rank 0 (the busiest: a full chunk of every tensor); batch 1 x 8 tokens, so compute is small and the engine's host work shows.",
        "",
        "| world size | blocks | tensors | parameters | buckets | engine step ms | plain PyTorch step ms "
        "| engine - plain, µs per tensor | master B/rank vs total/ws | optimizer state vs total/ws "
        "| grad shard vs total/ws | padding bound (tensors x 1 element) vs total/ws |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        extra_us = (r.engine_step_ms - r.plain_step_ms) * 1000 / r.tensors
        lines.append(
            f"| {r.world_size} | {r.blocks} | {r.tensors} | {r.numel:,} | {r.buckets} | {r.engine_step_ms:.1f} "
            f"| {r.plain_step_ms:.1f} | {extra_us:.0f} | {r.per_rank_vs_even(r.master_bytes, 4):.4f} "
            f"| {r.per_rank_vs_even(r.state_bytes, 8):.4f} | {r.per_rank_vs_even(r.grad_shard_bytes, 4):.4f} "
            f"| {1 + r.tensors / (r.numel / r.world_size):.4f} |"
        )
    lines += ["", *growth_lines(results)]
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
                over = lambda r: r.engine_step_ms - r.plain_step_ms  # noqa: E731
                out.append(f"- ws={ws}: engine overhead over plain PyTorch {over(small):.1f} ms for {small.tensors}"
                           f" tensors, {over(big):.1f} ms for {big.tensors} ({over(big) / max(over(small), 1e-9):.2f}x"
                           f" for {big.tensors / small.tensors:.2f}x the tensors).")
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 timed steps, world sizes 8 and 1024")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--blocks", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 5)")
    parser.add_argument("--bucket-size-mb", type=float, default=None, help="default: scale with the world size")
    parser.add_argument("--out", type=Path, default=OUT_DIR / "scale.md")
    args = parser.parse_args(argv)
    if args.world_sizes is None:
        args.world_sizes = [8, 1024] if args.quick else [8, 64, 512, 1024]
    if args.steps is None:
        args.steps = 2 if args.quick else 5
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
    text = report(results, command, time.perf_counter() - start, args.bucket_size_mb)
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
