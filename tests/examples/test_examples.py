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

REPO = Path(__file__).resolve().parents[2]


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


@pytest.mark.slow
def test_lora_example_saves_adapters_only_resumes_on_three_processes_and_exports_the_merged_model(
        tmp_path: Path) -> None:
    pytest.importorskip("peft")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "examples/lora_gpt2.py", "--root", str(tmp_path), "--steps", "10"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("[lora]")]
    assert lines[0].startswith("[lora] 2 processes, global step 10") and lines[1].startswith("[lora] 3 processes, global"
                                                                                             " step 20"), lines
    from lightning_zero.checkpoint import read_lightning_checkpoint

    saved = read_lightning_checkpoint(str(tmp_path / "checkpoints" / "last.ckpt"), optimizer=False)
    assert saved["global_step"] == 20 and saved["state_dict"]
    assert all("lora_" in key for key in saved["state_dict"]), sorted(saved["state_dict"])[:5]
    with_base = read_lightning_checkpoint(str(tmp_path / "with-base.ckpt"), optimizer=False)["state_dict"]
    assert len(with_base) > len(saved["state_dict"])
    for key, value in saved["state_dict"].items():  # the same trained adapters in both saves
        assert torch.equal(value, with_base[key]), key
    difference = float(lines[-1].rsplit(" by ", 1)[1])
    assert difference < 1e-5, lines[-1]
