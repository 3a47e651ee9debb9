"""A Fabric program that ends right after ``fabric.save``, without ``fabric.strategy.teardown()`` (litgpt's
``pretrain.py`` saves its ``final/`` checkpoint that way): the save still in flight when the interpreter exits
is finished before it does, in every mode, and the file reads back as the program wrote it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_zero.checkpoint import read_lightning_checkpoint

pytestmark = pytest.mark.e2e
PROGRAM = Path(__file__).resolve().parents[1] / "fabric_exit_program.py"


@pytest.mark.parametrize(("mode", "devices"), [("full", 2), ("sharded", 2), ("local", 1)])
def test_the_save_in_flight_at_exit_is_committed(tmp_path: Path, mode: str, devices: int) -> None:
    path = tmp_path / "final" / "lit_model.pth"
    done = subprocess.run([sys.executable, str(PROGRAM), str(path), mode, str(devices)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "saved: queued" in done.stdout
    if mode == "full":
        content = torch.load(path, weights_only=True)  # as litgpt's tools read it
        assert content["iter_num"] == 2 and set(content["model"]) == {"weight", "bias"}
    else:
        content = read_lightning_checkpoint(str(path))
        assert content["state_dict"].keys() == {"weight", "bias"}
