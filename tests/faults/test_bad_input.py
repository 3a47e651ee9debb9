"""Bad input during training: a non-finite loss on one rank stops every rank at that step with an
error naming it (``ZeroLowLevelStrategy(nonfinite_loss="raise")``), before backward spreads the NaN,
or, with ``nonfinite_loss="skip"``, skips that step's update on every rank."""

from __future__ import annotations

import pytest
import torch
from engine_cases import global_batch
from fault_cases import NaNOnRank1
from lightning.pytorch import Trainer
from lightning_cases import NetModule, loader
from torch.utils.data import DataLoader

from lightning_zero import ZeroLowLevelStrategy


def test_an_unknown_nonfinite_loss_policy_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"nonfinite_loss must be 'ignore', 'raise' or 'skip', got 'warn'"):
        ZeroLowLevelStrategy(nonfinite_loss="warn")  # type: ignore[arg-type]


def test_a_nan_loss_on_one_rank_stops_training_naming_the_step_and_the_rank() -> None:
    trainer = Trainer(
        accelerator="cpu", devices=2, max_steps=4, logger=False, enable_checkpointing=False,
        use_distributed_sampler=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=ZeroLowLevelStrategy(stage=2, start_method="forkserver", nonfinite_loss="raise"),
    )
    module = NaNOnRank1()
    with pytest.raises(Exception, match=r"training loss is not finite at global step 1 on rank\(s\) \[1\]"):
        trainer.fit(module, loader(4, 1, 2))


def _fit_weights(module: NetModule, batches: DataLoader, nonfinite_loss: str) -> dict[str, torch.Tensor]:
    trainer = Trainer(
        accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
        use_distributed_sampler=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=ZeroLowLevelStrategy(stage=2, start_method="forkserver", nonfinite_loss=nonfinite_loss),  # type: ignore[arg-type]
    )
    trainer.fit(module, batches)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_a_nan_loss_with_skip_leaves_that_step_out_on_every_rank() -> None:
    skipped = _fit_weights(NaNOnRank1(), loader(4, 1, 2), "skip")
    # The same training without batch 1: the skipped step changed no weight and no optimizer state.
    without = DataLoader([global_batch(step, 0, 2) for step in (0, 2, 3)], batch_size=None, shuffle=False)
    reference = _fit_weights(NetModule(), without, "ignore")
    assert skipped.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.isfinite(skipped[name]).all(), name
        assert torch.equal(skipped[name], value), name
