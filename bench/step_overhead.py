"""The training step under ZeroLowLevelStrategy against Lightning's default strategy, no checkpoints, one rank.

What the engine's own work costs a step where the model is many small parameters (the ``deep`` model, 400 x
Linear(64, 64), 800 parameters: a step bound by Python, as a GPU step is bound by its kernel launches) and where
it is a few large ones (``wide``, 4 x Linear(1024, 1024)). One intra-op thread (``OMP_NUM_THREADS=1``), so that
the figures do not move with the other core. Per run: the training thread's CPU time and the wall time between
``training_step`` starts, medians past the warm-up, and each over the default strategy's in the same round.
Side by side in one process, rounds interleaved.

    OMP_NUM_THREADS=1 .venv/bin/python bench/step_overhead.py [--models deep wide] [--steps 60] [--rounds 2]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import warnings
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: Lightning's launcher would set two threads

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch import LightningModule, Trainer  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightning_zero import ZeroLowLevelStrategy  # noqa: E402

MODELS = {"deep": (64, 400), "wide": (1024, 4)}
RUNS = ("default", "zero1", "zero2")


class Net(LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
        self.marks: list[tuple[float, float]] = []  # (thread CPU s, wall s) at each training_step start

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.marks.append((time.thread_time(), time.perf_counter()))
        x, y = batch
        return F.mse_loss(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def one_run(kind: str, model: str, steps: int, warm: int) -> tuple[float, float]:
    """(median CPU ms, median wall ms) a step of one ``Trainer.fit``."""
    width, depth = MODELS[model]
    module = Net(width, depth)
    data = TensorDataset(torch.randn(steps * 8, width), torch.randn(steps * 8, width))
    strategy: Any = "auto" if kind == "default" else ZeroLowLevelStrategy(stage=int(kind[-1]))
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, strategy=strategy)
    trainer.fit(module, DataLoader(data, batch_size=8))
    marks = module.marks[warm:]
    cpu = [1e3 * (b[0] - a[0]) for a, b in zip(marks, marks[1:])]
    wall = [1e3 * (b[1] - a[1]) for a, b in zip(marks, marks[1:])]
    return statistics.median(cpu), statistics.median(wall)


def table(models: list[str], steps: int, rounds: int, warm: int) -> list[str]:
    lines = ["| model | run | round | CPU ms a step | wall ms a step | CPU vs default | wall vs default |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for model in models:
        for round_ in range(1, rounds + 1):
            figures = {kind: one_run(kind, model, steps, warm) for kind in RUNS}
            base = figures["default"]
            for kind, (cpu, wall) in figures.items():
                lines.append(f"| {model} | {kind} | {round_} | {cpu:.1f} | {wall:.1f} | {cpu / base[0]:.2f}x"
                             f" | {wall / base[1]:.2f}x |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warm", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    print("\n".join(table(args.models, args.steps, args.rounds, args.warm)))


if __name__ == "__main__":
    main()
