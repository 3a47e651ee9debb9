"""Back-to-back checkpoint writes, side by side: the write phase alone, without the other phases
bench/checkpoint.py interleaves (a control for its write-rate rows).

Two gloo processes hold the same state as bench/checkpoint.py (284 MB per rank). Each round, in
rotating order, every method writes once: raw 64 MiB writes + fsync of one file per rank, the same
with early writeback ([Note: early writeback]), ``async_save`` in ``sharded`` and ``local`` mode
(time from the end of staging to the commit), the same ``sharded`` save with early writeback off,
and DCP's own synchronous ``save`` of the same shards as plain tensors. Medians of the slowest rank.

Usage::

    .venv/bin/python bench/write_loop.py               # 8 rounds
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _ckpt_common import MB, run_world, write_raw
from checkpoint import Settings, build_trainer, per_rank_state, tree_bytes

from lightning_zero.checkpoint import async_save, maybe_finalize_async_calls, storage, wait_for_staging
from lightning_zero.checkpoint import saver as ckpt_saver

METHODS = ("raw", "raw_writeback", "sharded", "sharded_no_writeback", "local", "dcp_save")


def one_write(method: str, trainer: Any, plain: dict[str, Any], path: str, rank: int, nbytes: int) -> float:
    if method.startswith("raw"):
        start, end = write_raw(f"{path}-rank{rank}.bin", nbytes, memoryview(os.urandom(64 * 2**20)),
                               writeback=method == "raw_writeback")
        return end - start
    if method == "dcp_save":
        start = time.perf_counter()
        dcp.save(plain, checkpoint_id=path)
        return time.perf_counter() - start
    mode = "local" if method == "local" else "sharded"
    saved = storage.WRITEBACK_BYTES
    if method == "sharded_no_writeback":
        storage.WRITEBACK_BYTES = 2**62  # never reached: the final fsync writes everything
    try:
        async_save(trainer.tree(), path, mode=mode)
        wait_for_staging()
        start = time.perf_counter()
        maybe_finalize_async_calls(blocking=True)
        return time.perf_counter() - start
    finally:
        storage.WRITEBACK_BYTES = saved


def loop(rank: int, world_size: int, settings: Settings, rounds: int) -> dict[str, Any]:
    trainer = build_trainer(settings, rank)
    ckpt_saver.prepare()
    trainer.forward_backward()
    trainer.optimizer_step()
    plain = per_rank_state(trainer.tree(), rank)
    nbytes = tree_bytes(trainer.tree())
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for round_index in range(rounds + 1):  # round 0 warms up
        order = METHODS[round_index % len(METHODS):] + METHODS[:round_index % len(METHODS)]
        for method in order:
            path = os.path.join(settings.root, f"{method}-{round_index}")
            dist.barrier()
            seconds = one_write(method, trainer, plain, path, rank, nbytes)
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, seconds)
            if round_index:
                times[method].append(max(gathered))
            dist.barrier()
            if rank == 0:
                for name in os.listdir(settings.root):
                    target = os.path.join(settings.root, name)
                    shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
            dist.barrier()
    return {"times": times, "bytes": nbytes * world_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lz-write-loop-") as root:
        settings = Settings(size_mb=512, repeats=1, root=root, reshard_world_sizes=())
        result = run_world(loop, 2, settings, args.rounds)
    total, times = result["bytes"], result["times"]
    raw = statistics.median(times["raw"])
    print(f"Command: `.venv/bin/python bench/write_loop.py --rounds {args.rounds}`  ")
    print(f"{total / MB:,.1f} MB over 2 ranks per write; median of {args.rounds} rounds, slowest rank.\n")
    print("| method | s (median) | runs (s) | MB/s | vs raw |")
    print("| --- | ---: | --- | ---: | ---: |")
    for method in METHODS:
        t = statistics.median(times[method])
        runs = "/".join(f"{x:.2f}" for x in times[method])
        print(f"| {method} | {t:.3f} | {runs} | {total / t / MB:,.0f} | {raw / t:.0%} |")


if __name__ == "__main__":
    main()
