"""The functional checkpoint layer on local disk: round trips of every mode, the layout, a name saved
twice. Multi-rank cases run in one gloo group per world size (``checkpoint_cases.round_trip``); when a
save runs, and what may change meanwhile, is tests/checkpoint/runtime/test_scheduler.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_distributed
from checkpoint_cases import (
    MODES,
    assert_same_state,
    local_save_collectives,
    round_trip,
    small_tree,
    small_tree_values,
)

from lightning_zero.checkpoint import load, read_mode, save
from lightning_zero.checkpoint.store import storage

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("round_trip")
    return root, run_distributed(round_trip, WORLD_SIZE, str(root), start_method="forkserver")


@pytest.mark.parametrize("mode", MODES)
def test_load_restores_master_weights_and_optimizer_state_exactly(round_trips: Any, mode: str) -> None:
    _, results = round_trips
    for rank, result in enumerate(results):
        saved = result["saved"]
        # Guard against a vacuous comparison: Adam state exists, and the fresh engine started
        # from other weights and another learning rate.
        assert {"exp_avg", "exp_avg_sq", "step"} <= set(saved["state"]["embed.weight"])
        assert_same_state(result[mode]["loaded"], saved, f"{mode}, rank {rank}")


@pytest.mark.parametrize("mode", MODES)
def test_loaded_model_holds_the_saved_weights(round_trips: Any, mode: str) -> None:
    # Every parameter, including frozen ones that the optimizer holds but never updates.
    _, results = round_trips
    for rank, result in enumerate(results):
        for fqn, value in result["saved"]["master"].items():
            assert torch.equal(result[mode]["loaded_params"][fqn], value), f"{mode}, rank {rank}: {fqn}"


@pytest.mark.parametrize("mode", MODES)
def test_resumed_training_equals_the_uninterrupted_run(round_trips: Any, mode: str) -> None:
    _, results = round_trips
    for rank, result in enumerate(results):
        for fqn, value in result["uninterrupted"].items():
            assert torch.equal(result[mode]["resumed"][fqn], value), f"{mode}, rank {rank}: {fqn}"


def test_layout_is_a_marker_with_versioned_data_or_one_file(round_trips: Any) -> None:
    # [Note: checkpoint layout] in storage.py.
    root, _ = round_trips
    for mode in ("local", "sharded"):
        marker = storage.read_marker(storage.resolve(str(root / f"{mode}.ckpt")))
        assert marker["format"] == "lightning_zero" and marker["mode"] == mode
        assert marker["world_size"] == WORLD_SIZE
        versions = list((root / "_zero_data" / f"{mode}.ckpt").iterdir())
        assert [v.name for v in versions] == [marker["data"].rsplit("/", 1)[-1]]
        files = sorted(f.name for f in versions[0].iterdir())
        if mode == "local":
            assert files == ["rank00000-of-00002.pt", "rank00001-of-00002.pt"]
        else:
            assert {".metadata", "objects.pt"} < set(files) and any(f.endswith(".distcp") for f in files)
        assert read_mode(str(root / f"{mode}.ckpt")) == mode
    assert (root / "full.ckpt").read_bytes()[:2] == b"PK"  # an ordinary torch.save zip file
    assert read_mode(str(root / "full.ckpt")) == "full"
    assert not (root / "_zero_data" / "full.ckpt").exists()


def test_local_save_makes_no_collective_on_the_training_thread(tmp_path: Path) -> None:
    # Counted after a warm-up save: the first save of a process creates the gloo coordination
    # group with new_group, a collective, once (the strategy does it at setup instead).
    for rank, calls in enumerate(run_distributed(local_save_collectives, WORLD_SIZE, str(tmp_path),
                                                 start_method="forkserver")):
        assert calls["main"] == [], f"rank {rank}"
        # The counter works: the commit is coordinated by the background thread.
        assert "all_gather_object" in calls["background"], f"rank {rank}"


@pytest.mark.parametrize("mode", ["local", "full"])
def test_saving_under_an_existing_name_replaces_it_and_keeps_one_version(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "last.ckpt"
    save(small_tree(1.0), str(path), mode=mode)
    save(small_tree(2.0), str(path), mode=mode)
    loaded = small_tree(0.0)
    content = load(loaded, str(path))
    assert small_tree_values(loaded) == (2.0, 2.0)
    assert content["meta"] == {"step": 7, "betas": [0.9, 0.99]}
    if mode == "local":
        assert len(list((tmp_path / "_zero_data" / "last.ckpt").iterdir())) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == (["_zero_data", "last.ckpt"] if mode == "local"
                                                          else ["last.ckpt"])
