"""Checkpoints written by an earlier commit load with the current code, as users load them.

``tests/fixtures/checkpoints/`` holds small committed checkpoints of every mode (``local``,
``sharded``, ``full``: ``Trainer.fit`` on 2 ranks of ZeRO-2, saved after 3 AdamW steps) and of the
functional API (``save(zero_state_dict(...), mode="sharded")``), with ``expected.pt``: the weights
and optimizer state each held when it was saved, gathered from the ranks' memory by the generating
commit (``tests/fixtures/make_old_checkpoints.py``; the commit is named in the folder's README).

What is loaded must equal what was saved, bit for bit: the weights every rank holds when a resumed
``fit`` starts or a ``validate`` runs, and the weights, optimizer state and scheduler of a full file
written from the loaded state (by ``convert``, or by a save right after the restore). The weights
after training on from the checkpoint are compared within float tolerance only: they come from new
arithmetic, which other torch versions may round differently.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_distributed

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
sys.path.insert(0, str(FIXTURES))

import old_checkpoint_model as old  # noqa: E402

from lightning_zero.checkpoint import convert, load_zero_state_dict, save, zero_state_dict  # noqa: E402

CHECKPOINTS = FIXTURES / "checkpoints"


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    return torch.load(CHECKPOINTS / "expected.pt", weights_only=True)


@pytest.fixture
def checkpoints(tmp_path: Path) -> Path:
    """A copy of the fixtures: a load must not write into the repository, and a fallback or a
    cleanup of leftovers would."""
    copy = tmp_path / "old"
    shutil.copytree(CHECKPOINTS, copy, ignore=shutil.ignore_patterns("expected.pt", "README.md"))
    return copy


def assert_equal_tensors(actual: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    assert sorted(actual) == sorted(expected), f"{where}: keys"
    for name, value in expected.items():
        assert actual[name].dtype == value.dtype and actual[name].shape == value.shape, f"{where}: {name}"
        assert torch.equal(actual[name], value), f"{where}: {name} differs by {(actual[name] - value).abs().max()}"


def assert_optimizer_state(state: dict[str, dict[str, Any]], expected: dict[str, Any], where: str) -> None:
    """``state``: by parameter name; Adam's ``step`` compared by value (its dtype is the optimizer's choice)."""
    assert sorted(state) == sorted(expected["state"]), f"{where}: parameters with optimizer state"
    for name, entry in expected["state"].items():
        saved = dict(state[name])
        assert float(saved.pop("step")) == float(entry["step"]), f"{where}: {name}/step"
        assert_equal_tensors(saved, {k: v for k, v in entry.items() if k != "step"}, f"{where}: {name}")


def assert_trainer_checkpoint(checkpoint: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    """A full Lightning checkpoint holds what the old one held: weights, AdamW state, learning
    rates, scheduler, step."""
    trainer = expected["trainer"]
    assert checkpoint["global_step"] == trainer["global_step"], where
    assert_equal_tensors(checkpoint["state_dict"], trainer["weights"], f"{where}: state_dict")
    [optimizer] = checkpoint["optimizer_states"]
    named = old.by_name(optimizer)
    assert_optimizer_state(named["state"], trainer["optimizer"], f"{where}: optimizer")
    assert [g["lr"] for g in named["param_groups"]] == trainer["optimizer"]["lr"], f"{where}: learning rates"
    assert [g["weight_decay"] for g in named["param_groups"]] == [0.1, 0.0], where
    [scheduler] = checkpoint["lr_schedulers"]
    for key in ("last_epoch", "_last_lr", "base_lrs", "gamma", "step_size"):
        assert scheduler[key] == trainer["scheduler"][key], f"{where}: scheduler {key}"


def rank_files(out: Path, point: str, world_size: int) -> list[dict[str, torch.Tensor]]:
    return [torch.load(out / f"{point}_rank{r}.pt", weights_only=True) for r in range(world_size)]


# ---- convert: one process, no process group ------------------------------------------------


@pytest.mark.parametrize("mode", old.MODES)
def test_convert_writes_an_old_checkpoint_as_the_full_file_it_saved(
        checkpoints: Path, tmp_path: Path, expected: dict[str, Any], mode: str) -> None:
    out = tmp_path / "converted.ckpt"
    convert(str(checkpoints / f"{mode}.ckpt"), str(out))
    assert_trainer_checkpoint(torch.load(out, weights_only=True), expected, f"convert {mode}")


def test_convert_writes_the_old_functional_checkpoint_with_its_weights_and_optimizer_state(
        checkpoints: Path, tmp_path: Path, expected: dict[str, Any]) -> None:
    out = tmp_path / "converted.ckpt"
    convert(str(checkpoints / "functional.ckpt"), str(out))
    converted = torch.load(out, weights_only=True)
    functional = expected["functional"]
    assert_equal_tensors(converted["state_dict"], functional["weights"], "state_dict")
    named = old.by_name(converted["optimizer_states"][0])
    assert_optimizer_state(named["state"], functional["optimizer"], "optimizer")
    assert [g["lr"] for g in named["param_groups"]] == functional["optimizer"]["lr"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", old.MODES)
def test_lightning_zero_convert_command_reads_an_old_checkpoint(
        checkpoints: Path, tmp_path: Path, expected: dict[str, Any], mode: str) -> None:
    out = tmp_path / "converted.ckpt"
    command = Path(sys.executable).parent / "lightning-zero"
    done = subprocess.run([str(command), "convert", str(checkpoints / f"{mode}.ckpt"), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_trainer_checkpoint(torch.load(out, weights_only=True), expected, f"lightning-zero convert {mode}")


# ---- the functional API: load_zero_state_dict on 2 and 3 ranks -----------------------------


def load_functional(rank: int, world_size: int, path: str, full_path: str) -> dict[str, torch.Tensor]:
    """(every rank) A fresh, perturbed engine resumed from ``path``; its state saved again as ``full``."""
    torch.set_num_threads(1)
    module = old.OldCheckpointModule(perturb=True)
    engine = old.functional_engine(module)
    load_zero_state_dict(engine, module, path)
    save(zero_state_dict(engine, module), full_path, mode="full")
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    engine.close()
    return weights


@pytest.mark.parametrize("world_size", [2, 3])
def test_load_zero_state_dict_resumes_the_old_functional_checkpoint(
        checkpoints: Path, tmp_path: Path, expected: dict[str, Any], world_size: int) -> None:
    full_path = tmp_path / "again.ckpt"
    ranks = run_distributed(load_functional, world_size, str(checkpoints / "functional.ckpt"), str(full_path),
                            start_method="forkserver")
    functional = expected["functional"]
    for rank, weights in enumerate(ranks):
        assert_equal_tensors(weights, functional["weights"], f"rank {rank} of {world_size}: weights")
    tree = torch.load(full_path, weights_only=True)
    [optimizer] = tree["optimizer"]
    assert_optimizer_state(optimizer["state"], functional["optimizer"], f"{world_size} ranks: optimizer")
    assert [g["lr"] for g in optimizer["param_groups"]] == functional["optimizer"]["lr"]


# ---- the Trainer: fit resume and validate --------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "world_size"), [("local", 2), ("sharded", 2), ("sharded", 3), ("full", 2), ("full", 3)])
def test_fit_resumes_from_an_old_checkpoint(checkpoints: Path, tmp_path: Path, expected: dict[str, Any],
                                            mode: str, world_size: int) -> None:
    out = tmp_path / "out"
    out.mkdir()
    trainer = old.make_trainer(mode, world_size, tmp_path / "run", max_epochs=2,
                               callbacks=[old.Dump(str(out), save_at_start=True)])
    trainer.fit(old.OldCheckpointModule(perturb=True), old.loader(), ckpt_path=str(checkpoints / f"{mode}.ckpt"))
    where = f"{mode} resumed on {world_size} ranks"
    for rank, weights in enumerate(rank_files(out, "fit_start", world_size)):
        assert_equal_tensors(weights, expected["trainer"]["weights"], f"{where}, rank {rank} at fit start")
    # Saved again right after the restore (in the same mode, at this world size): the same state.
    convert(str(out / "restored.ckpt"), str(out / "restored_full.ckpt"))
    assert_trainer_checkpoint(torch.load(out / "restored_full.ckpt", weights_only=True), expected, where)
    # Epoch 1 (3 more steps) from the loaded state ends where the uninterrupted run ended.
    for rank, weights in enumerate(rank_files(out, "fit_end", world_size)):
        assert sorted(weights) == sorted(expected["trainer"]["after_epoch_1"])
        for name, value in expected["trainer"]["after_epoch_1"].items():
            torch.testing.assert_close(weights[name], value, msg=lambda m, n=name, r=rank: f"{where}, rank {r}: {n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "world_size"), [("local", 2), ("local", 3), ("sharded", 2), ("full", 3)])
def test_validate_loads_the_weights_of_an_old_checkpoint(checkpoints: Path, tmp_path: Path, expected: dict[str, Any],
                                                         mode: str, world_size: int) -> None:
    out = tmp_path / "out"
    out.mkdir()
    trainer = old.make_trainer(mode, world_size, tmp_path / "run", callbacks=[old.Dump(str(out))])
    trainer.validate(old.OldCheckpointModule(perturb=True), old.loader(), ckpt_path=str(checkpoints / f"{mode}.ckpt"))
    for rank, weights in enumerate(rank_files(out, "validate", world_size)):
        assert_equal_tensors(weights, expected["trainer"]["weights"], f"{mode} validated on {world_size} ranks, rank {rank}")
