"""Every Lightning checkpoint habit with ZeRO checkpoints, through the Trainer (DESIGN.md, Lifecycle).

Runs on ranks that stay alive between Trainer calls (tests/lifecycle_cases.py), the way a script
under torchrun calls ``fit`` and then ``save_checkpoint``/``validate``; evaluation from a
checkpoint runs in fresh processes at world sizes 1, 2 and 3.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_distributed
from lifecycle_cases import (
    STEPS,
    batchnorm_run,
    evaluate_from,
    fit_then_save_everywhere,
    lr_monitor_keys,
    reference_loss,
    staging_overlap,
)

MODES = ("local", "sharded", "full")
pytestmark = pytest.mark.slow


@functools.cache
def _lifecycle(mode: str, root: str) -> dict[str, Any]:
    return run_distributed(fit_then_save_everywhere, 2, root, mode, start_method="forkserver")[0]


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return lambda mode: (_lifecycle(mode, str(tmp_path_factory.getbasetemp() / f"life-{mode}")),
                         tmp_path_factory.getbasetemp() / f"life-{mode}")


def assert_equal_tensors(actual: Any, expected: Any, where: str) -> None:
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key in expected:
            assert_equal_tensors(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_equal_tensors(a, e, f"{where}/{i}")
    elif isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), where
    else:
        assert actual == expected, where


@pytest.mark.parametrize("mode", MODES)
def test_save_checkpoint_after_fit_holds_what_the_last_step_save_holds(lifecycle: Any, mode: str) -> None:
    result, _ = lifecycle(mode)
    last_step, after_fit = result["ckpts/last-step.ckpt"], result["after-fit.ckpt"]
    assert_equal_tensors(after_fit["state_dict"], result["weights"], "weights after fit")
    assert_equal_tensors(after_fit["state_dict"], last_step["state_dict"], "state_dict")
    assert_equal_tensors(after_fit["optimizer_states"], last_step["optimizer_states"], "optimizer_states")
    assert after_fit["optimizer_states"][0]["state"], "the optimizer state was saved"
    assert after_fit["global_step"] == last_step["global_step"] == STEPS
    assert_equal_tensors(after_fit["lr_schedulers"], last_step["lr_schedulers"], "lr_schedulers")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("after", ["validate", "test", "predict"])
def test_save_checkpoint_after_evaluation_holds_the_weights_only(lifecycle: Any, mode: str, after: str) -> None:
    result, _ = lifecycle(mode)
    saved = result[f"after-{after}.ckpt"]
    assert_equal_tensors(saved["state_dict"], result["weights"], "weights")
    assert not saved.get("optimizer_states"), "no optimizer exists outside fit"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_validate_test_predict_from_a_checkpoint_at_any_world_size(lifecycle: Any, tmp_path: Path, mode: str,
                                                                   world_size: int) -> None:
    result, root = lifecycle(mode)
    path = str(root / "after-fit.ckpt")
    ranks = run_distributed(evaluate_from, world_size, str(tmp_path), mode, path, start_method="forkserver")
    for rank, evaluated in enumerate(ranks):  # ranks that took .metadata from rank 0 as well
        assert_equal_tensors(evaluated["weights"], result["weights"], f"loaded weights, rank {rank}")
    evaluated = ranks[0]
    expected = reference_loss(result["weights"], world_size)
    assert evaluated["val_loss"] == pytest.approx(expected, rel=1e-6)
    assert evaluated["test_loss"] == pytest.approx(expected, rel=1e-6)
    assert evaluated["prediction"] is not None
    if mode == "sharded":  # validate, test, predict: one read each, by rank 0 for all
        assert [rank["metadata_opens"] for rank in ranks] == [3] + [0] * (world_size - 1)


@pytest.mark.parametrize("mode", ["local", "sharded", "full"])
def test_buffers_follow_rank_zero_like_ddp_and_checkpoints_hold_rank_zero_buffers(tmp_path: Path, mode: str) -> None:
    ranks = run_distributed(batchnorm_run, 2, str(tmp_path), mode, start_method="forkserver")
    # Every training step starts from rank 0's statistics on every rank ...
    assert torch.equal(ranks[0]["seen"], ranks[1]["seen"])
    # ... while each rank's own forward moves them apart (the data differ), as under DDP.
    assert not torch.equal(ranks[0]["final"], ranks[1]["final"])
    saved = ranks[0]["saved"]
    assert torch.equal(torch.cat([saved["bn.running_mean"], saved["bn.running_var"]]), ranks[0]["final"])


def test_learning_rate_monitor_logs_each_rate_once_under_the_users_optimizer(tmp_path: Path) -> None:
    keys = run_distributed(lr_monitor_keys, 2, str(tmp_path), start_method="forkserver")[0]
    assert keys and all(k.startswith("lr-AdamW") for k in keys), keys


def test_training_step_starts_before_staging_ends_and_the_update_waits_for_it(tmp_path: Path) -> None:
    delay = 0.4
    events = run_distributed(staging_overlap, 2, str(tmp_path), delay, start_method="forkserver")[0]
    saves = [i for i, (name, _) in enumerate(events) if name == "save"]
    assert len(saves) >= 2
    overlapped = 0
    for index in saves[:-1]:  # every save but the last has a training step after it
        later = events[index + 1:]
        step_start = next(t for name, t in later if name == "training_step")
        staged = next(t for name, t in later if name == "staged")
        updated = next(t for name, t in later if name == "updated")
        overlapped += step_start < staged
        assert updated >= staged, "the optimizer update must wait until the shards are staged"
    assert overlapped == len(saves) - 1, events
