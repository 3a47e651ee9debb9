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


class _GroupTrainer:
    """What ModelCheckpoint's naming and save ask of a trainer, for one replica group's rank 0; its saves
    are skipped (another group writes) and recorded."""

    is_global_zero = True
    global_step = 5
    loggers: list[Any] = []

    def __init__(self, io: ZeroCheckpointIO) -> None:
        self.io = io
        self.saved: list[str] = []
        self.strategy = self

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 (Lightning's name)
        return decision

    def save_checkpoint(self, filepath: Any, weights_only: bool = False) -> None:
        link_of(self.io).claim(filepath)  # as ZeroLowLevelStrategy.save_checkpoint claims a skipped save
        self.saved.append(str(filepath))


@pytest.mark.parametrize("fault_tolerance", [True, False])
def test_a_group_names_its_last_save_from_the_jobs_history_not_from_files_another_group_wrote_since(
        tmp_path: Path, fault_tolerance: bool) -> None:
    """[Note: names under fault tolerance]: a group that joined by heal in the step in which the writer saved
    holds the callback's state from before that save; the writer's new `last.ckpt` then appears on disk. With
    fault tolerance the joiner still names its save `last.ckpt` (so it writes there once it becomes the
    writer); without it the name on disk is taken, as Lightning's own callback decides."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    (tmp_path / "epoch=0-step=2.ckpt").write_bytes(b"x")  # from before this group's setup
    io = ZeroCheckpointIO(mode="local")
    callback = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    link_of(io).count_claims_as_taken([callback], own_names_only=fault_tolerance)
    trainer = _GroupTrainer(io)
    (tmp_path / "last.ckpt").write_bytes(b"x")  # the writer group's save, after this group's setup
    callback._save_last_checkpoint(trainer, {})  # type: ignore[arg-type]
    expected = "last.ckpt" if fault_tolerance else "last-v1.ckpt"
    assert trainer.saved == [str(tmp_path / expected)] and callback.last_model_path == str(tmp_path / expected)

    callback._save_last_checkpoint(trainer, {})  # type: ignore[arg-type]  # the next save keeps its name
    assert trainer.saved[-1] == str(tmp_path / expected)
    exists = callback.file_exists
    assert exists(str(tmp_path / "epoch=0-step=2.ckpt"), trainer)  # on disk at setup and still
    assert not exists(str(tmp_path / "epoch=0-step=9.ckpt"), trainer)
    callback.best_k_models = {str(tmp_path / "epoch=0-step=4.ckpt"): torch.tensor(1.0)}  # a heal's state
    assert exists(str(tmp_path / "epoch=0-step=4.ckpt"), trainer) is fault_tolerance  # not on disk yet
    (tmp_path / "epoch=0-step=2.ckpt").unlink()  # removed by the writer (its top-k)
    assert not exists(str(tmp_path / "epoch=0-step=2.ckpt"), trainer)
