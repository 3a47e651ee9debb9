"""Where an async save's cost in the loop sits: which step after the save pays it, and what is left when parts
of the background work are taken out.

One rank inside ``Trainer.fit``, as ``trainer_checkpoint.py --one-rank`` runs it (one intra-op thread,
async ``local`` saves every ``--every`` steps). For each variant it prints the step time by its position in
the save period (position ``every - 1`` is the step whose end runs the save hook, 0 the step after it), the
mean step, its ratio to the run without saves just before it, and the save's own figures (staging, staging
wait, write). The variants take work out of the background save **for measurement only** (their files are
not valid checkpoints):

* ``no-crc``: no integrity header (the CRC32s of the data; the zip records carry none either, as in every
  ``local`` rank file: [Note: one checksum pass] in modes/local.py);
* ``no-torch-save``: the rank file's ``torch.save`` writes one byte instead of the tree;
* ``no-copy``: staging writes the live tensors instead of copying them;
* ``none``: all three out (what the save's bookkeeping alone costs);
* ``raw-write``: the rank file's tensors written as raw bytes, one ``write`` each, instead of ``torch.save``
  (the same bytes into the page cache, without pickling and the zip records);
* ``copy-only``: the staging copy and nothing of the write (no CRC32s, one byte for the rank file): what any
  asynchronous save pays for its snapshot of the state;
* ``writer-process``: the CRC32s, ``torch.save`` and fsync of the rank file done by another process on tensors
  of the same sizes while the save's thread waits for it (the staging copy stays): the same work where it
  cannot take the training thread's GIL;
* ``pinned``: the training thread on the first CPU, the save's thread (and any thread it starts) on the others.

Each row also gives the training thread's CPU time a step, beside the same run's without saves: a step that
waits for the GIL or for a core takes more wall time but no more CPU time, a step slowed by what the other core
does to the memory both share (the caches, the memory bus) takes more of both.

``--phases`` prints instead the training thread's own part of each save (CPU ms per call, median over the
saves): Lightning's ``dump_checkpoint``, the strategy's ``save_checkpoint`` with, inside it,
``zero_state_dict`` and the pack plan, and ``adopt_module_writes``.

    .venv/bin/python bench/save_cost_parts.py [--model wide] [--variants full no-crc ...] [--rounds 1]
    .venv/bin/python bench/save_cost_parts.py --phases [--model deep]
"""

from __future__ import annotations

import argparse
import collections
import logging
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import trainer_checkpoint as tc  # noqa: E402

from lightning_zero.checkpoint import saver  # noqa: E402
from lightning_zero.checkpoint.formats.tree import FlatShard, walk  # noqa: E402
from lightning_zero.checkpoint.modes import local as local_mode  # noqa: E402
from lightning_zero.checkpoint.runtime import staging  # noqa: E402
from lightning_zero.checkpoint.store import file_io  # noqa: E402

VARIANTS = ("full", "no-crc", "no-torch-save", "no-copy", "none", "raw-write", "copy-only", "writer-process", "pinned")


@contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


class _NoHeader:
    """``integrity`` as ``local.write_local`` uses it, with an empty header (``no-crc``)."""

    HEADER_KEY = local_mode.integrity.HEADER_KEY

    @staticmethod
    def header(*_: Any, **__: Any) -> dict[str, Any]:
        return {}

    @staticmethod
    def checksums_enabled() -> bool:
        """True: ``write_local`` then leaves the zip records without CRC32s too, so no CRC32 is computed at all."""
        return True


def without(variant: str) -> ExitStack:
    """The patches of ``variant`` (see the module docstring), entered."""
    stack = ExitStack()
    parts = {"none": {"no-crc", "no-torch-save", "no-copy"}, "copy-only": {"no-crc", "no-torch-save"}}.get(variant, {variant})
    if "no-crc" in parts:
        stack.enter_context(patched(local_mode, "integrity", _NoHeader))
    if "no-torch-save" in parts:
        stack.enter_context(patched(file_io, "_save_keeping_write_errors", lambda obj, stream, *_: stream.write(b"x")))
    if "no-copy" in parts:
        stack.enter_context(patched(staging, "_host_copy", lambda tensor: tensor.detach()))
    if "raw-write" in parts:
        stack.enter_context(patched(file_io, "_save_keeping_write_errors", _raw_write))
    if "pinned" in parts:
        stack.enter_context(_pinned())
    if "writer-process" in parts:
        writer = stack.enter_context(_WriterProcess())
        stack.enter_context(patched(local_mode, "integrity", _NoHeader))
        stack.enter_context(patched(file_io, "_save_keeping_write_errors", writer.save))
    return stack


