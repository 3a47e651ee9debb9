"""Engine-level fp16 dynamic loss scaling on 2 CPU ranks: an inf on one rank skips the step
on every rank and backs off the scale everywhere (the found-inf flag is all-reduced)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from _dist import run_distributed
from engine_cases import reference_one_step, run_loss_scaling

WORLD_SIZE = 2
CLIP_NORM = 0.05
DTYPES = ["float32", "float16"]


@functools.cache
def results(dtype_name: str) -> list[dict[str, Any]]:
    return run_distributed(run_loss_scaling, WORLD_SIZE, dtype_name, CLIP_NORM, start_method="forkserver")


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_inf_on_one_rank_skips_the_step_on_every_rank(dtype_name: str) -> None:
    rank0, rank1 = results(dtype_name)
    assert rank0["local_grads_finite"], "rank 0 must have seen no inf itself"
    for rank, result in enumerate((rank0, rank1)):
        for fqn, value in result["initial"].items():
            assert torch.equal(result["after_skip"][fqn], value), f"rank {rank} updated {fqn}"
        assert result["state_after_skip"] == 0, f"rank {rank} created optimizer state in a skipped step"


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_inf_on_one_rank_backs_off_the_scale_on_every_rank(dtype_name: str) -> None:
    assert [r["scale_after_skip"] for r in results(dtype_name)] == [512.0, 512.0]
    assert [r["scale_after_clean"] for r in results(dtype_name)] == [512.0, 512.0]


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_clean_step_after_a_skip_updates_and_ranks_agree(dtype_name: str) -> None:
    rank0, rank1 = results(dtype_name)
    assert any(not torch.equal(rank0["after_clean"][n], v) for n, v in rank0["initial"].items())
    for fqn, value in rank0["after_clean"].items():
        assert torch.equal(rank1["after_clean"][fqn], value), fqn
    for result in (rank0, rank1):
        assert result["master_dtypes"] == ["torch.float32"]
        assert result["masters_match"]


def test_clean_scaled_step_equals_an_unscaled_pytorch_step() -> None:
    # fp32 parameters: scaling by a power of two is exact, so the skipped step must leave no
    # trace and the next one must be plain PyTorch's first (unscaled, globally clipped) step.
    expected = reference_one_step(WORLD_SIZE, step=1, clip_norm=CLIP_NORM)
    for rank, result in enumerate(results("float32")):
        for fqn, value in expected.items():
            torch.testing.assert_close(result["after_clean"][fqn], value, atol=1e-6, rtol=1e-5,
                                       msg=lambda m, r=rank, f=fqn: f"rank {r}, {f}: {m}")
