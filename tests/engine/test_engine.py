"""ZeroEngine equivalence: N gloo ranks of ZeRO-1/2 against one process of plain PyTorch.

Every case for one world size runs in a single spawn (``run_cases``): starting processes is
the slow part on 2 CPU cores. The assertions are parametrized over the cases.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import pytest
import torch
from _dist import run_distributed
from engine_cases import (
    BALANCE_SIZES,
    Case,
    initial_model,
    run_balance,
    run_cases,
    run_reference_with_state,
)

from lightning_zero.engine.sharding import EvenShard

WORLD_SIZES = (1, 2, 3)


def _both_stages(name: str, case: Case) -> dict[str, Case]:
    return {f"{name}-stage1": replace(case, stage=1), f"{name}-stage2": replace(case, stage=2)}


CASES: dict[str, Case] = {
    **_both_stages("sgd-momentum", Case(optimizer="sgd")),
    **_both_stages("adam", Case(optimizer="adam")),
    **_both_stages("adamw", Case(optimizer="adamw")),
    **_both_stages("scheduler", Case(optimizer="sgd", scheduler=True)),
    **_both_stages("clip-norm", Case(clip_norm=0.05)),
    **_both_stages("clip-value", Case(optimizer="sgd", clip_value=0.01)),
    **_both_stages("accumulate", Case(accumulate=2)),
    # The branch is taken on rank 0 only in micro-batch 0 and on no rank in micro-batch 1:
    # stage 1 must keep the locally accumulated gradient, stage 2 the reduced shard.
    **_both_stages("accumulate-branch-once", Case(optimizer="sgd", accumulate=2, skip_branch_at=((1, 1), (2, 1)))),
    # No rank takes the branch in step 2: it must not move although it has momentum.
    **_both_stages("branch-skipped-everywhere", Case(optimizer="sgd", skip_branch_at=((2, 0),))),
    **_both_stages("no-overlap", Case(overlap=False)),
    **_both_stages("no-gather-overlap", Case(overlap_param_gather=False)),
    # Gradients summed in float64 under fp32 parameters: equal to PyTorch within fp32 tolerance.
    # NCCL's path (reduce-scatter, for stage 1 too), with accumulation and a branch skipped everywhere.
    **_both_stages("native-reduce-scatter", Case(optimizer="sgd", accumulate=2, native_reduce_scatter=True,
                                                 skip_branch_at=((1, 1), (2, 0), (2, 1)))),
    # NCCL's all-gather path (gloo otherwise gathers by broadcasts), gathers overlapped and not.
    **_both_stages("native-all-gather", Case(optimizer="adam", native_all_gather=True)),
    **_both_stages("native-all-gather-in-step", Case(optimizer="adam", native_all_gather=True,
                                                     overlap_param_gather=False)),
    **_both_stages("reduce-float64", Case(optimizer="adam", reduce_dtype="float64", accumulate=2)),
    **_both_stages("one-bucket", Case(bucket_size_mb=64.0)),
    # Gradient shards are freed by zero_grad and taken again by the next reduction ([Note: gradient
    # shards between steps]): steps without zero_grad must still add to what the last one left.
    **_both_stages("zero-grad-every-other-step", Case(optimizer="sgd", accumulate=2, zero_grad_every=2)),
    **_both_stages("zero-grad-keeps-storage", Case(set_to_none=False, clip_norm=0.05)),
    **_both_stages("everything", Case(optimizer="adam", accumulate=2, clip_norm=0.05, scheduler=True)),
}

PARAMS = [pytest.param(ws, name, id=f"ws{ws}-{name}") for ws in WORLD_SIZES for name in CASES]
INITIAL = {n: p.detach().clone() for n, p in initial_model().named_parameters()}


@functools.cache
def zero_results(world_size: int) -> list[dict[str, dict[str, Any]]]:
    """Per rank, per case: what ``run_zero`` returned."""
    return run_distributed(run_cases, world_size, CASES, start_method="forkserver")


@functools.cache
def reference(world_size: int, name: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    return run_reference_with_state(world_size, CASES[name])


@pytest.mark.parametrize(("world_size", "name"), PARAMS)
def test_parameters_match_single_process_pytorch(world_size: int, name: str) -> None:
    expected, _ = reference(world_size, name)
    for rank, result in enumerate(zero_results(world_size)):
        for fqn, value in expected.items():
            torch.testing.assert_close(result[name]["params"][fqn], value, atol=1e-6, rtol=1e-5,
                                       msg=lambda m, r=rank, f=fqn: f"rank {r}, {f}: {m}")


@pytest.mark.parametrize(("world_size", "name"), PARAMS)
def test_all_ranks_hold_identical_parameters(world_size: int, name: str) -> None:
    results = zero_results(world_size)
    for rank in range(1, world_size):
        for fqn, value in results[0][name]["params"].items():
            assert torch.equal(results[rank][name]["params"][fqn], value), f"rank {rank} differs in {fqn}"


@pytest.mark.parametrize(("world_size", "name"), PARAMS)
def test_master_shards_equal_parameter_slices(world_size: int, name: str) -> None:
    assert all(result[name]["masters_match"] for result in zero_results(world_size))


@pytest.mark.parametrize(("world_size", "name"), PARAMS)
@pytest.mark.parametrize("layer", ["dropped", "frozen"])
def test_layer_without_gradient_is_bit_identical_to_init(world_size: int, name: str, layer: str) -> None:
    # No update and no weight decay; the non-zero ranks started from other weights, so this
    # also shows that rank 0's weights were broadcast.
    for result in zero_results(world_size):
        for suffix in ("weight", "bias"):
            fqn = f"{layer}.{suffix}"
            assert torch.equal(result[name]["params"][fqn], INITIAL[fqn]), fqn


@pytest.mark.parametrize(("world_size", "name"), PARAMS)
def test_optimizer_state_exists_for_exactly_the_parameters_pytorch_steps(world_size: int, name: str) -> None:
    _, expected_names = reference(world_size, name)
    assert not any(n.startswith(("dropped.", "frozen.")) for n in expected_names)
    for result in zero_results(world_size):
        assert result[name]["state_names"] == expected_names


@pytest.mark.parametrize("world_size", [2, 3])
def test_branch_used_on_some_ranks_only_is_trained(world_size: int) -> None:
    # Rank 0 takes the branch, the last rank never does: the update must still happen.
    params = zero_results(world_size)[-1]["adamw-stage2"]["params"]
    assert not torch.equal(params["branch.weight"], INITIAL["branch.weight"])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_training_moves_every_used_parameter(world_size: int) -> None:
    # Guards the equivalence tests against a case in which nothing trains.
    params = zero_results(world_size)[0]["adamw-stage2"]["params"]
    used = ["embed.weight", "embed.bias", "hidden.weight", "head.weight", "scale"]
    for fqn in used:
        assert (params[fqn] - INITIAL[fqn]).abs().max() > 1e-3, fqn


@pytest.mark.parametrize("name", ["clip-norm-stage2", "clip-value-stage2"])
def test_clipping_cases_actually_clip(name: str) -> None:
    clipped, _ = reference(2, name)
    unclipped, _ = run_reference_with_state(2, replace(CASES[name], clip_norm=None, clip_value=None))
    assert any(not torch.allclose(clipped[n], unclipped[n], atol=1e-4) for n in clipped)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_shard_numel_is_the_even_split_of_every_optimized_parameter(world_size: int) -> None:
    numels = [p.numel() for p in initial_model().parameters()]
    results = zero_results(world_size)
    for rank, result in enumerate(results):
        expected = sum(EvenShard(n, world_size).shard_numel(rank) for n in numels)
        assert result["adamw-stage2"]["shard_numel"] == expected
    assert sum(r["adamw-stage2"]["shard_numel"] for r in results) == sum(numels)


@functools.cache
def balance() -> list[dict[str, Any]]:
    return run_distributed(run_balance, 8, start_method="forkserver")


def test_balance_no_rank_is_empty_with_five_parameters_on_eight_ranks() -> None:
    shard_numels = [r["shard_numel"] for r in balance()]
    assert min(shard_numels) > 0, shard_numels
    assert sum(shard_numels) == sum(BALANCE_SIZES)
    # Every rank holds a share of every parameter larger than the world.
    for rank, result in enumerate(balance()):
        assert all(n > 0 for n, size in zip(result["per_param"], BALANCE_SIZES, strict=True) if size >= 8 * 7), rank


def test_balance_busiest_rank_holds_at_most_num_params_above_the_mean() -> None:
    mean = sum(BALANCE_SIZES) / 8
    shard_numels = [r["shard_numel"] for r in balance()]
    assert max(shard_numels) <= mean + len(BALANCE_SIZES), shard_numels


@pytest.mark.xfail(strict=True, reason=(
    "The torch.chunk split of DESIGN.md puts all of a parameter's padding (up to ws-1 elements)"
    " on its trailing ranks, so rank 7 holds 640 elements against a mean of 650.6: 10.6 below,"
    " more than the 5 the issue's balance criterion allows. The busiest rank is within bounds."
))
def test_balance_every_rank_within_num_params_of_the_mean() -> None:
    mean = sum(BALANCE_SIZES) / 8
    shard_numels = [r["shard_numel"] for r in balance()]
    assert all(abs(n - mean) <= len(BALANCE_SIZES) for n in shard_numels), (shard_numels, mean)


def test_balance_adam_state_per_rank_matches_the_shard() -> None:
    for rank, result in enumerate(balance()):
        assert result["state_numel"] == {"exp_avg": result["shard_numel"], "exp_avg_sq": result["shard_numel"]}, rank
