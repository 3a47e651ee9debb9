"""examples/hf_gpt2.py: trains a tiny random GPT-2 with ZeRO-2 and exports a folder that
``from_pretrained`` reads with the trained weights. (tiny_gpt.py runs in test_cli/test_configs/test_demo,
torchrun_loop.py in test_torchrun_loop.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_hf_example_exports_a_folder_that_from_pretrained_reads_with_the_trained_weights(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "examples/hf_gpt2.py", "--root", str(tmp_path), "--steps", "3",
                           "--devices", "1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert f"[hf_gpt2] wrote {tmp_path / 'hf'}" in done.stdout
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    sys.path.insert(0, str(REPO))
    from examples.hf_gpt2 import GPT2Module

    initial = GPT2Module().model  # the same seed: the weights before training
    trained = dict(model.named_parameters())
    changed = [name for name, p in initial.named_parameters() if not torch.equal(p, trained[name])]
    assert changed, "the exported weights are the untrained ones"
