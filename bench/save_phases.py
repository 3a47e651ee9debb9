"""CPU time of each phase of one `local` save, on the thread that runs it: what the GIL-holding work costs.

Wall time moves with the machine's load; ``time.thread_time`` (this thread's CPU time, best of ``--repeats``)
does not, so the phases of two commits compare on a busy machine. One rank (gloo), ZeRO-2 over
``--depth`` x Linear(``--width``, ``--width``) with AdamW after one step: 400 x 64 gives 800 parameters, 3,200
tensors with the masters, moments and steps (the `deep` model of ``trainer_checkpoint.py --one-rank``).
Background phases of a staged tree (the path of trees that are not many small CPU tensors, and of every local
save before [Note: pack plans]): staging copy, pack, integrity header, ``torch.save`` + write + fsync, and
``write_local``; of a pack plan (a local save of many small CPU tensors now): the plan (training thread), the
copy, the header and ``write_local``; a whole synchronous ``sharded`` save (wall time: it runs on the save's
thread) and an asynchronous one's job on the save's thread (its CPU time); training-thread phases: ``zero_state_dict`` and ``adopt_module_writes``.

    .venv/bin/python bench/save_phases.py [--width 64] [--depth 400] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_zero import ZeroConfig, ZeroEngine  # noqa: E402
from lightning_zero.checkpoint import async_save, maybe_finalize_async_calls, save, saver, zero_state_dict  # noqa: E402
from lightning_zero.checkpoint.formats import integrity, packed  # noqa: E402
from lightning_zero.checkpoint.modes import local  # noqa: E402
from lightning_zero.checkpoint.runtime.staging import Stager  # noqa: E402
from lightning_zero.checkpoint.store import file_io, storage  # noqa: E402


def cpu_ms(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """The least CPU time of this thread over ``repeats`` calls of ``fn``, in ms, and its last result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.thread_time()
        result = fn()
        best = min(best, time.thread_time() - start)
    return 1e3 * best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.depth)])
    engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters(), lr=1e-3)], ZeroConfig(stage=2))
    model(torch.randn(8, args.width)).pow(2).mean().backward()
    engine.optimizers[0].step()
    tree = zero_state_dict(engine, model, stable=True)  # as the strategy builds it ([Note: stable subtrees])
    root = tempfile.mkdtemp()
    loc = storage.resolve(root)
    n = args.repeats
    rows: list[tuple[str, float]] = []
    ms, staged = cpu_ms(lambda: Stager().stage(tree), n)
    rows.append(("staging copy", ms))
    ms, written = cpu_ms(lambda: packed.pack(staged), n)
    rows.append(("pack", ms))
    ms, head = cpu_ms(lambda: integrity.header(written, "x", 0, 1, chunked=(packed.PACKED_KEY,)), n)
    rows.append(("integrity header", ms))
    written[integrity.HEADER_KEY] = head
    rows.append(("torch.save + write + fsync", cpu_ms(lambda: file_io.torch_save_to(loc, f"{root}/f.pt", written), n)[0]))
    rows.append(("write_local (pack + header + save)",
                 cpu_ms(lambda: local.write_local(staged, loc, f"{root}/v", 0, 1, "x"), n)[0]))
    # The path a local save takes now ([Note: pack plans]): the layout on the training thread, the copy, header
    # and write on the background one; the second plan reuses the first's index.
    # A tree of a few large tensors gets no plan (staging.many_small): it takes the staged path above only.
    stager = Stager()
    ms, layout = cpu_ms(lambda: stager.plan(tree), n)
    if layout is None:
        rows.append(("[training thread] plan (none: few or large tensors, the staged path above)", ms))
    else:
        rows.append(("[training thread] plan (layout walk; index reused)", ms))
        ms, filled = cpu_ms(lambda: packed.fill(layout), n)
        rows.append(("plan: fill (copy)", ms))
        rows.append(("plan: integrity header", cpu_ms(lambda: integrity.header(
            filled.content, "x", 0, 1, chunked=(packed.PACKED_KEY,), leaves=filled.checked), n)[0]))
        rows.append(("plan: write_local (header + save)",
                     cpu_ms(lambda: local.write_local(filled, loc, f"{root}/w", 0, 1, "x"), n)[0]))
    # A synchronous `sharded` save of the same tree, whole (DCP's planning, the items, `.metadata`, the objects file
    # and the marker), on the save's own thread: its wall time, best of n ([Note: many small items] in dcp/items.py).
    walls = []
    for index in range(n):
        start = time.perf_counter()
        save(tree, f"{root}/sharded-{index}", mode="sharded")
        walls.append(time.perf_counter() - start)
    rows.append(("[wall, not CPU] synchronous sharded save", 1e3 * min(walls)))
    # The same save queued asynchronously: the CPU time of its whole job on the save's thread (staging, DCP's
    # protocol, the items, .metadata, the objects file, the commit, and any collection set off meanwhile), the
    # GIL-holding work that runs beside training steps.
    job_cpu: list[float] = []
    run = saver._SaveJob.run

    def timed_run(job: Any, staged: Any) -> None:
        started = time.thread_time()
        try:
            run(job, staged)
        finally:
            job_cpu.append(time.thread_time() - started)

    saver._SaveJob.run = timed_run  # type: ignore[method-assign]
    try:
        for index in range(n + 1):  # the first save of a tree plans it: left out
            async_save(tree, f"{root}/async-sharded-{index}", mode="sharded")
            maybe_finalize_async_calls(blocking=True)
    finally:
        saver._SaveJob.run = run  # type: ignore[method-assign]
    rows.append(("[save thread] async sharded save, the whole job", 1e3 * min(job_cpu[1:])))
    meta = zero_state_dict(engine, model)["meta"]  # computed once at setup by the strategy, passed to every save
    rows.append(("[training thread] zero_state_dict", cpu_ms(lambda: zero_state_dict(engine, model, meta=meta, stable=True), n)[0]))
    rows.append(("[training thread] adopt_module_writes", cpu_ms(engine.adopt_module_writes, n)[0]))
    tensors = sum(1 for _ in integrity._checked_leaves(local.encode_shards(tree)))
    print(f"{args.depth} x Linear({args.width}, {args.width}), {tensors} tensors; CPU ms, best of {n}")
    print("| phase | CPU ms |\n| --- | ---: |")
    for name, value in rows:
        print(f"| {name} | {value:.1f} |")
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
