"""Two launcher groups on 127.0.0.1 form one job with num_nodes=2, as on a real cluster."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from _dist import free_port
from engine_cases import Case, run_reference

from lightning_zero.checkpoint import read_mode

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_two_nodes_train_like_one_process_and_save_a_sharded_checkpoint(tmp_path):
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}
    env.pop("WORLD_SIZE", None)
    out, ckpt_dir = tmp_path / "result.pt", tmp_path / "ckpt"
    script = os.path.join(TESTS, "multinode_train.py")
    nodes = [
        subprocess.Popen([sys.executable, script, str(out), str(ckpt_dir)], env={**env, "NODE_RANK": str(rank)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)
    ]
    logs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n\n".join(logs)

    result = torch.load(out, weights_only=True)
    assert result["world_size"] == 2
    reference = run_reference(2, Case(steps=3, scheduler=True))
    for name, value in reference.items():
        torch.testing.assert_close(result["params"][name], value, atol=1e-6, rtol=1e-5)
    checkpoints = sorted(p for p in os.listdir(ckpt_dir) if p.endswith(".ckpt"))
    assert checkpoints == ["epoch=0-step=3.ckpt"]
    assert read_mode(str(ckpt_dir / checkpoints[0])) == "sharded"
