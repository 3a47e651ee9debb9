"""A functional loop that ends as DDP loops end (ddp_style_ending.py): a rank that destroys the process group,
or exits, after ``opt.step()`` without ``engine.close()`` leaves no peer failing in a half-done parameter gather,
and every rank exits 0 ([Note: gathers outlive no group] in lightning_zero/engine/param_gather.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def reference_weights(world_size: int) -> dict[str, torch.Tensor]:
    """The same 3 steps in one plain PyTorch process on the whole batches (the ground truth)."""
    sys.path.insert(0, str(HERE))
    try:
        import ddp_style_ending as program
    finally:
        sys.path.remove(str(HERE))
    model = program.mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(program.STEPS):
        x, y = program.global_batch(step, world_size)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("ending", ["destroy", "exit"])
def test_a_loop_ending_without_close_exits_cleanly_on_every_rank(tmp_path: Path, world_size: int, ending: str) -> None:
    runs = 20 if ending == "destroy" else 3  # "exit" ends the processes: one run each, three launches
    launches = 1 if ending == "destroy" else runs
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    expected = reference_weights(world_size)
    for launch in range(launches):
        store = tmp_path / f"launch-{launch}"
        store.mkdir()
        out = store / "rank0.pt"
        count = runs if ending == "destroy" else 1
        processes = [subprocess.Popen([sys.executable, str(HERE / "ddp_style_ending.py"), str(store), str(rank),
                                       str(world_size), str(count), ending, str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                     for rank in range(world_size)]
        try:
            outputs = [process.communicate(timeout=240)[0] for process in processes]
        finally:
            for process in processes:
                process.kill()  # a rank left waiting for a peer that failed
        for rank, (process, output) in enumerate(zip(processes, outputs)):
            assert process.returncode == 0, f"launch {launch}, rank {rank} exited {process.returncode}:\n{output[-3000:]}"
        read = torch.load(out, weights_only=True)
        assert len(read) == count
        for run, weights in enumerate(read):
            for name, value in expected.items():
                torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, run=run, name=name: f"run {run}, {name}: {m}")
