"""Back-to-back checkpoint writes, side by side: the write phase alone, without the other phases
bench/checkpoint.py interleaves (a control for its write-rate rows).

Two gloo processes hold the same state as bench/checkpoint.py (284 MB per rank). Each round, in
rotating order, every method writes once: raw 64 MiB writes + fsync of one file per rank, the same
with early writeback ([Note: early writeback]) and drop behind ([Note: drop behind]), with early
writeback but the written pages kept cached, ``async_save`` in ``sharded`` and ``local`` mode
(time from the end of staging to the commit), the same ``sharded`` save on one writer thread
instead of two ([Note: parallel writes]), with the pages kept cached and with early writeback off, and DCP's own synchronous ``save`` of the same shards as plain
tensors. Medians of the slowest rank.

With ``--fresh-memory`` it measures instead why the writers drop what they wrote
([Note: drop behind]): the rate at which one process fills memory it has just mapped, GiB after GiB
kept (so later GiBs come from memory that was free for a while), then the same again right after
freeing it all, and how much free memory the kernel reported to the host meanwhile (virtio-balloon
free page reporting, where the kernel has it).

Usage::

    .venv/bin/python bench/write_loop.py                  # 8 rounds
    .venv/bin/python bench/write_loop.py --fresh-memory   # fill rates of fresh and just-freed memory
    .venv/bin/python bench/write_loop.py --size-mb 16 --rounds 1   # a smoke run (the test suite does it)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _ckpt_common import MB, run_world, write_raw
from checkpoint import RAW_WRITE_CHUNK, Settings, build_trainer, per_rank_state, tree_bytes

from lightning_zero.checkpoint import (
    async_save,
    maybe_finalize_async_calls,
    wait_for_staging,
)
from lightning_zero.checkpoint.runtime.team import set_up_coordination
from lightning_zero.checkpoint.store.tuning import DEFAULT_TUNING, CheckpointTuning

METHODS = ("raw", "raw_writeback", "raw_writeback_cached", "sharded", "sharded_one_thread", "sharded_cached",
           "sharded_no_writeback", "local", "dcp_save")


def writer_settings(method: str) -> CheckpointTuning:
    """The writers as ``method`` names them: ``_cached`` keeps the written pages in the page cache,
    ``_no_writeback`` leaves all the writing to the final fsync, ``_one_thread`` writes a ``sharded``
    save's items on one thread ([Note: parallel writes])."""
    return CheckpointTuning(
        writeback_bytes=2**62 if method.endswith("_no_writeback") else DEFAULT_TUNING.writeback_bytes,
        drop_behind=not method.endswith("_cached"),
        write_threads=1 if method.endswith("_one_thread") else DEFAULT_TUNING.write_threads,
    )


def one_write(method: str, trainer: Any, plain: dict[str, Any], path: str, rank: int, nbytes: int,
              chunk: memoryview) -> float:
    tuning = writer_settings(method)
    if method.startswith("raw"):
        start, end = write_raw(f"{path}-rank{rank}.bin", nbytes, chunk, writeback=method != "raw",
                               drop_behind=tuning.drop_behind)
        return end - start
    if method == "dcp_save":
        start = time.perf_counter()
        dcp.save(plain, checkpoint_id=path)
        return time.perf_counter() - start
    async_save(trainer.tree(), path, mode="local" if method == "local" else "sharded", tuning=tuning)
    wait_for_staging()
    start = time.perf_counter()
    maybe_finalize_async_calls(blocking=True)
    return time.perf_counter() - start


def loop(rank: int, world_size: int, settings: Settings, rounds: int) -> dict[str, Any]:
    trainer = build_trainer(settings, rank)
    set_up_coordination()
    trainer.forward_backward()
    trainer.optimizer_step()
    plain = per_rank_state(trainer.tree(), rank)
    nbytes = tree_bytes(trainer.tree())
    chunk = memoryview(os.urandom(RAW_WRITE_CHUNK))  # made once: the raw writes time only the writing
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for round_index in range(rounds + 1):  # round 0 warms up
        order = METHODS[round_index % len(METHODS):] + METHODS[:round_index % len(METHODS)]
        for method in order:
            path = os.path.join(settings.root, f"{method}-{round_index}")
            dist.barrier()
            seconds = one_write(method, trainer, plain, path, rank, nbytes, chunk)
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


REPORTED_KIB = "/sys/module/page_reporting/parameters/reported_kib"


def reported_kib() -> int | None:
    """KiB of free memory this kernel has reported to its host since boot (None: no page reporting)."""
    try:
        with open(REPORTED_KIB) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def fill_rates(gib: int) -> list[float]:
    """MiB/s of mapping and filling each of ``gib`` GiB, every one kept until all are filled."""
    kept, rates = [], []
    for _ in range(gib):
        start = time.perf_counter()
        block = torch.empty(2**30, dtype=torch.uint8)
        block.fill_(1)
        rates.append(1024 / (time.perf_counter() - start))
        kept.append(block)
    return rates


def fresh_memory(gib: int) -> None:
    before = reported_kib()
    first = fill_rates(gib)
    second = fill_rates(gib)  # the first pass's memory was freed just before
    after = reported_kib()
    print(f"Command: `.venv/bin/python bench/write_loop.py --fresh-memory --gib {gib}`  ")
    print("MiB/s of mapping and filling 1 GiB, GiB after GiB kept; the second pass right after the first freed all.\n")
    print("| pass | median MiB/s | min | max | runs |")
    print("| --- | ---: | ---: | ---: | --- |")
    for label, rates in (("first", first), ("second, just freed", second)):
        runs = "/".join(f"{rate:.0f}" for rate in rates)
        print(f"| {label} | {statistics.median(rates):,.0f} | {min(rates):,.0f} | {max(rates):,.0f} | {runs} |")
    if before is None or after is None:
        print("\nThis kernel has no free page reporting.")
    else:
        print(f"\nFree memory reported to the host during the run: {(after - before) / 2**20:,.1f} GiB.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--size-mb", type=int, default=512, help="MiB of checkpointed state over the 2 ranks")
    parser.add_argument("--fresh-memory", action="store_true")
    parser.add_argument("--gib", type=int, default=8, help="GiB filled per pass with --fresh-memory")
    args = parser.parse_args()
    if args.fresh_memory:
        fresh_memory(args.gib)
        return
    with tempfile.TemporaryDirectory(prefix="lz-write-loop-") as root:
        settings = Settings(size_mb=args.size_mb, repeats=1, root=root, reshard_world_sizes=())
        result = run_world(loop, 2, settings, args.rounds)
    total, times = result["bytes"], result["times"]
    raw = statistics.median(times["raw"])
    size = f" --size-mb {args.size_mb}" if args.size_mb != 512 else ""
    print(f"Command: `.venv/bin/python bench/write_loop.py --rounds {args.rounds}{size}`  ")
    print(f"{total / MB:,.1f} MB over 2 ranks per write; median of {args.rounds} rounds, slowest rank.\n")
    print("| method | s (median) | runs (s) | MB/s | vs raw |")
    print("| --- | ---: | --- | ---: | ---: |")
    for method in METHODS:
        t = statistics.median(times[method])
        runs = "/".join(f"{x:.2f}" for x in times[method])
        print(f"| {method} | {t:.3f} | {runs} | {total / t / MB:,.0f} | {raw / t:.0%} |")


if __name__ == "__main__":
    main()
