"""The trainer-state blob and the functional resume: loaded on CPU, never unpickling arbitrary
objects; one call restores a fresh engine."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_distributed
from checkpoint_cases import SAVED_AT_STEP, TOTAL_STEPS, build, gather_full_state, params, train

from lightning_zero.checkpoint import (
    CheckpointCorruptError,
    convert,
    load_zero_state_dict,
    save,
    zero_state_dict,
)
from lightning_zero.checkpoint.trainer_state import read_trainer_state, trainer_state_blob


class RunsCode:
    """A pickle that creates a file when unpickled: proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.marker, "w"))




@pytest.mark.parametrize("mode", ["local", "sharded"])
def test_a_crafted_trainer_state_never_runs_and_says_the_file_is_refused(one_rank: None, tmp_path: Path,
                                                                         mode: str) -> None:
    proof = tmp_path / "code-ran"
    model, engine = build(0, 1)
    train(model, engine, range(1), 0, 1)
    tree = zero_state_dict(engine, model)
    tree["trainer"] = trainer_state_blob({"epoch": 0, "hyper_parameters": {"evil": RunsCode(str(proof))}})
    path = str(tmp_path / f"{mode}.ckpt")
    save(tree, path, mode=mode)
    fresh_model, fresh = build(0, 1, perturb=1.0)
    # The name pickle gives `open` is the interpreter's (io.open up to Python 3.11, _io.open from 3.12).
    opener = re.escape(f"{open.__module__}.{open.__qualname__}")
    with pytest.raises(CheckpointCorruptError, match=rf"trainer state .* holds {opener}.*weights_only=True"):
        load_zero_state_dict(fresh, fresh_model, path)
    with pytest.raises(CheckpointCorruptError, match=r"weights_only=True"):
        convert(path, str(tmp_path / "out.ckpt"))
    assert not proof.exists(), "the crafted pickle ran"


def test_trainer_state_loads_on_cpu() -> None:
    blob = trainer_state_blob({"callbacks": {"ModelCheckpoint": {"best_model_score": torch.tensor(0.5)}}})
    state = read_trainer_state(blob, "x")
    assert state["callbacks"]["ModelCheckpoint"]["best_model_score"].device.type == "cpu"


def resume_in_one_call(rank: int, world_size: int, root: str, mode: str) -> dict[str, Any]:
    model, engine = build(rank, world_size)
    train(model, engine, range(SAVED_AT_STEP), rank, world_size)
    save(zero_state_dict(engine, model), f"{root}/step.ckpt", mode=mode)
    saved = gather_full_state(engine)
    train(model, engine, range(SAVED_AT_STEP, TOTAL_STEPS), rank, world_size)
    uninterrupted = params(model)
    fresh_model, fresh = build(rank, world_size, perturb=1.0)  # no optimizer state yet, other weights
    load_zero_state_dict(fresh, fresh_model, f"{root}/step.ckpt")
    loaded = gather_full_state(fresh)
    train(fresh_model, fresh, range(SAVED_AT_STEP, TOTAL_STEPS), rank, world_size)
    return {"saved": saved, "loaded": loaded, "uninterrupted": uninterrupted, "resumed": params(fresh_model)}


@pytest.mark.parametrize("mode", ["local", "sharded", "full"])
def test_functional_resume_restores_a_fresh_engine_in_one_call(tmp_path: Path, mode: str) -> None:
    from checkpoint_cases import assert_same_state

    for rank, result in enumerate(run_distributed(resume_in_one_call, 2, str(tmp_path), mode,
                                                  start_method="forkserver")):
        assert_same_state(result["loaded"], result["saved"], f"rank {rank}")
        for name, value in result["uninterrupted"].items():
            assert torch.equal(result["resumed"][name], value), f"rank {rank}: {name}"
    assert os.listdir(tmp_path)


def test_a_full_tree_is_a_snapshot_of_what_the_fence_does_not_hold() -> None:
    """A ``full`` save is written in the background while training goes on; only the parameters are held
    still until staged. A callback's averaged weights (SWA, EMA) and hook-added tensors change in place
    after the save was queued: the tree must hold their values at the save (a resumed SWA run once
    differed from DDP's because the averages of a later epoch reached the file)."""
    from lightning.fabric.utilities.data import AttributeDict

    from lightning_zero.checkpoint.lightning.lightning_tree import build_tree

    module = torch.nn.Linear(3, 2)
    average = torch.ones(2, 3)
    added = torch.zeros(2)
    checkpoint = {
        "state_dict": {**module.state_dict(), "ema.weight": added},
        "callbacks": {"StochasticWeightAveraging": {"average_model_state": {"weight": average}, "n_averaged": 2}},
        "hyper_parameters": AttributeDict(lr=0.1),
        "global_step": 4,
    }
    tree = build_tree(checkpoint, module, None, "full")
    average.add_(1.0)
    added.add_(1.0)
    saved_average = tree["callbacks"]["StochasticWeightAveraging"]["average_model_state"]["weight"]
    assert torch.equal(saved_average, torch.ones(2, 3))
    assert torch.equal(tree["state_dict"]["ema.weight"], torch.zeros(2))
    assert isinstance(tree["hyper_parameters"], AttributeDict) and tree["hyper_parameters"].lr == 0.1
    # The module's parameters are the fenced state: the tree holds them themselves, no copy.
    assert tree["state_dict"]["weight"].data_ptr() == module.weight.data_ptr()
