"""``reduce_dtype``: gradients of bf16 parameters summed in fp32, on both stages.

The ground truth is plain PyTorch: each rank's slice of the batch through a bf16 copy of the
model (computed in the worker, so the kernels are the same single-threaded ones), the slices'
bf16 gradients summed in fp32 and divided by the world size. With ``reduce_dtype="float32"``
the engine's fp32 shard gradients equal it exactly (two ranks: the sum has one addition, so no
ordering question); summing in bf16 (the default) does not, which shows the setting is live.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from _dist import run_distributed
from engine_cases import run_reduce_dtype

from lightning_zero import ZeroConfig

WORLD_SIZE = 2


@functools.cache
def results(reduce_dtype: str | None, stage: int) -> list[dict[str, Any]]:
    return run_distributed(run_reduce_dtype, WORLD_SIZE, reduce_dtype, stage, start_method="forkserver")


def fp32_mean_of_slices(slice_grads: list[dict[str, torch.Tensor | None]], fqn: str) -> torch.Tensor | None:
    grads = [g[fqn] for g in slice_grads if g[fqn] is not None]
    if not grads:
        return None
    total = torch.zeros_like(grads[0], dtype=torch.float32)
    for g in grads:
        total += g.float()
    return (total * (1.0 / WORLD_SIZE)).reshape(-1)


def mismatches(result: dict[str, Any]) -> list[str]:
    bad = []
    for fqn, (shard, start, end) in result["shards"].items():
        expected = fp32_mean_of_slices(result["slice_grads"], fqn)
        if expected is None:
            if shard is not None:
                bad.append(f"{fqn}: gradient where no slice had one")
            continue
        if shard is None or not torch.equal(shard, expected[start:end]):
            bad.append(fqn)
    return bad


@pytest.mark.parametrize("stage", [1, 2])
def test_float32_reduction_of_bf16_gradients_equals_the_fp32_sum_of_pytorch_slices(stage: int) -> None:
    for rank, result in enumerate(results("float32", stage)):
        assert mismatches(result) == [], f"rank {rank}"


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_reduction_differs_from_the_fp32_sum(stage: int) -> None:
    assert any(mismatches(result) for result in results(None, stage))


def test_reduce_dtype_accepts_a_dtype_name_and_rejects_integers() -> None:
    assert ZeroConfig(reduce_dtype="float32").reduce_dtype is torch.float32
    assert ZeroConfig(reduce_dtype="torch.bfloat16").reduce_dtype is torch.bfloat16
    with pytest.raises(ValueError, match="'float33' is not a torch dtype"):
        ZeroConfig(reduce_dtype="float33")
    with pytest.raises(ValueError, match="floating-point dtype, got torch.int32"):
        ZeroConfig(reduce_dtype=torch.int32)
