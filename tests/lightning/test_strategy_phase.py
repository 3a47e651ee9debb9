"""ZeroLowLevelStrategy's phases (lightning_zero/strategy_phase.py, [Note: the strategy's phases]) through the
Trainer in this process: which phase each of Lightning's runs leaves it in, the resume that sets it up before
``setup``, and the clear errors of a strategy used where it cannot be."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroCheckpointIO, ZeroLowLevelStrategy
from lightning_zero.strategy_phase import Lifecycle, Phase


class _Module(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 2)
        self.phases: dict[str, Phase] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).square().mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.phases.setdefault("validation_step", _phase(self.trainer))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.phases["on_load_checkpoint"] = _phase(self.trainer)

    def on_fit_start(self) -> None:
        self.phases["on_fit_start"] = _phase(self.trainer)


def _phase(trainer: Trainer) -> Phase:
    return trainer.strategy._lifecycle.phase  # type: ignore[attr-defined]


def _data() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(4, 3)), batch_size=2)


def _trainer(tmp_path: Path, strategy: ZeroLowLevelStrategy, **args: Any) -> Trainer:
    args = {"max_steps": 2, **args}
    return Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path), **args)


def test_fit_validate_and_a_resumed_fit_move_through_the_phases(tmp_path: Path,
                                                                 in_process_trainer_group: None) -> None:
    strategy = ZeroLowLevelStrategy(checkpoint_io=ZeroCheckpointIO(mode="sharded", async_save=False))
    trainer = _trainer(tmp_path, strategy)
    module = _Module()
    assert _phase(trainer) is Phase.IDLE
    trainer.fit(module, _data())
    assert module.phases == {"on_fit_start": Phase.FITTING}
    assert _phase(trainer) is Phase.FITTED and strategy._engine is not None  # kept for trainer.save_checkpoint
    path = tmp_path / "after-fit.ckpt"
    trainer.save_checkpoint(path)
    trainer.validate(module, _data())
    assert module.phases["validation_step"] is Phase.IDLE and strategy._engine is None

    resumed = _Module()
    again = _trainer(tmp_path, ZeroLowLevelStrategy(), max_steps=3)
    again.fit(resumed, _data(), ckpt_path=str(path))
    # The resume set the module up before `setup` ([Note: restore before on_fit_start]); setup built nothing again.
    assert resumed.phases == {"on_load_checkpoint": Phase.RESUMING, "on_fit_start": Phase.FITTING}
    assert again.global_step == 3 and _phase(again) is Phase.FITTED


def test_a_run_started_from_inside_a_running_fit_is_a_clear_error(tmp_path: Path,
                                                                   in_process_trainer_group: None) -> None:
    # Before the error, the nested run's setup closed the fit's engine under it, and it failed later, elsewhere.
    class ValidatesInside(Callback):
        def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
            trainer.validate(pl_module, _data())

    trainer = _trainer(tmp_path, ZeroLowLevelStrategy(), callbacks=[ValidatesInside()])
    with pytest.raises(RuntimeError, match=r"setup cannot run while this strategy instance is fitting a model: .*"
                                           r"Create one ZeroLowLevelStrategy per Trainer"):
        trainer.fit(_Module(), _data())
    assert _phase(trainer) is Phase.FITTED  # torn down


def test_grad_norm_outside_a_fit_is_a_clear_error(tmp_path: Path, in_process_trainer_group: None) -> None:
    trainer = _trainer(tmp_path, ZeroLowLevelStrategy())
    trainer.fit(_Module(), _data())
    with pytest.raises(RuntimeError, match=r"grad_norm reads the gradient shards of a `fit` in progress"):
        trainer.strategy.grad_norm()  # type: ignore[attr-defined]


def test_a_fit_that_fails_while_resuming_is_torn_down_and_the_next_fit_sets_up_again() -> None:
    lifecycle = Lifecycle()
    lifecycle.enter(Phase.RESUMING, "load_checkpoint")
    lifecycle.enter(Phase.FITTED, "teardown")  # Lightning tears a failed fit down
    lifecycle.enter(Phase.FITTING, "setup")
    with pytest.raises(RuntimeError, match="ZeroLowLevelStrategy.load_checkpoint cannot run while .* is fitting"):
        lifecycle.enter(Phase.RESUMING, "load_checkpoint")
    assert lifecycle.phase is Phase.FITTING  # a refused move changes nothing
