"""Checkpoints pass between the front ends, in every mode: one the Trainer wrote resumes a Fabric loop, and one
fabric.save wrote resumes ``trainer.fit``; either way the run ends bit for bit where the uninterrupted Trainer
run does (NetModule, AdamW, StepLR every step: tests/checkpoint_cases.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _dist import run_distributed
from checkpoint_cases import fit, make_trainer
from fabric_cases import run_fabric_resumes_trainer_checkpoint, run_fabric_trains_like_the_trainer


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["local", "sharded", "full"])
def test_fabric_loop_resumes_a_trainer_checkpoint_and_ends_as_the_uninterrupted_trainer_run(
        mode: str, tmp_path: Path, uninterrupted: dict[str, torch.Tensor]) -> None:
    first_epoch = fit(make_trainer(mode, tmp_path, max_epochs=1))  # 2 steps, then last.ckpt
    results = run_distributed(run_fabric_resumes_trainer_checkpoint, 2, str(tmp_path / "last.ckpt"), (2, 4),
                              start_method="forkserver")
    for rank, result in enumerate(results):
        assert result["global_step"] == 2
        assert {"epoch", "loops", "lr_schedulers"} <= set(result["keys"])
        for name, value in first_epoch.items():
            assert torch.equal(result["loaded"][name], value), f"rank {rank}: {name} as loaded"
        for name, value in uninterrupted.items():  # the Trainer's 4 steps without a break
            assert torch.equal(result["weights"][name], value), f"rank {rank}: {name} at the end"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["local", "sharded", "full"])
def test_trainer_resumes_a_fabric_checkpoint_and_ends_as_the_uninterrupted_trainer_run(
        mode: str, tmp_path: Path, uninterrupted: dict[str, torch.Tensor]) -> None:
    path = str(tmp_path / "fabric.ckpt")
    run_distributed(run_fabric_trains_like_the_trainer, 2, path, mode, start_method="forkserver")  # the first epoch
    # A Fabric checkpoint has no Trainer loops: fit starts its epochs at 0, with the weights, the optimizer
    # state and the scheduler (saved as "lr_schedulers") of the Fabric loop; one more epoch ends the run.
    resumed = fit(make_trainer(mode, tmp_path / "trainer", max_epochs=1, checkpointing=False), ckpt_path=path)
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), f"{name} at the end"
