"""Checkpoint cost inside Lightning's own loop (not an engine loop): where the staging wait falls.

In automatic optimization ``training_step`` and backward run inside ``optimizer.step(closure)``;
the strategy waits for staging after the closure, right before the update. This measures, through
``Trainer.fit`` on 2 CPU ranks (gloo), per step:

* ``save -> next training_step``: from ModelCheckpoint's save to the next ``training_step`` starting
  (what the save call and the loop's bookkeeping cost the training thread);
* ``update wait``: the time the pre-update fence waited for staging;
* step time with a save every step, beside the same loop without saves and with synchronous saves.

    .venv/bin/python bench/trainer_checkpoint.py [--hidden 1024] [--steps 8]
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
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_zero import ZeroCheckpointIO, ZeroLowLevelStrategy  # noqa: E402
from lightning_zero.checkpoint import saver  # noqa: E402


class Wide(LightningModule):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(4)])
        self.marks: list[tuple[str, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.marks.append(("training_step", time.perf_counter()))
        x, y = batch
        return F.mse_loss(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Clock(Callback):
    def __init__(self, module: Wide) -> None:
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


def summarize(marks: list[tuple[str, float]]) -> dict[str, float]:
    step_starts = [t for name, t in marks if name == "training_step"]
    steps = [b - a for a, b in zip(step_starts[1:], step_starts[2:])]  # the first step warms up
    delays = []
    for i, (name, t) in enumerate(marks):
        if name == "save":
            nxt = next((u for n, u in marks[i:] if n == "training_step"), None)
            if nxt is not None:
                delays.append(nxt - t)
    waits = [t for name, t in marks if name == "update_wait"]
    return {"step_s": statistics.median(steps) if steps else float("nan"),
            "start_delay_ms": 1e3 * statistics.median(delays) if delays else 0.0,
            "update_wait_ms": 1e3 * statistics.median(waits) if waits else 0.0}


class Report(Callback):
    def __init__(self, module: Wide) -> None:
        self.module = module

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.callback_metrics["bench"] = summarize(self.module.marks)  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
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
    module = Wide(hidden)
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
