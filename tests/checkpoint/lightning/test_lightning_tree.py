"""Lightning's checkpoint dict and the ZeRO tree (checkpoint/lightning/lightning_tree.py): what
``build_tree`` writes for each mode (the module's own tensors as they are, whatever the hooks replaced or
added as copies, what they removed left out; the optimizer state only when Lightning asked for it; the
trainer's part as one blob), and the functional resume that reads such a tree into a fresh engine."""

from __future__ import annotations

import copy
import gc
import os
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_distributed
from checkpoint_cases import (
    SAVED_AT_STEP,
    TOTAL_STEPS,
    assert_same_state,
    build,
    gather_full_state,
    params,
    train,
)
from torch import nn

from lightning_zero.checkpoint import load_zero_state_dict, save, zero_state_dict
from lightning_zero.checkpoint.formats.tree import StableDict
from lightning_zero.checkpoint.lightning.lightning_tree import build_tree
from lightning_zero.checkpoint.trainer_state import MARKER_FIELDS, TREE_TAG, read_trainer_state

# ---- save: the tree ----------------------------------------------------------------------------


def test_a_full_tree_is_a_snapshot_of_what_the_fence_does_not_hold() -> None:
    """A ``full`` save is written in the background while training goes on; only the parameters are held
    still until staged. A callback's averaged weights (SWA, EMA) and hook-added tensors change in place
    after the save was queued: the tree must hold their values at the save (a resumed SWA run once
    differed from DDP's because the averages of a later epoch reached the file)."""
    from lightning.fabric.utilities.data import AttributeDict

    module = nn.Linear(3, 2)
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


def test_a_sharded_tree_holds_the_state_dict_as_the_hooks_left_it() -> None:
    """[Note: what a checkpoint holds]: a hook dropped ``0.weight`` (LoRA's frozen base), replaced ``1.bias``
    and added ``ema.weight``; without an engine (a save outside fit) the weights are the module's own."""
    module = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    state_dict = module.state_dict()
    del state_dict["0.weight"]
    state_dict["1.bias"] = torch.full((1,), 5.0)
    state_dict["ema.weight"] = torch.zeros(2)
    trainer_part = {"epoch": 1, "global_step": 4, "loops": {"fit_loop": {"n": 4}}}
    tree = build_tree({"state_dict": state_dict, **trainer_part}, module, None, "sharded")
    params_by_name = dict(module.named_parameters())
    assert sorted(tree["model"]) == ["0.bias", "1.bias", "1.weight", "ema.weight"]
    for own in ("0.bias", "1.weight"):  # the module's tensors themselves, no copy
        assert tree["model"][own].data_ptr() == params_by_name[own].data_ptr()
    state_dict["ema.weight"].add_(1.0)  # the callback goes on changing its tensor after the save was queued
    assert torch.equal(tree["model"]["ema.weight"], torch.zeros(2)) and tree["model"]["1.bias"].item() == 5.0
    assert "optimizer" not in tree and tree[TREE_TAG] == "sharded"
    assert read_trainer_state(tree["trainer"], "x") == trainer_part
    assert tree[MARKER_FIELDS] == {"epoch": 1, "global_step": 4}


@pytest.mark.parametrize("mode", ["sharded", "full"])
def test_the_optimizer_state_is_in_the_tree_only_when_lightning_saved_it(one_rank: None, mode: str) -> None:
    model, engine = build(0, 1)
    train(model, engine, range(1), 0, 1)
    with_optimizer = {"state_dict": model.state_dict(), "optimizer_states": [{}], "global_step": 1}
    weights_only = {"state_dict": model.state_dict(), "global_step": 1}  # ModelCheckpoint(save_weights_only)
    key = "optimizer" if mode == "sharded" else "optimizer_states"
    assert key in build_tree(with_optimizer, model, engine, mode)
    assert key not in build_tree(weights_only, model, engine, mode)
    engine.close()


