"""bench/gpu_check.py runs on a CPU machine: its CPU-able checks pass, its CUDA checks say SKIP."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_passes_its_cpu_checks_and_skips_the_cuda_ones() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("PASS zero2 equals plain PyTorch") and "bit-identical" in line for line in lines), lines
    assert any(line.startswith("PASS step peak memory") for line in lines), lines
    assert not any(line.startswith("FAIL") for line in lines), lines
    if not torch.cuda.is_available():
        skipped = [line for line in lines if line.startswith("SKIP")]
        assert skipped and all("needs a CUDA GPU" in line for line in skipped), lines
        assert any(line.startswith("SKIP no host sync") for line in skipped), lines
