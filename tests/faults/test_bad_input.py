"""Bad input during training: a non-finite loss on one rank stops every rank at that step with an
error naming it (``ZeroLowLevelStrategy(nonfinite_loss="raise")``), before backward spreads the NaN."""

from __future__ import annotations

import pytest
from fault_cases import NaNOnRank1
from lightning.pytorch import Trainer
from lightning_cases import loader

from lightning_zero import ZeroLowLevelStrategy


def test_an_unknown_nonfinite_loss_policy_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"nonfinite_loss must be 'ignore' or 'raise', got 'skip'"):
        ZeroLowLevelStrategy(nonfinite_loss="skip")  # type: ignore[arg-type]


def test_a_nan_loss_on_one_rank_stops_training_naming_the_step_and_the_rank() -> None:
    trainer = Trainer(
        accelerator="cpu", devices=2, max_steps=4, logger=False, enable_checkpointing=False,
        use_distributed_sampler=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=ZeroLowLevelStrategy(stage=2, start_method="forkserver", nonfinite_loss="raise"),
    )
    module = NaNOnRank1()
    with pytest.raises(Exception, match=r"training loss is not finite at global step 1 on rank\(s\) \[1\]"):
        trainer.fit(module, loader(4, 1, 2))