def test_the_optimizer_state_is_the_same_subtree_while_its_tensors_are_the_same_objects(one_rank: None) -> None:
    """[Note: stable subtrees]: a save's tree keeps each optimizer's state object across saves while the optimizer
    updates its tensors in place; a tensor replaced, a state entry added or a load gives a new subtree, equal to
    the one built afresh. Without ``stable`` every call builds its own."""
    model, engine = build(0, 1)
    train(model, engine, range(1), 0, 1)
    opt = engine.optimizers[0]

    def state() -> Any:
        return zero_state_dict(engine, model, stable=True)["optimizer"][0]["state"]

    def fresh() -> dict[str, dict[str, Any]]:
        return {fqn: {k: (v.local if hasattr(v, "local") else v) for k, v in entry.items()}
                for fqn, entry in zero_state_dict(engine, model)["optimizer"][0]["state"].items()}

    def same_tensors(tree: Any) -> bool:
        live = fresh()
        return tree.keys() == live.keys() and all(
            (v.local if hasattr(v, "local") else v) is live[fqn][k] for fqn, entry in tree.items() for k, v in entry.items())

    first = state()
    assert isinstance(first, StableDict) and same_tensors(first)
    assert zero_state_dict(engine, model)["optimizer"][0]["state"] is not zero_state_dict(engine, model)["optimizer"][0]["state"]
    train(model, engine, range(1, 2), 0, 1)  # AdamW updates its moments and step in place
    assert state() is first
    sp = next(iter(opt.sharded_params))
    opt.state[sp.master]["exp_avg"] = opt.state[sp.master]["exp_avg"].clone()
    replaced = state()
    assert replaced is not first and same_tensors(replaced) and state() is replaced
    replaced["probe"] = None  # a probe (the kept tree is for reading only): the next tree is a new one
    with torch.no_grad():
        opt.state[sp.master]["exp_avg"].resize_(3)  # the same tensor, another shape
    resized = state()
    assert "probe" not in resized and same_tensors(resized)
    opt.state[sp.master]["exp_avg"] = torch.zeros_like(sp.master)

    # A load replaces the state: the tensors kept for the saves are let go with it.
    old = weakref.ref(opt.state[sp.master]["exp_avg_sq"])
    del first, replaced, resized  # the test's own references to the kept trees
    state()
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    gc.collect()
    assert old() is None
    assert same_tensors(state())

    # A value that could change inside (a list): the state is built afresh at every save.
    opt.state[sp.master]["history"] = [1]
    assert type(state()) is dict and state() is not state()
    engine.close()
    assert opt.save_cache is None


def test_the_model_part_is_the_same_subtree_until_a_hook_edits_it_or_a_parameter_moves(one_rank: None) -> None:
    """[Note: stable subtrees]: the ``model`` part of a ``local``/``sharded`` tree is the previous save's object
    while Lightning's ``state_dict`` holds the module's own tensors and the parameters are where they were; a
    value a hook replaced, or a parameter given another shape, gives a tree built afresh (the hook's value copied)."""
    model, engine = build(0, 1)
    assert not list(model.buffers())  # a module with persistent buffers copies them at each save: never kept
    train(model, engine, range(1), 0, 1)

    def model_part(state_dict: dict[str, Any]) -> Any:
        return build_tree({"state_dict": state_dict, "optimizer_states": [{}], "global_step": 1}, model, engine,
                          "local")["model"]

    first = model_part(model.state_dict())
    assert isinstance(first, StableDict) and model_part(model.state_dict()) is first
    key = next(iter(model.state_dict()))
    edited = model_part({**model.state_dict(), key: torch.zeros_like(model.state_dict()[key])})
    assert type(edited) is dict and torch.equal(edited[key], torch.zeros_like(model.state_dict()[key]))
    assert model_part(model.state_dict()) is first
    sp = next(sp for sp in engine.sharded_params.values() if sp.param.dim() == 2)
    shape = tuple(sp.param.shape)
    sp.param.data = sp.param.data.view(shape[::-1])  # the same storage, another shape
    reshaped = model_part(model.state_dict())
    assert reshaped is not first and reshaped[sp.fqn].shape == shape[::-1]
    sp.param.data = sp.param.data.view(shape)
    engine.rebuild()
    rebuilt = model_part(model.state_dict())
    assert rebuilt is not first and rebuilt[sp.fqn].local is not first[sp.fqn].local
    engine.close()


def test_a_save_s_value_comparison_reads_the_parameters_it_holds_now(one_rank: None) -> None:
    """The views a value comparison keeps across saves (``grad_bucket.OwnViews``) follow a parameter's writes in
    place, and a parameter given new storage (``p.data = ...``) is read from its new storage."""
    model, engine = build(0, 1)
    sp = next(iter(engine.sharded_params.values()))
    engine.adopt_module_writes(compare_values=True)
    with torch.no_grad():
        sp.param.data.fill_(3.0)  # no version bump: found by comparing values
    engine.adopt_module_writes(compare_values=True)
    assert torch.equal(sp.master, torch.full_like(sp.master, 3.0))
    sp.param.data = torch.full_like(sp.param, 5.0)
    engine.adopt_module_writes(compare_values=True)
    assert torch.equal(sp.master, torch.full_like(sp.master, 5.0))
    engine.close()


# ---- load: the functional resume -------------------------------------------------------------------


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
    for rank, result in enumerate(run_distributed(resume_in_one_call, 2, str(tmp_path), mode,
                                                  start_method="forkserver")):
        assert_same_state(result["loaded"], result["saved"], f"rank {rank}")
        for name, value in result["uninterrupted"].items():
            assert torch.equal(result["resumed"][name], value), f"rank {rank}: {name}"
    assert os.listdir(tmp_path)
