"""Checkpoint cost inside Lightning's own loop (not an engine loop): where the staging wait falls.

In automatic optimization ``training_step`` and backward run inside ``optimizer.step(closure)``;
the strategy waits for staging after the closure, right before the update. This measures, through
``Trainer.fit`` on 2 CPU ranks (gloo), per step:

* ``save -> next training_step``: from ModelCheckpoint's save to the next ``training_step`` starting
  (what the save call and the loop's bookkeeping cost the training thread);
* ``update wait``: the time the pre-update fence waited for staging;
* step time with a save every step, beside the same loop without saves and with synchronous saves.

``--one-rank`` instead: what a save costs the loop on one rank with a free core (:func:`one_rank_table`):
one intra-op thread (:func:`one_compute_thread`), so the training thread needs one core and a save's background
work has the other to itself; a ModelCheckpoint every ``--every`` steps (``save_top_k=1``: the older file is removed as Lightning
removes it). Per run: the mean time between ``training_step`` starts over whole save periods past the first
(a save's whole cost, whatever its background work takes from the training thread, counts), its ratio to the
same loop without saves under the same strategy (per round, the median taken), and save hook -> next
``training_step`` (the training thread's own part), and each round's full collections of the heap during the fit
(how many, and their seconds: a walk of every live object, on whichever thread set it off). Side by side in one process: no saves under each strategy;
``ZeroCheckpointIO`` async and sync in ``local`` and ``sharded`` mode under
``ZeroLowLevelStrategy(stage=2)``; Lightning's ``TorchCheckpointIO`` and ``AsyncCheckpointIO`` under its default
single-device strategy. Models: ``wide`` (4 x Linear(1024, 1024), 8 tensors, compute-bound) and ``deep``
(400 x Linear(64, 64), 800 tensors, bound by Python like a GPU step bound by its kernel launches).

    .venv/bin/python bench/trainer_checkpoint.py [--hidden 1024] [--steps 8]
    .venv/bin/python bench/trainer_checkpoint.py --one-rank [--every 5] [--steps 31] [--rounds 2]
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_zero import ZeroCheckpointIO, ZeroLowLevelStrategy  # noqa: E402
from lightning_zero.checkpoint import CheckpointTuning, saver  # noqa: E402


class Net(LightningModule):
    """``depth`` x Linear(``width``, ``width``) with AdamW; ``marks``: when each ``training_step`` started, by the
    wall clock and by the training thread's CPU clock."""

    def __init__(self, width: int, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
        self.marks: list[tuple[str, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.marks.append(("training_step", time.perf_counter()))
        self.marks.append(("training_step_cpu", time.thread_time()))  # the training thread's CPU clock
        x, y = batch
        return F.mse_loss(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Clock(Callback):
    def __init__(self, module: Net) -> None:
        self.module = module

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.module.marks.append(("batch_end", time.perf_counter()))

    def on_save_checkpoint(self, trainer: Trainer, *args: Any) -> None:
        self.module.marks.append(("save", time.perf_counter()))

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        real_wait = saver.wait_for_staging

        def timed_wait() -> None:
            start = time.perf_counter()
            real_wait()
            self.module.marks.append(("update_wait", time.perf_counter() - start))

        saver.wait_for_staging = timed_wait


def save_delays(marks: list[tuple[str, float]]) -> list[float]:
    """Seconds from each save hook to the next ``training_step`` start."""
    delays = []
    for i, (name, t) in enumerate(marks):
        if name == "save":
            following = next((u for n, u in marks[i:] if n == "training_step"), None)
            if following is not None:
                delays.append(following - t)
    return delays


def summarize(marks: list[tuple[str, float]]) -> dict[str, float]:
    step_starts = [t for name, t in marks if name == "training_step"]
    steps = [b - a for a, b in zip(step_starts[1:], step_starts[2:])]  # the first step warms up
    delays = save_delays(marks)
    waits = [t for name, t in marks if name == "update_wait"]
    return {"step_s": statistics.median(steps) if steps else float("nan"),
            "start_delay_ms": 1e3 * statistics.median(delays) if delays else 0.0,
            "update_wait_ms": 1e3 * statistics.median(waits) if waits else 0.0}


class Report(Callback):
    def __init__(self, module: Net) -> None:
        self.module = module

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.callback_metrics["bench"] = summarize(self.module.marks)  # type: ignore[assignment]


MODELS = {"wide": (1024, 4), "deep": (64, 400)}
RUNS = ("no saves", "ours no saves", "ours async local", "ours async sharded", "ours sync local", "ours sync sharded",
        "ours sync local no-fsync", "Lightning TorchCheckpointIO", "Lightning AsyncCheckpointIO")
"""``no-fsync``: ``CheckpointTuning(fsync=False)``, the files left to the page cache as Lightning's ``torch.save``
leaves them. ``no saves`` runs Lightning's default strategy, ``ours no saves`` ``ZeroLowLevelStrategy``: each run
is compared with the run of its own strategy without saves (:func:`baseline_of`), so a ratio is what the saves
cost, not what the strategy's step costs beside Lightning's."""


def baseline_of(kind: str) -> str:
    """The run without saves that ``kind`` is compared with: the same strategy's."""
    return "ours no saves" if kind.startswith("ours") else "no saves"


def summarize_periods(marks: list[tuple[str, float]], every: int) -> tuple[float, float]:
    """(mean step s over whole save periods past the first, median hook -> next step s)."""
    starts = [t for name, t in marks if name == "training_step"]
    first, last = every, every * ((len(starts) - 1) // every)  # step index `every` starts the 2nd period
    if last <= first:
        first, last = 1, len(starts) - 1
    step = (starts[last] - starts[first]) / (last - first)
    delays = save_delays(marks)
    return step, statistics.median(delays) if delays else float("nan")


def one_rank_run(kind: str, model: str, steps: int, every: int, root: str) -> tuple[float, float, int, float]:
    """(mean step s, median hook -> next step s) of one run (:func:`summarize_periods` of :func:`one_rank_marks`),
    and its full collections of the heap: how many, and their seconds."""
    marks = one_rank_marks(kind, model, steps, every, root)
    full = [t for name, t in marks if name == "full_gc"]
    return (*summarize_periods(marks, every), len(full), sum(full))


class FullCollections:
    """A ``gc.callbacks`` entry that adds a ``("full_gc", seconds)`` mark for each collection of the oldest
    generation (a walk of the process's whole heap, on whichever thread set it off)."""

    def __init__(self, marks: list[tuple[str, float]]) -> None:
        self.marks, self.started = marks, 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                self.started = time.perf_counter()
            else:
                self.marks.append(("full_gc", time.perf_counter() - self.started))


def one_rank_marks(kind: str, model: str, steps: int, every: int, root: str) -> list[tuple[str, float]]:
    """One ``Trainer.fit`` of ``kind`` (see :data:`RUNS`) on ``model``, a save every ``every`` steps: its clock's
    marks (``training_step`` starts, the save hooks)."""
    width, depth = MODELS[model]
    module = Net(width, depth)
    data = TensorDataset(torch.randn(steps * 8, width), torch.randn(steps * 8, width))
    callbacks: list[Callback] = [Clock(module)]
    saves = not kind.endswith("no saves")
    if saves:
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(root, f"{model}-{kind.replace(' ', '_')}"),
                                         every_n_train_steps=every, save_top_k=1, monitor="step", mode="max"))
    plugins: list[Any] = []
    strategy: Any = "auto"
    if kind == "ours no saves":
        strategy = ZeroLowLevelStrategy(stage=2)
    elif kind.startswith("ours"):
        _, how, mode, *options = kind.split()
        strategy = ZeroLowLevelStrategy(stage=2)
        plugins = [ZeroCheckpointIO(mode=mode, async_save=how == "async",
                                    tuning=CheckpointTuning(fsync="no-fsync" not in options))]
    elif kind == "Lightning TorchCheckpointIO":
        plugins = [TorchCheckpointIO()]
    elif kind == "Lightning AsyncCheckpointIO":
        plugins = [AsyncCheckpointIO(TorchCheckpointIO())]
    elif saves:
        raise ValueError(kind)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=saves, callbacks=callbacks,
                      strategy=strategy, plugins=plugins)
    collections = FullCollections(module.marks)
    gc.callbacks.append(collections)
    try:
        trainer.fit(module, DataLoader(data, batch_size=8))
    finally:
        gc.callbacks.remove(collections)
    return module.marks


def one_compute_thread() -> None:
    """Training on one intra-op thread, for every fit of this process: ``torch.set_num_threads(1)`` alone lasts
    until the first ``Trainer.fit``, whose launcher sets torch's threads to the cores over the processes (here 2)
    unless ``OMP_NUM_THREADS`` is set (``lightning.fabric.utilities.distributed._set_num_threads_if_needed``).
    Before this, the one-rank tables trained on both cores, and the save's thread had no core of its own."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def one_rank_table(every: int, steps: int, rounds: int, models: list[str], runs: list[str]) -> None:
    """The one-rank, free-core table (see the module docstring), printed as markdown rows."""
    one_compute_thread()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    print(f"One rank, one intra-op thread (OMP_NUM_THREADS=1), a save every {every} step(s), {steps} steps,"
          f" median of {rounds} rounds; load {os.getloadavg()[0]:.1f}")
    print("| model | run | step ms | vs its strategy's no saves | hook -> step ms | full collections: n, s |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as root:
        for model in models:
            results: dict[str, list[tuple[float, float, int, float]]] = {kind: [] for kind in runs}
            for _ in range(rounds):  # rounds interleaved: drift in the machine's load hits every run alike
                for kind in runs:
                    results[kind].append(one_rank_run(kind, model, steps, every, root))
            for kind, rows in results.items():
                step = statistics.median(row[0] for row in rows)
                delay = statistics.median(row[1] for row in rows)
                base = results.get(baseline_of(kind))
                # The ratio of each round to the same round's baseline, then the median: drift between rounds cancels.
                ratio = statistics.median(a[0] / b[0] for a, b in zip(rows, base)) if base else float("nan")
                full = "/".join(f"{n}, {seconds:.2f}" for _, _, n, seconds in rows)  # each round's
                print(f"| {model} | {kind} | {1e3 * step:.1f} | {ratio:.2f}x |"
                      f" {'' if kind.endswith('no saves') else f'{1e3 * delay:.1f}'} | {full} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=None, help="8 (two ranks), 31 (--one-rank)")
    parser.add_argument("--one-rank", action="store_true", help="the one-rank, free-core table instead")
    parser.add_argument("--every", type=int, default=5, help="--one-rank: steps between saves")
    parser.add_argument("--rounds", type=int, default=2, help="--one-rank: rounds, the median taken")
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="--one-rank: models")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), help="--one-rank: runs")
    args = parser.parse_args()
    if args.one_rank:
        one_rank_table(args.every, args.steps or 31, args.rounds, args.models, args.runs)
        return
    args.steps = args.steps or 8
    torch.set_num_threads(1)
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as root:
        for kind in ("no saves", "async saves", "sync saves"):
            rows[kind] = _run_with_report(kind, args.hidden, args.steps, root)
    base = rows["no saves"]["step_s"]
    params = 4 * (args.hidden * args.hidden + args.hidden)
    print(f"Trainer loop, 2 CPU ranks (gloo), ZeRO-2, local mode, a save every step; {params / 1e6:.1f}M parameters")
    print("| run | step (s) | vs no saves | save -> next training_step (ms) | update waited for staging (ms) |")
    print("| --- | --- | --- | --- | --- |")
    for kind, row in rows.items():
        print(f"| {kind} | {row['step_s']:.3f} | {row['step_s'] / base:.2f}x | {row['start_delay_ms']:.1f} |"
              f" {row['update_wait_ms']:.1f} |")


def _run_with_report(kind: str, hidden: int, steps: int, root: str) -> dict[str, float]:
    module = Net(hidden)
    data = TensorDataset(torch.randn(steps * 8, hidden), torch.randn(steps * 8, hidden))
    callbacks: list[Callback] = [Clock(module), Report(module)]
    if kind != "no saves":
        callbacks.append(ModelCheckpoint(dirpath=f"{root}/{kind.replace(' ', '_')}", every_n_train_steps=1,
                                         save_top_k=1, monitor="step", mode="max"))
    trainer = Trainer(
        accelerator="cpu", devices=2, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=kind != "no saves", callbacks=callbacks,
        strategy=ZeroLowLevelStrategy(stage=2, start_method="fork"),
        plugins=[ZeroCheckpointIO(mode="local", async_save=kind == "async saves")],
    )
    trainer.fit(module, DataLoader(data, batch_size=8))
    return dict(trainer.callback_metrics["bench"])  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