@contextmanager
def _pinned() -> Iterator[None]:
    """(``pinned``) The training thread on the first CPU, the save's thread on the others."""
    from lightning_zero.checkpoint.runtime import scheduler

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--variants pinned needs at least 2 CPUs")
    real_run = scheduler.SerialWorker._run

    def run_elsewhere(self: Any) -> None:
        os.sched_setaffinity(0, cpus[1:])
        real_run(self)

    os.sched_setaffinity(0, cpus[:1])
    try:
        with patched(scheduler.SerialWorker, "_run", run_elsewhere):
            yield
    finally:
        os.sched_setaffinity(0, cpus)


class _WriterProcess:
    """(``writer-process``) The rank file's CRC32s, ``torch.save`` and fsync done by another process, on tensors of
    the same sizes that it holds itself, while the save's thread waits for it: what the save would cost the loop
    with the same work moved out of the training process, where it cannot take the training thread's GIL. The
    staging copy stays in the training process (it must read the live state)."""

    def __enter__(self) -> _WriterProcess:
        context = multiprocessing.get_context("spawn")
        self._conn, theirs = context.Pipe()
        self._process = context.Process(target=_writer_main, args=(theirs,), daemon=True)
        self._process.start()
        self._conn.send([])  # wait for its start and imports here, not in the first save
        self._conn.recv()
        return self

    def save(self, obj: Any, stream: Any, *_: Any) -> None:
        self._conn.send([tensor.numel() * tensor.element_size() for tensor in _data_tensors(obj)])
        self._conn.recv()  # the other process's write is part of this save's time
        stream.write(b"x")

    def __exit__(self, *_: Any) -> None:
        self._conn.send(None)
        self._process.join(10)


def _writer_main(conn: Any) -> None:
    """(the ``writer-process`` process) Per request (the byte sizes of the rank file's tensors), what ``write_local``
    does to tensors of those sizes, made once and kept: their CRC32s, then a ``torch.save`` whose records carry no
    CRC32 of their own ([Note: one checksum pass]), fsynced."""
    import zlib

    from lightning_zero import _compat

    torch.set_num_threads(1)
    held: dict[tuple[int, ...], list[torch.Tensor]] = {}
    path = os.path.join(tempfile.mkdtemp(), "rank.pt")
    while (sizes := conn.recv()) is not None:
        if tuple(sizes) not in held:
            held[tuple(sizes)] = [torch.ones(n, dtype=torch.uint8) for n in sizes]
        tensors = held[tuple(sizes)]
        for tensor in tensors:
            zlib.crc32(memoryview(tensor.numpy()))
        with open(path, "wb") as f:
            _compat.torch_save_without_record_crcs(tensors, f)
            os.fsync(f.fileno())
        conn.send(True)


def _data_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors of a rank file's tree that hold data (a flat shard's local part), in order."""
    for _, leaf in walk(obj):
        tensor = leaf.local if isinstance(leaf, FlatShard) else leaf
        if isinstance(tensor, torch.Tensor) and tensor.numel():
            yield tensor


def _raw_write(obj: Any, stream: Any, *_: Any) -> None:
    """Each tensor of ``obj`` as its bytes, one ``write`` each (``raw-write``)."""
    for tensor in _data_tensors(obj):
        stream.write(memoryview(tensor.detach().contiguous().view(torch.uint8).numpy()))


def by_position(marks: list[tuple[str, float]], every: int, clock: str = "training_step") -> dict[int, float]:
    """Median step ms by position in the save period, past the first period; ``clock="training_step_cpu"``: the
    training thread's CPU time instead of the wall time."""
    starts = [t for name, t in marks if name == clock]
    steps: dict[int, list[float]] = collections.defaultdict(list)
    for i, (a, b) in enumerate(zip(starts, starts[1:])):
        if i >= every:
            steps[i % every].append(1e3 * (b - a))
    return {position: statistics.median(values) for position, values in sorted(steps.items())}


