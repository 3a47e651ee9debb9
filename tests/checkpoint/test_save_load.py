"""The functional checkpoint layer on local disk: round trips of every mode, the layout, async semantics.

Multi-rank cases run in one gloo group per world size (``checkpoint_cases.round_trip``); the
async semantics run in this process with one rank and a writer or stager made slow on purpose.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_distributed
from checkpoint_cases import MODES, assert_same_state, local_save_collectives, round_trip

from lightning_zero.checkpoint import (
    FlatShard,
    async_save,
    load,
    maybe_finalize_async_calls,
    read_mode,
    remove,
    save,
    wait_for_staging,
)
from lightning_zero.checkpoint.runtime.staging import Stager
from lightning_zero.checkpoint.store import file_io, storage

WORLD_SIZE = 2


@pytest.fixture(autouse=True)
def _nothing_left_in_flight() -> Any:
    yield
    maybe_finalize_async_calls(blocking=True)


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


# ---- async semantics, one rank in this process ---------------------------------------------


def small_tree(value: float) -> dict[str, Any]:
    return {
        "model": {"w": FlatShard(torch.full((10,), value), (10,), 0, 1), "b": torch.full((3,), value)},
        "meta": {"step": 7, "betas": [0.9, 0.99]},
    }


def values(tree: dict[str, Any]) -> tuple[float, float]:
    return tree["model"]["w"].local.unique().item(), tree["model"]["b"].unique().item()


class Gate:
    """Holds a background step until released (with a deadline, so a bug cannot hang the suite)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()

    def wrap(self, fn: Any) -> Any:
        def gated(*args: Any, **kwargs: Any) -> Any:
            self.entered.set()
            assert self.released.wait(30), "gate never released"
            return fn(*args, **kwargs)

        return gated


@pytest.mark.parametrize("mode", ["local", "full"])
def test_async_save_returns_before_the_data_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       mode: str) -> None:
    gate = Gate()
    monkeypatch.setattr(file_io, "write_file", gate.wrap(file_io.write_file))
    path = tmp_path / "ckpt"
    async_save(small_tree(1.0), str(path), mode=mode)
    assert gate.entered.wait(10)
    assert not path.exists()  # no commit marker / file while the writer is held
    assert maybe_finalize_async_calls(blocking=False) is False
    gate.released.set()
    assert maybe_finalize_async_calls(blocking=True) is True
    loaded = small_tree(0.0)
    load(loaded, str(path))
    assert values(loaded) == (1.0, 1.0)


def test_wait_for_staging_blocks_until_the_tensors_are_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate()
    monkeypatch.setattr(Stager, "stage", gate.wrap(Stager.stage))
    async_save(small_tree(1.0), str(tmp_path / "ckpt"), mode="local")
    waiter = threading.Thread(target=wait_for_staging)
    waiter.start()
    assert gate.entered.wait(10)
    time.sleep(0.2)
    assert waiter.is_alive(), "wait_for_staging returned before staging"
    gate.released.set()
    waiter.join(10)
    assert not waiter.is_alive()


@pytest.mark.parametrize("mode", ["local", "full"])
def test_tensors_changed_after_staging_do_not_reach_the_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   mode: str) -> None:
    gate = Gate()
    monkeypatch.setattr(file_io, "write_file", gate.wrap(file_io.write_file))
    tree = small_tree(1.0)
    async_save(tree, str(tmp_path / "ckpt"), mode=mode)
    wait_for_staging()  # returns although the writer is still held
    assert not gate.released.is_set()
    tree["model"]["w"].local.fill_(99.0)  # what an optimizer step does to the live state
    tree["model"]["b"].fill_(99.0)
    gate.released.set()
    maybe_finalize_async_calls(blocking=True)
    loaded = small_tree(0.0)
    load(loaded, str(tmp_path / "ckpt"))
    assert values(loaded) == (1.0, 1.0)


def test_a_second_save_finalizes_the_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate()
    monkeypatch.setattr(file_io, "write_file", gate.wrap(file_io.write_file))
    async_save(small_tree(1.0), str(tmp_path / "first"), mode="local")
    second = threading.Thread(target=async_save, args=(small_tree(2.0), str(tmp_path / "second")),
                              kwargs={"mode": "local"})
    second.start()
    time.sleep(0.2)
    assert second.is_alive(), "the second save did not wait for the first"
    gate.released.set()
    second.join(10)
    maybe_finalize_async_calls(blocking=True)
    for name, expected in (("first", 1.0), ("second", 2.0)):
        loaded = small_tree(0.0)
        load(loaded, str(tmp_path / name))
        assert values(loaded) == (expected, expected)


def test_remove_queued_during_a_save_runs_after_its_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old, new = tmp_path / "old.ckpt", tmp_path / "new.ckpt"
    save(small_tree(1.0), str(old), mode="local")
    gate = Gate()
    monkeypatch.setattr(file_io, "write_file", gate.wrap(file_io.write_file))
    async_save(small_tree(2.0), str(new), mode="local")
    remove(str(old))  # what ModelCheckpoint does right after starting the newer save
    time.sleep(0.2)
    assert old.exists() and (tmp_path / "_zero_data" / "old.ckpt").exists(), "removed before the newer commit"
    gate.released.set()
    maybe_finalize_async_calls(blocking=True)
    assert new.exists()
    deadline = time.monotonic() + 10  # the removal runs in the background, after the commit
    while (old.exists() or (tmp_path / "_zero_data" / "old.ckpt").exists()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not old.exists() and not (tmp_path / "_zero_data" / "old.ckpt").exists()
    loaded = small_tree(0.0)
    load(loaded, str(new))
    assert values(loaded) == (2.0, 2.0)


@pytest.mark.parametrize("mode", ["local", "full"])
def test_saving_under_an_existing_name_replaces_it_and_keeps_one_version(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "last.ckpt"
    save(small_tree(1.0), str(path), mode=mode)
    save(small_tree(2.0), str(path), mode=mode)
    loaded = small_tree(0.0)
    content = load(loaded, str(path))
    assert values(loaded) == (2.0, 2.0)
    assert content["meta"] == {"step": 7, "betas": [0.9, 0.99]}
    if mode == "local":
        assert len(list((tmp_path / "_zero_data" / "last.ckpt").iterdir())) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == (["_zero_data", "last.ckpt"] if mode == "local"
                                                          else ["last.ckpt"])
