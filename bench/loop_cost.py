"""What a checkpoint costs the training loop: one rank with a free core, inside ``Trainer.fit``.

The training thread runs with ``torch.set_num_threads(1)``, so it needs one core and a save's background
work has the other to itself. Each run fits the same module for ``--steps`` steps with a ModelCheckpoint every
``--every`` steps (``save_top_k=1``: the older file is removed as Lightning removes it) and reports:

* step ms: the mean time between ``training_step`` starts over whole save periods past the first one, so a
  save's whole cost (the call, and whatever its background work takes from the training thread) counts;
* vs no saves: that over the same loop without saves;
* hook -> step ms: from ModelCheckpoint's save to the next ``training_step`` (the training thread's own part).

Runs, side by side in one process: no saves; this package's ``ZeroCheckpointIO`` async and sync in ``local``
and ``sharded`` mode under ``ZeroLowLevelStrategy(stage=2)``; Lightning's ``TorchCheckpointIO`` and
``AsyncCheckpointIO`` under its default single-device strategy. Models: ``wide`` (4 x Linear(1024, 1024),
8 tensors, compute-bound) and ``deep`` (400 x Linear(64, 64), 800 tensors, bound by Python like a GPU step
bound by its kernel launches).

    .venv/bin/python bench/loop_cost.py [--every 5] [--steps 31] [--rounds 2] [--models wide deep]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
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

MODELS = {"wide": (1024, 4), "deep": (64, 400)}
RUNS = ("no saves", "ours async local", "ours async sharded", "ours sync local", "ours sync sharded",
        "Lightning TorchCheckpointIO", "Lightning AsyncCheckpointIO")


class Net(LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
        self.marks: list[tuple[str, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.marks.append(("step", time.perf_counter()))
        x, y = batch
        return F.mse_loss(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Marks(Callback):
    def __init__(self, module: Net) -> None:
        self.module = module

    def on_save_checkpoint(self, trainer: Trainer, *args: Any) -> None:
        self.module.marks.append(("save", time.perf_counter()))


def summarize(marks: list[tuple[str, float]], every: int) -> tuple[float, float]:
    """(mean step s over whole save periods past the first, median hook -> next step s)."""
    starts = [t for name, t in marks if name == "step"]
    first, last = every, every * ((len(starts) - 1) // every)  # step index `every` starts the 2nd period
    if last <= first:
        first, last = 1, len(starts) - 1
    step = (starts[last] - starts[first]) / (last - first)
    delays = []
    for i, (name, t) in enumerate(marks):
        if name == "save":
            following = next((u for n, u in marks[i:] if n == "step"), None)
            if following is not None:
                delays.append(following - t)
    return step, statistics.median(delays) if delays else float("nan")


def run(kind: str, model: str, steps: int, every: int, root: str) -> tuple[float, float]:
    width, depth = MODELS[model]
    module = Net(width, depth)
    data = TensorDataset(torch.randn(steps * 8, width), torch.randn(steps * 8, width))
    callbacks: list[Callback] = [Marks(module)]
    saves = kind != "no saves"
    if saves:
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(root, f"{model}-{kind.replace(' ', '_')}"),
                                         every_n_train_steps=every, save_top_k=1, monitor="step", mode="max"))
    plugins: list[Any] = []
    strategy: Any = "auto"
    if kind.startswith("ours"):
        _, how, mode = kind.split()
        strategy = ZeroLowLevelStrategy(stage=2)
        plugins = [ZeroCheckpointIO(mode=mode, async_save=how == "async")]
    elif kind == "Lightning TorchCheckpointIO":
        plugins = [TorchCheckpointIO()]
    elif kind == "Lightning AsyncCheckpointIO":
        plugins = [AsyncCheckpointIO(TorchCheckpointIO())]
    elif saves:
        raise ValueError(kind)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=saves, callbacks=callbacks,
                      strategy=strategy, plugins=plugins)
    trainer.fit(module, DataLoader(data, batch_size=8))
    return summarize(module.marks, every)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--steps", type=int, default=31)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--runs", nargs="+", default=list(RUNS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    import warnings
    warnings.filterwarnings("ignore")
    import logging
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    print(f"One rank, torch.set_num_threads(1), a save every {args.every} step(s), {args.steps} steps,"
          f" median of {args.rounds} rounds; load {os.getloadavg()[0]:.1f}")
    print("| model | run | step ms | vs no saves | hook -> step ms |")
    print("| --- | --- | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as root:
        for model in args.models:
            results: dict[str, list[tuple[float, float]]] = {kind: [] for kind in args.runs}
            for _ in range(args.rounds):  # rounds interleaved: drift in the machine's load hits every run alike
                for kind in args.runs:
                    results[kind].append(run(kind, model, args.steps, args.every, root))
            base = statistics.median(s for s, _ in results["no saves"]) if "no saves" in results else float("nan")
            for kind, rows in results.items():
                step = statistics.median(s for s, _ in rows)
                delay = statistics.median(d for _, d in rows)
                print(f"| {model} | {kind} | {1e3 * step:.1f} | {step / base:.2f}x |"
                      f" {'' if kind == 'no saves' else f'{1e3 * delay:.1f}'} |", flush=True)


if __name__ == "__main__":
    main()