def run(kind: str, model: str, steps: int, every: int, root: str) -> tuple[float, dict[int, float], float]:
    """(mean step ms, step ms by position, mean CPU ms of the training thread per step) of one
    ``trainer_checkpoint.one_rank_marks`` run."""
    marks = tc.one_rank_marks(kind, model, steps, every, root)
    step, _ = tc.summarize_periods(marks, every)
    cpu = by_position(marks, every, "training_step_cpu")
    return 1e3 * step, by_position(marks, every), statistics.mean(cpu.values())


def parts_table(model: str, variants: list[str], steps: int, every: int, rounds: int) -> None:
    print(f"`{model}`, async `local` every {every} steps, {steps} steps; load {os.getloadavg()[0]:.1f}")
    print("| variant | round | no saves ms | step ms | ratio | step ms by position after the save | staging ms"
          " | staging wait ms | write ms | training thread CPU ms a step: no saves, this |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as root:
        for r in range(rounds):
            for variant in variants:
                base, _, base_cpu = run("ours no saves", model, steps, every, root)
                with without(variant):
                    step, positions, cpu = run("ours async local", model, steps, every, root)
                stats = saver.checkpointer().last_stats
                assert stats is not None, "no save committed"
                # The period from the step after the save: position 0 first, the hook's step last.
                shown = " / ".join(f"{positions[p]:.0f}" for p in sorted(positions))
                print(f"| {variant} | {r + 1} | {base:.1f} | {step:.1f} | {step / base:.2f}x | {shown} |"
                      f" {1e3 * stats.staging_s:.1f} | {1e3 * stats.staging_wait_s:.1f} | {1e3 * stats.write_s:.1f} |"
                      f" {base_cpu:.1f}, {cpu:.1f} |",
                      flush=True)


def phases_table(model: str, steps: int, every: int) -> None:
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    from lightning_zero.checkpoint.lightning import lightning_tree
    from lightning_zero.engine.zero_engine import ZeroEngine
    from lightning_zero.strategy import ZeroLowLevelStrategy

    cpu: dict[str, list[float]] = collections.defaultdict(list)

    def timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                cpu[label].append(1e3 * (time.thread_time() - started))

        return call

    targets = [(_CheckpointConnector, "dump_checkpoint", "Lightning's dump_checkpoint"),
               (ZeroLowLevelStrategy, "save_checkpoint", "the strategy's save_checkpoint (all below)"),
               (lightning_tree.engine_tree, "zero_state_dict", "  zero_state_dict"),
               (staging.Stager, "plan", "  the pack plan"),
               (ZeroEngine, "adopt_module_writes", "adopt_module_writes (before the save)")]
    with ExitStack() as stack, tempfile.TemporaryDirectory() as root:
        for owner, name, label in targets:
            stack.enter_context(patched(owner, name, timed(label, getattr(owner, name))))
        step, _, _ = run("ours async local", model, steps, every, root)
    print(f"`{model}`, async `local` every {every} steps: step {step:.1f} ms; training thread CPU ms per save"
          f" (median; load {os.getloadavg()[0]:.1f})")
    print("| phase | CPU ms |\n| --- | ---: |")
    for _, _, label in targets:
        values = cpu[label][1:] or cpu[label]  # the first save pays imports
        print(f"| {label} | {statistics.median(values):.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="wide", choices=list(tc.MODELS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=46)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--phases", action="store_true", help="the training thread's part of a save instead")
    args = parser.parse_args()
    tc.one_compute_thread()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if args.phases:
        phases_table(args.model, args.steps, args.every)
    else:
        parts_table(args.model, args.variants, args.steps, args.every, args.rounds)


if __name__ == "__main__":
    main()
