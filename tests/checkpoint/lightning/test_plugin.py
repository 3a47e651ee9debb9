"""ZeroCheckpointIO (checkpoint/lightning/plugin.py), the Lightning plugin in this process: its options
checked at construction with messages that name the fix, what it does with a checkpoint the strategy did
not build, ``async_save``, and a repr without credentials. Through the Trainer it is tested everywhere
else (tests/lightning/, tests/checkpoint/lightning/)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero import LocalTier, ZeroCheckpointIO
from lightning_zero.checkpoint import FlatShard, read_mode
from lightning_zero.checkpoint.lightning.entry import link_of
from lightning_zero.checkpoint.store import file_io
from lightning_zero.checkpoint.trainer_state import TREE_TAG

pytestmark = pytest.mark.usefixtures("saves_finalized")  # tests/conftest.py


def test_bad_checkpoint_mode_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"one of \('local', 'sharded', 'full'\), got 'fast'"):
        ZeroCheckpointIO(mode="fast")  # type: ignore[arg-type]


def test_persist_every_needs_a_local_tier_and_a_mode_the_tier_keeps() -> None:
    with pytest.raises(ValueError, match="needs a local_tier"):
        ZeroCheckpointIO(persist_every=5)
    with pytest.raises(ValueError, match="persist_every=0"):
        ZeroCheckpointIO(local_tier=LocalTier("/tmp/x"), persist_every=0)
    with pytest.raises(ValueError, match="mode='sharded' or 'local'"):
        ZeroCheckpointIO(mode="full", local_tier=LocalTier("/tmp/x"))


def test_a_local_tier_given_as_a_path_is_refused_naming_the_class() -> None:
    with pytest.raises(TypeError, match=r"must be a lightning_zero\.checkpoint\.LocalTier, got str"):
        ZeroCheckpointIO(local_tier="/tmp/x")  # type: ignore[arg-type]


def test_repr_hides_storage_options() -> None:
    io = ZeroCheckpointIO(storage_options={"key": "AKIA-SECRET", "secret": "s3cr3t"})
    assert "s3cr3t" not in repr(io) and "AKIA" not in repr(io)


def test_a_checkpoint_the_strategy_did_not_build_is_one_plain_file_written_at_once_and_claimed(
        tmp_path: Path) -> None:
    """Lightning's spawn launcher hands the main process its weights through the plugin: an ordinary
    ``torch.save`` file, there when the call returns; its name is taken until the plugin removes it."""
    io = ZeroCheckpointIO(mode="sharded")
    path = tmp_path / "weights.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, path)
    assert path.is_file() and not (tmp_path / "_zero_data").exists()
    assert io.load_checkpoint(path)["state_dict"]["w"].tolist() == [1.0, 1.0]
    assert link_of(io).is_claimed(path) and link_of(io).is_claimed(f"{path}/")
    io.remove_checkpoint(path)
    assert io.finalize() is True
    assert not path.exists() and not link_of(io).is_claimed(path)


@pytest.mark.parametrize("async_save", [True, False])
def test_async_save_returns_with_the_save_in_flight_and_without_it_committed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool) -> None:
    write_file = file_io.write_file

    def slow_write(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.5)
        return write_file(*args, **kwargs)

    monkeypatch.setattr(file_io, "write_file", slow_write)
    io = ZeroCheckpointIO(mode="local", async_save=async_save)
    tree = {TREE_TAG: "local", "model": {"w": FlatShard(torch.ones(4), (4,), 0, 1)}}  # tagged by the strategy
    io.save_checkpoint(tree, tmp_path / "step.ckpt")
    assert io.finalize(blocking=False) is (not async_save)
    io.finalize()
    assert read_mode(str(tmp_path / "step.ckpt")) == "local"


def test_the_plugins_public_methods_are_the_ones_a_user_calls() -> None:
    """The API reference lists the plugin's public members: what the strategies alone call is on its
    StrategyLink ([Note: the plugin's two faces] in checkpoint/lightning/plugin.py)."""
    public = {name for name in vars(ZeroCheckpointIO) if not name.startswith("_")}
    assert public == {"save_checkpoint", "load_checkpoint", "remove_checkpoint", "teardown", "finalize",
                      "last_save_stats"}
    io = ZeroCheckpointIO()
    assert link_of(io) is link_of(io)  # one link per plugin: every front end sees the same claims and placement
