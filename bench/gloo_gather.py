"""gloo's all-gather against one in-place broadcast per rank, the way the engine gathers on gloo.

[Note: gloo all-gather] in lightning_zero/engine/collectives.py says why the engine gathers parameters on gloo
by broadcasts: gloo's all-gather allocates a flat temporary of its whole output on its worker thread,
gathers into it and copies it out, and glibc keeps the freed top of that thread's malloc arena resident.
This script measures both on the same processes, for a model-sized gather (10.27M fp32 elements, the GPT
of bench/engine.py), with 25 MiB-class pool slots freed first as the engine's are:

* *ms*: one gather of every element, the median over rounds of the slowest rank, the two methods
  alternating round by round (paired);
* *kept MiB*: anonymous memory (RssAnon + RssShmem) the process holds after the gathers, above what it
  held before, after ``gc`` and ``malloc_trim``, less the output buffer itself. The broadcasts run first,
  so the all-gather's leftovers cannot be billed to them.

gloo's all-gather is called with outputs of at most 1M elements per call (4 MiB of fp32), which bounds
its flat temporary, as the engine's earlier code did; the broadcasts take each rank's whole row.

Run: ``.venv/bin/python bench/gloo_gather.py [--world-sizes 2 4 8] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from _common import describe_machine, held_bytes, load_average, release_free_memory, run_on_ranks

from lightning_zero.engine import collectives as comm

NUMEL = 10_270_000
"""Elements gathered (the parameters of bench/engine.py's GPT)."""
PIECE_NUMEL = 1 << 20
"""Output elements per call of gloo's all-gather (its flat temporary: 4 MiB of fp32)."""
MIB = 1024 * 1024


def gather_by_all_gather(rows: torch.Tensor, row: torch.Tensor) -> None:
    world_size, n = rows.shape
    step = max(1, PIECE_NUMEL // world_size)
    for start in range(0, n, step):
        end = min(n, start + step)
        dist.all_gather(list(rows[:, start:end].unbind(0)), row[start:end])


def gather_by_broadcasts(rows: torch.Tensor, row: torch.Tensor) -> None:
    comm.all_gather_by_broadcasts(rows, row, None, comm.broadcast_sources(None))


METHODS = {"broadcasts": gather_by_broadcasts, "all_gather": gather_by_all_gather}


def bench(rank: int, world_size: int, rounds: int, numel: int) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    n = numel // world_size
    row = torch.full((n,), float(rank + 1))
    rows = torch.zeros(world_size, n)  # every page touched: the output is no method's leftover
    slot = torch.empty(25 * MIB, dtype=torch.uint8)  # a pool slot, freed as between the engine's steps
    del slot
    kept: dict[str, float] = {}
    for name, gather in METHODS.items():  # broadcasts first: see the module docstring
        release_free_memory()
        before = held_bytes()
        gather(rows, row)
        release_free_memory()
        kept[name] = (held_bytes() - before) / MIB
        expected = torch.arange(1, world_size + 1, dtype=rows.dtype).unsqueeze(1).expand(world_size, n)
        assert torch.equal(rows, expected), f"{name} gathered wrong rows"
    seconds: dict[str, list[float]] = {name: [] for name in METHODS}
    for round_index in range(rounds):
        order = list(METHODS) if round_index % 2 == 0 else list(reversed(METHODS))
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            METHODS[name](rows, row)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            seconds[name].append(elapsed.item())
    kept_max = {name: torch.tensor([value]) for name, value in kept.items()}
    for value in kept_max.values():
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return {name: {"ms": statistics.median(seconds[name]) * 1000, "kept_mib": kept_max[name].item()}
            for name in METHODS}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--numel", type=int, default=NUMEL, help="elements gathered (default: the GPT's parameters)")
    args = parser.parse_args(argv)
    print(f"Machine: {describe_machine()}. Load average before: {load_average()}.")
    print(f"{args.numel:,} fp32 elements gathered per call; median of {args.rounds} paired rounds, slowest rank.\n")
    print("| world size | all-gather ms | broadcasts ms | broadcasts / all-gather | all-gather kept MiB |"
          " broadcasts kept MiB |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for world_size in args.world_sizes:
        result = run_on_ranks(bench, world_size, args.rounds, args.numel)
        gather, broadcasts = result["all_gather"], result["broadcasts"]
        print(f"| {world_size} | {gather['ms']:.1f} | {broadcasts['ms']:.1f} | {broadcasts['ms'] / gather['ms']:.2f}x"
              f" | {gather['kept_mib']:.1f} | {broadcasts['kept_mib']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
