"""What a compiled model costs the parameter-gather overlap ([Note: compiled reads] in
lightning_zero/engine/param_gather.py): step time of one ZeRO-2 engine's model run four ways, side by side.

- ``eager overlapped``: the default; the gathers of a step overlap the next forward.
- ``eager in step``: ``overlap_param_gather=False``; every gather ends inside the step.
- ``compiled``: ``torch.compile(model)`` with the default (overlapped) config; the engine ends the
  gathers in the step once the compiler traced a parameter read.
- ``compiled in step``: the same with ``overlap_param_gather=False`` (what ``compiled`` should equal).

The eager ways run in one set of processes and the compiled ways in another, since the switch is
process-wide (a compiled read ends every engine's gathers in the step). Within a set the two ways take
turns, one turn of a few steps each per round, the order swapped every round (as ``bench/engine.py``'s
[Note: interleaving]), and the ratio between them is taken within each round before the median; the
two sets are compared by their medians only (not paired: run back to back). The compiled ways are
compiled in the warm-up round. A stack of Linear+GELU layers, fp32, on CPU processes over gloo.

Usage::

    .venv/bin/python bench/compile_gather.py
    .venv/bin/python bench/compile_gather.py --world-size 2 --rounds 10 --layers 12 --width 512
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from _common import describe_machine, load_average, run_on_ranks
from torch import nn

from lightning_zero.engine import ZeroConfig, ZeroEngine

WAYS = ("eager overlapped", "eager in step", "compiled", "compiled in step")
SETS = (WAYS[:2], WAYS[2:])


def step_times(rank: int, world_size: int, args: argparse.Namespace,
               ways: tuple[str, str]) -> dict[str, dict[str, list[float]]]:
    runs = {}
    for way in ways:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.GELU())
                                for _ in range(args.layers)])
        engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters())],
                            ZeroConfig(stage=2, bucket_size_mb=args.bucket_size_mb,
                                       overlap_param_gather=not way.endswith("in step")))
        runs[way] = (torch.compile(model) if way.startswith("compiled") else model, engine)
    batch = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
    ratios: dict[str, list[float]] = {way: [] for way in ways}
    times: dict[str, list[float]] = {way: [] for way in ways}
    for round_index in range(1 + args.rounds):  # round 0: warm-up and compilation
        order = ways if round_index % 2 else ways[::-1]
        this_round = {}
        for way in order:
            model, engine = runs[way]
            optimizer = engine.optimizers[0]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps_per_turn):
                model(batch).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            engine.finish_param_gather()  # the turn's own gathers are billed to it
            elapsed = torch.tensor((time.perf_counter() - start) / args.steps_per_turn * 1e3)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank
            this_round[way] = elapsed.item()
        if round_index:
            for way in ways:
                times[way].append(this_round[way])
                ratios[way].append(this_round[way] / this_round[ways[0]])
    for _, engine in runs.values():
        engine.close()
    return {"times": times, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps-per-turn", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--bucket-size-mb", type=float, default=1.0)
    args = parser.parse_args()
    load_before = load_average()
    result: dict[str, dict[str, list[float]]] = {"times": {}, "ratios": {}}
    for ways in SETS:
        one_set = run_on_ranks(step_times, args.world_size, args, ways)
        for key in result:
            result[key].update(one_set[key])
    print(f"Command: `.venv/bin/python bench/compile_gather.py {' '.join(sys.argv[1:])}`  ")
    print(f"Machine: {describe_machine()}; load average before and after: {load_before} / {load_average()}.  ")
    print(f"Model: {args.layers} x (Linear {args.width}x{args.width} + GELU), batch {args.batch} per rank, AdamW,"
          f" zero2, {args.world_size} ranks, buckets of {args.bucket_size_mb} MiB; {args.rounds} timed rounds of"
          f" {args.steps_per_turn} steps per way, inductor for the compiled ways.\n")
    print("| way | step ms (median, slowest rank) | vs the first of its set (paired median) |"
          " vs eager overlapped (medians) |")
    print("| --- | ---: | ---: | ---: |")
    base = statistics.median(result["times"]["eager overlapped"])
    for way in WAYS:
        median = statistics.median(result["times"][way])
        print(f"| {way} | {median:.1f} | {statistics.median(result['ratios'][way]):.2f}x | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
