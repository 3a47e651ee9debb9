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
    assert {"ZeroLowLevelStrategy", "ZeroCheckpointIO", "register_optimizer", "LocalTier"} <= set(lightning_zero.__all__)
    import lightning_zero.checkpoint as checkpoint

    assert {"LocalTier", "TierLoad", "SaveStats"} <= set(checkpoint.__all__)
    assert checkpoint.LocalTier is lightning_zero.LocalTier


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


def test_plain_lightning_checkpoint_io_gets_one_full_file_from_rank_0(tmp_path):
    import torch
    from engine_cases import make_optimizer
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_cases import NetModule, loader

    trainer = Trainer(
        accelerator="cpu", devices=2, max_epochs=1, logger=False, use_distributed_sampler=False,
        strategy=ZeroLowLevelStrategy(stage=2, bucket_size_mb=0.0005, start_method="forkserver"),
        plugins=[TorchCheckpointIO()], callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="plain")],
        enable_progress_bar=False, enable_model_summary=False,
    )
    module = NetModule()
    trainer.fit(module, loader(2, 1, 2))
    checkpoint = torch.load(tmp_path / "plain.ckpt", weights_only=True)
    assert "lightning_zero" not in checkpoint  # an ordinary Lightning checkpoint
    # Gathered, full-size moments in PyTorch's per-parameter form (indices in param-group order),
    # which the same optimizer built without this package accepts.
    optimizer = make_optimizer("adamw", module.net)
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    state = checkpoint["optimizer_states"][0]["state"]
    assert len(state) > 0
    for index, moments in state.items():
        assert moments["exp_avg"].shape == ordered[index].shape
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    assert "net.dropped.weight" in checkpoint["state_dict"]
