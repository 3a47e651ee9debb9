"""Programs written elsewhere work unchanged (tests/client_cases.py has the programs).

* A Fabric loop shaped like litgpt's: ``fabric.save`` in ``full`` mode writes the file Fabric's DDP writes
  (``torch.load(path)["model"]`` is the module's ``state_dict``, ``["optimizer"]`` the optimizer's, the
  program's other keys at the top), which a fresh module loads with ``strict=True`` and a plain optimizer
  with ``load_state_dict``; ``sharded``/``local`` checkpoints give the same through ``fabric.load(path)``
  and ``lightning-zero convert``.
* Buffers registered with ``persistent=False`` are in no checkpoint, through either front end in any mode
  (``state_dict()`` leaves them out, so a strict load refuses them).
DDP is the control: the same program under Fabric's and Lightning's ``ddp`` gives the reference file.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_distributed
from client_cases import FABRIC_RUNS, STEPS, TRAINER_RUNS, RopeModule, RopeNet, fabric_runs, trainer_runs

from lightning_zero.checkpoint import convert, read_lightning_checkpoint

pytestmark = pytest.mark.slow


@functools.cache
def fabric_results(root: str) -> list[dict[str, Any]]:
    return run_distributed(fabric_runs, 2, root, start_method="forkserver")


@functools.cache
def trainer_results(root: str) -> list[dict[str, Any]]:
    return run_distributed(trainer_runs, 2, root, start_method="forkserver")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("clients"))


def _close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(actual) == sorted(expected), what
    for key, value in expected.items():
        # Two ranks' gradients summed in another order than DDP's bucketed all-reduce: float rounding only.
        torch.testing.assert_close(actual[key], value, atol=1e-6, rtol=1e-5, msg=lambda m, k=key: f"{what}, {k}: {m}")


def _fresh_strict(state_dict: dict[str, torch.Tensor]) -> RopeNet:
    module = RopeNet()
    module.load_state_dict(state_dict, strict=True)  # unexpected or missing keys raise
    return module


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_fabric_save_in_full_mode_writes_the_file_a_fabric_program_reads(root: str, strategy: str) -> None:
    result = fabric_results(root)[0][f"{strategy}-full"]
    ckpt = torch.load(result["path"], map_location="cpu", weights_only=True)
    assert {"model", "optimizer", "iter_num", "step_count", "train_dataloader"} <= set(ckpt)
    assert ckpt["iter_num"] == STEPS and ckpt["train_dataloader"] == {"position": 3 * 6}
    assert "cos" not in ckpt["model"] and "scale" in ckpt["model"]
    module = _fresh_strict(ckpt["model"])
    _close(module.state_dict(), result["weights"], f"{strategy}: the file's weights against the live module")
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.1)
    optimizer.load_state_dict(ckpt["optimizer"])  # PyTorch's per-parameter form, as DDP writes it
    reference = torch.load(fabric_results(root)[0]["ddp-full"]["path"], map_location="cpu", weights_only=True)
    assert sorted(ckpt["optimizer"]["state"]) == sorted(reference["optimizer"]["state"])
    for index, entry in reference["optimizer"]["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(ckpt["optimizer"]["state"][index][key], value, atol=1e-6, rtol=1e-5)
    assert ckpt["optimizer"]["param_groups"][0]["weight_decay"] == 0.1
    _close(ckpt["model"], reference["model"], f"{strategy} against Fabric's DDP")


@pytest.mark.parametrize("mode", ["full", "sharded", "local"])
def test_every_mode_reads_back_in_fabrics_layout_and_resumes(root: str, mode: str, tmp_path: Path) -> None:
    runs = fabric_results(root)
    full_file = torch.load(runs[0]["zero2-full"]["path"], map_location="cpu", weights_only=True)
    for rank, per_rank in enumerate(runs):
        loaded = per_rank[f"zero2-{mode}"]["loaded"]
        assert {"model", "optimizer", "iter_num", "step_count", "train_dataloader"} <= set(loaded["whole_keys"])
        assert "state_dict" not in loaded["whole_keys"]
        _fresh_strict(loaded["whole_model"])
        assert loaded["iter_num"] == STEPS and loaded["dataloader"] == {"position": 3 * 6}, f"rank {rank}"
        for key, value in full_file["model"].items():  # the same program, the same values, any mode
            assert torch.equal(loaded["weights"][key], value), f"rank {rank}, {mode}: {key}"
    converted = convert(runs[0][f"zero2-{mode}"]["path"], str(tmp_path / "converted.pth"))
    ckpt = torch.load(converted, map_location="cpu", weights_only=True)
    assert ckpt["iter_num"] == STEPS
    _fresh_strict(ckpt["model"])
    torch.optim.AdamW(RopeNet().parameters()).load_state_dict(ckpt["optimizer"])


def test_a_file_fabrics_ddp_wrote_resumes_under_zero2_with_its_optimizer_state(root: str) -> None:
    """The strategy line of a running project changed from DDP to zero2: ``fabric.load(path, state)`` reads the
    file DDP's ``fabric.save`` wrote (it records no keys of this package: the state's keys say them)."""
    runs = fabric_results(root)
    ddp_file = torch.load(runs[0]["ddp-full"]["path"], map_location="cpu", weights_only=True)
    for rank, per_rank in enumerate(runs):
        loaded = per_rank["ddp-full"]["loaded"]
        assert loaded["iter_num"] == STEPS and loaded["dataloader"] == {"position": 3 * 6}, f"rank {rank}"
        for key, value in ddp_file["model"].items():
            assert torch.equal(loaded["weights"][key], value), f"rank {rank}: {key}"
    resaved = torch.load(Path(root) / "ddp-full-resaved.pth", map_location="cpu", weights_only=True)
    assert sorted(resaved["optimizer"]["state"]) == sorted(ddp_file["optimizer"]["state"])
    for index, entry in ddp_file["optimizer"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(resaved["optimizer"]["state"][index][key], value), f"param {index}, {key}"
    assert resaved["optimizer"]["param_groups"] == ddp_file["optimizer"]["param_groups"]


@pytest.mark.parametrize("run", [f"{s}-{m}" for s, m in TRAINER_RUNS])
def test_trainer_checkpoints_leave_non_persistent_buffers_out_and_resume(root: str, run: str) -> None:
    results = trainer_results(root)
    path = results[0][run]["path"]
    state_dict = read_lightning_checkpoint(path)["state_dict"]
    assert "net.cos" not in state_dict and "net.scale" in state_dict
    RopeModule().load_state_dict(state_dict, strict=True)
    reference = results[0]["ddp-full"]["weights"]
    for rank, per_rank in enumerate(results):
        assert per_rank[run]["global_step"] == 2 * STEPS
        _close(per_rank[run]["weights"], reference, f"rank {rank}, {run} resumed against DDP resumed")


def test_the_runs_cover_both_stages_and_every_mode() -> None:
    assert {m for _, m in FABRIC_RUNS} == {m for _, m in TRAINER_RUNS} == {"full", "sharded", "local"}
