"""fabric.save / fabric.load with Fabric(strategy="zero1"/"zero2"): resume in every mode, at the same world size
(bit for bit against the uninterrupted run) and at another one (``sharded``, ``full``: against one PyTorch
process); weights-only loads, ``load_raw``, ``filter`` and ``strict``.

A loop saves ``{"model", "optimizer", "scheduler", "step", "note"}`` after 2 of 5 steps (asynchronously,
training on while it writes) and trains to the end; a fresh loop loads the checkpoint and trains the rest.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_distributed
from fabric_cases import (
    FabricCase,
    run_bad_saves,
    run_filtered_save,
    run_load_and_continue,
    run_load_filtered,
    run_load_weights_only,
    run_reference,
    run_save_and_continue,
    run_strict_load,
)

from lightning_zero.checkpoint import read_lightning_checkpoint

CASE = FabricCase(steps=5, accumulate=2, clip_norm=0.05)
SAVE_AT = 2
MODES = ("local", "sharded", "full")


@functools.cache
def saved(stage: int, mode: str, directory: str) -> tuple[str, list[dict[str, Any]]]:
    """The checkpoint written at step SAVE_AT by 2 ranks, and their uninterrupted run."""
    path = str(Path(directory) / f"zero{stage}-{mode}.ckpt")
    case = replace(CASE, strategy=f"zero{stage}")
    return path, run_distributed(run_save_and_continue, 2, case, mode, path, SAVE_AT, start_method="forkserver")


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("fabric-ckpt"))


def _equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert actual.keys() == expected.keys()
    for fqn, value in expected.items():
        assert torch.equal(actual[fqn], value), f"{what}: {fqn} differs by {(actual[fqn] - value).abs().max()}"


def _close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    for fqn, value in expected.items():
        torch.testing.assert_close(actual[fqn], value, atol=1e-6, rtol=1e-5, msg=lambda m, f=fqn: f"{what}, {f}: {m}")


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_resume_at_the_same_world_size_is_bit_exact(stage: int, mode: str, directory: str) -> None:
    path, uninterrupted = saved(stage, mode, directory)
    case = replace(CASE, strategy=f"zero{stage}")
    resumed = run_distributed(run_load_and_continue, 2, case, path, start_method="forkserver")
    for rank in range(2):
        assert resumed[rank]["start"] == SAVE_AT
        assert resumed[rank]["remainder"] == {"note": {"text": "fabric", "values": [1, 2]}}
        _equal(resumed[rank]["loaded_params"], uninterrupted[rank]["saved_params"], f"rank {rank} after load")
        _equal(resumed[rank]["params"], uninterrupted[rank]["params"], f"rank {rank} at the end")
        # The scheduler's state came back: StepLR(gamma=0.7) after 2 steps.
        assert resumed[rank]["lr"] == pytest.approx([0.01 * 0.7**SAVE_AT, 0.02 * 0.7**SAVE_AT])


@pytest.mark.parametrize("mode", ["sharded", "full"])
def test_resume_on_one_rank_ends_where_one_pytorch_process_does(mode: str, directory: str) -> None:
    path, _ = saved(2, mode, directory)
    resumed = run_distributed(run_load_and_continue, 1, replace(CASE, strategy="zero2"), path,
                              start_method="forkserver")
    expected = run_reference(CASE, 1)["params"]
    assert resumed[0]["start"] == SAVE_AT
    _close(resumed[0]["params"], expected, "1 rank resumed from 2")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sharded", "full"])
def test_resume_on_three_ranks_ends_where_one_pytorch_process_does(mode: str, directory: str) -> None:
    path, _ = saved(1, mode, directory)
    resumed = run_distributed(run_load_and_continue, 3, replace(CASE, strategy="zero1"), path,
                              start_method="forkserver")
    expected = run_reference(CASE, 1)["params"]
    for rank in range(3):
        _close(resumed[rank]["params"], expected, f"rank {rank} of 3 resumed from 2")


def test_local_checkpoint_at_another_world_size_fails_on_every_rank(directory: str) -> None:
    path, _ = saved(2, "local", directory)
    with pytest.raises(RuntimeError, match="world size|world_size") as error:
        run_distributed(run_load_and_continue, 1, replace(CASE, strategy="zero2"), path, start_method="forkserver")
    assert "rank 0" in str(error.value)


@pytest.mark.parametrize("mode", MODES)
def test_weights_only_load_load_raw_and_a_module_without_optimizer(mode: str, directory: str) -> None:
    path, uninterrupted = saved(2, mode, directory)
    loaded = run_distributed(run_load_weights_only, 2, replace(CASE, strategy="zero2"), path,
                             start_method="forkserver")
    for rank in range(2):
        _equal(loaded[rank]["weights"], uninterrupted[rank]["saved_params"], f"rank {rank} weights")
        _equal(loaded[rank]["raw_weights"], uninterrupted[rank]["saved_params"], f"rank {rank} load_raw")
        _equal(loaded[rank]["inference_weights"], uninterrupted[rank]["saved_params"], f"rank {rank} no optimizer")
        assert loaded[rank]["inference_remainder_keys"] == ["note", "scheduler"]
        assert loaded[rank]["optimizer_state"] == 0, "a weights-only load must leave the optimizer as it was"
        assert loaded[rank]["remainder_keys"] == ["note", "scheduler", "step"]
        # fabric.load(path) gives every mode back whole in the layout fabric.save was given (Fabric's DDP's).
        assert {"model", "optimizer", "step", "note"} <= set(loaded[rank]["whole_keys"])
        assert "state_dict" not in loaded[rank]["whole_keys"]


def test_checkpoint_reads_whole_in_lightning_format(directory: str) -> None:
    path, uninterrupted = saved(2, "sharded", directory)
    content = read_lightning_checkpoint(path)
    _equal({k: v for k, v in content["state_dict"].items() if k in uninterrupted[0]["saved_params"]},
           uninterrupted[0]["saved_params"], "read whole")
    assert content["step"] == SAVE_AT
    assert len(content["optimizer_states"]) == 1


def test_filter_saves_only_what_it_keeps(tmp_path: Path) -> None:
    """Without an optimizer the save is the plain file Fabric's DDP writes: the state's keys as given."""
    path = str(tmp_path / "filtered.ckpt")
    run_distributed(run_filtered_save, 2, replace(CASE, strategy="zero2"), path, start_method="forkserver")
    content = torch.load(path, weights_only=True)
    assert list(content) == ["model", "step"]
    assert sorted(content["model"]) == ["head.bias", "head.weight"]
    assert content["step"] == 1


def test_bad_save_input_fails_on_every_rank_before_any_collective(tmp_path: Path) -> None:
    errors = run_distributed(run_bad_saves, 2, str(tmp_path / "bad.ckpt"), start_method="forkserver")
    assert errors[0] == errors[1]
    two_modules, other_optimizer, foreign, not_plain, unpicklable = errors[0]
    assert "exactly one module" in two_modules
    assert "is not an optimizer of state['model']" in other_optimizer
    assert "is not an optimizer of state['model']" in foreign
    assert "weights_only" in not_plain and "NotPlain" in not_plain
    assert unpicklable.startswith("TypeError")
    assert not (tmp_path / "bad.ckpt").exists()


def test_strict_load_names_the_missing_key_and_strict_false_leaves_it(directory: str) -> None:
    path, _ = saved(2, "sharded", directory)
    for result in run_distributed(run_strict_load, 2, path, start_method="forkserver"):
        assert "'absent'" in result["strict_error"] and "strict=False" in result["strict_error"]
        assert result["absent"] == 7
        assert result["remainder_keys"] == ["note", "scheduler", "step"]


def test_strict_false_loads_a_checkpoint_with_only_some_weights(tmp_path: Path) -> None:
    """A checkpoint saved with ``filter`` (the head only) into a module set up with its optimizer:
    ``strict=True`` names what is missing; ``strict=False`` loads the head and keeps the rest."""
    path = str(tmp_path / "filtered.ckpt")
    run_distributed(run_filtered_save, 2, replace(CASE, strategy="zero2"), path, start_method="forkserver")
    saved = torch.load(path, weights_only=True)["model"]  # the plain file Fabric's DDP writes
    for result in run_distributed(run_load_filtered, 2, path, True, start_method="forkserver"):
        assert result["outcome"].startswith("KeyError") and "missing keys" in result["outcome"], result["outcome"]
    for rank, result in enumerate(run_distributed(run_load_filtered, 2, path, False, start_method="forkserver")):
        assert result["outcome"] == "loaded", result["outcome"]
        for name, value in result["after"].items():
            expected = saved[name] if name in saved else result["before"][name]
            assert torch.equal(value, expected.to(value.dtype)), f"rank {rank}: {name}"
        assert any(not torch.equal(result["before"][name], saved[name]) for name in saved)


@pytest.mark.parametrize("mode", MODES)
def test_lightning_zero_convert_writes_a_fabric_checkpoint_as_the_file_fabric_s_ddp_writes(mode: str, directory: str,
                                                                                       tmp_path: Path) -> None:
    """``convert`` reads what fabric.save wrote, in every mode, into the single file Fabric's DDP writes: the
    weights saved under the state's key of the module, the optimizer state under its key, the other values."""
    from lightning_zero.checkpoint import convert

    path, uninterrupted = saved(2, mode, directory)
    out = convert(path, str(tmp_path / f"{mode}-converted.ckpt"))
    content = torch.load(out, map_location="cpu", weights_only=True)
    saved_params = uninterrupted[0]["saved_params"]
    _equal({k: v for k, v in content["model"].items() if k in saved_params}, saved_params, f"{mode} converted")
    assert content["step"] == SAVE_AT and "state_dict" not in content
    assert content["optimizer"]["state"], "the converted file holds the optimizer state"


def test_fabric_save_builds_its_tree_with_the_collector_paused(
        tmp_path: Path, in_process_trainer_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: the collector and a save's objects] in checkpoint/saver.py: ``fabric.save`` builds its tree with the
    collector paused (its objects live until the save's job ends); the collector is on again once the save is done."""
    import gc

    from lightning.fabric import Fabric

    import lightning_zero.fabric as zero_fabric
    from lightning_zero import ZeroCheckpointIO

    seen = []
    fabric_tree = zero_fabric.fabric_tree

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(gc.isenabled())
        return fabric_tree(*args, **kwargs)

    monkeypatch.setattr(zero_fabric, "fabric_tree", recording)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=zero_fabric.ZeroLowLevelStrategy(stage=2),
                    plugins=[ZeroCheckpointIO(mode="local", async_save=True)])
    fabric.launch()
    model = torch.nn.Linear(4, 2)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    fabric.backward(model(torch.randn(3, 4)).sum())
    optimizer.step()
    fabric.save(tmp_path / "c.ckpt", {"model": model, "optimizer": optimizer})
    fabric.strategy.teardown()  # Fabric never calls it: the save is finalized here
    assert seen == [False]
    assert gc.isenabled()
