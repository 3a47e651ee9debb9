"""The names DESIGN.md promises, importable and wired the way its examples use them."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer

import lightning_zero
from lightning_zero import ZeroCheckpointIO, ZeroLowLevelStrategy
from lightning_zero.checkpoint import async_save, load, maybe_finalize_async_calls


def test_design_example_imports_and_functional_verbs_exist():
    assert callable(async_save) and callable(load) and callable(maybe_finalize_async_calls)
    assert maybe_finalize_async_calls(blocking=True) is True  # nothing in flight
    assert {"ZeroLowLevelStrategy", "ZeroCheckpointIO"} <= set(lightning_zero.__all__)


@pytest.mark.parametrize("mode", ["local", "sharded", "full"])
def test_checkpoint_plugin_reaches_the_strategy_from_trainer_plugins(mode):
    trainer = Trainer(strategy="zero2", accelerator="cpu", devices=2, plugins=[ZeroCheckpointIO(mode=mode)],
                      logger=False)
    assert isinstance(trainer.strategy, ZeroLowLevelStrategy)
    assert trainer.strategy.checkpoint_io.mode == mode


def test_checkpoint_plugin_through_the_strategy_argument_and_default():
    io = ZeroCheckpointIO(mode="local", async_save=False)
    assert ZeroLowLevelStrategy(stage=1, checkpoint_io=io).checkpoint_io is io
    default = ZeroLowLevelStrategy().checkpoint_io
    assert isinstance(default, ZeroCheckpointIO) and default.mode == "sharded" and default.async_save


def test_bad_checkpoint_mode_is_a_clear_error():
    with pytest.raises(ValueError, match=r"one of \('local', 'sharded', 'full'\), got 'fast'"):
        ZeroCheckpointIO(mode="fast")  # type: ignore[arg-type]


def test_repr_hides_storage_options():
    io = ZeroCheckpointIO(storage_options={"key": "AKIA-SECRET", "secret": "s3cr3t"})
    assert "s3cr3t" not in repr(io) and "AKIA" not in repr(io)
