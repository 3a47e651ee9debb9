"""Hybrid sharding (``shard_group_size``): 4 ranks as 2 x 2, 1 x 4 and 4 x 1 equal plain PyTorch.

Notation: replicas x shard group size. Every case of every layout runs in one 4-rank spawn.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import pytest
import torch
from _dist import run_distributed
from engine_cases import Case, initial_model, run_reference_with_state
from hybrid_cases import run_hybrid_cases

from lightning_zero import ZeroConfig, ZeroLowLevelStrategy
from lightning_zero.engine.sharding import EvenShard, HybridLayout, check_shard_group_size

WORLD_SIZE = 4
LAYOUTS = {"2x2": 2, "1x4": 4, "4x1": 1}

BASE: dict[str, Case] = {
    "adamw": Case(optimizer="adamw"),
    "sgd-momentum": Case(optimizer="sgd"),
    "clip-norm": Case(clip_norm=0.05),
    "accumulate": Case(accumulate=2),
    # The branch runs on rank 0 only (shard group 0, replica 0): every rank must still update it.
    "branch-on-rank0-only": Case(optimizer="sgd", branch_slices=(0,)),
    # The branch runs on rank 3 only, in micro-batch 0 of each step (shard group 1 under 2x2).
    "accumulate-branch-rank3": Case(optimizer="sgd", accumulate=2, branch_slices=(3,),
                                    skip_branch_at=((0, 1), (1, 1), (2, 1), (3, 1))),
    "branch-skipped-everywhere": Case(optimizer="sgd", skip_branch_at=((2, 0),)),
    "native-reduce-scatter": Case(optimizer="sgd", accumulate=2, native_reduce_scatter=True,
                                  skip_branch_at=((1, 1), (2, 0), (2, 1))),
    "no-overlap": Case(overlap=False, overlap_param_gather=False),
    "everything": Case(optimizer="adam", accumulate=2, clip_norm=0.05, scheduler=True),
}

CASES: dict[str, Case] = {
    f"{layout}-{name}-stage{stage}": replace(case, stage=stage, shard_group_size=size)
    for layout, size in LAYOUTS.items() for name, case in BASE.items() for stage in (1, 2)
}
INITIAL = {n: p.detach().clone() for n, p in initial_model().named_parameters()}


@functools.cache
def results() -> list[dict[str, Any]]:
    return run_distributed(run_hybrid_cases, WORLD_SIZE, CASES, start_method="forkserver")


@functools.cache
def reference(name: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    return run_reference_with_state(WORLD_SIZE, CASES[name])


@pytest.mark.parametrize("name", CASES)
def test_parameters_match_single_process_pytorch(name: str) -> None:
    expected, _ = reference(name)
    for rank, result in enumerate(results()):
        for fqn, value in expected.items():
            torch.testing.assert_close(result[name]["params"][fqn], value, atol=1e-6, rtol=1e-5,
                                       msg=lambda m, r=rank, f=fqn: f"rank {r}, {f}: {m}")


@pytest.mark.parametrize("name", CASES)
def test_all_ranks_hold_identical_parameters_and_masters_equal_their_slice(name: str) -> None:
    ranks = results()
    for rank in range(WORLD_SIZE):
        assert ranks[rank][name]["masters_match"], rank
        for fqn, value in ranks[0][name]["params"].items():
            assert torch.equal(ranks[rank][name]["params"][fqn], value), f"rank {rank} differs in {fqn}"


@pytest.mark.parametrize("name", CASES)
def test_optimizer_state_exists_for_exactly_the_parameters_pytorch_steps(name: str) -> None:
    _, expected_names = reference(name)
    for rank, result in enumerate(results()):
        # A rank holding no element of a parameter (``scale`` on most ranks) has no state for it.
        assert set(result[name]["state_names"]) <= set(expected_names), rank
    union = sorted({n for result in results() for n in result[name]["state_names"]})
    assert union == expected_names


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dropped_and_frozen_layers_are_bit_identical_to_init(layout: str) -> None:
    for result in results():
        for fqn in ("dropped.weight", "dropped.bias", "frozen.weight", "frozen.bias"):
            assert torch.equal(result[f"{layout}-adamw-stage2"]["params"][fqn], INITIAL[fqn]), fqn


@pytest.mark.parametrize("layout", ["2x2", "4x1"])
def test_branch_used_on_one_rank_of_one_shard_group_is_trained_everywhere(layout: str) -> None:
    for result in results():
        for name in ("branch-on-rank0-only", "accumulate-branch-rank3"):
            weight = result[f"{layout}-{name}-stage2"]["params"]["branch.weight"]
            assert not torch.equal(weight, INITIAL["branch.weight"]), name


@pytest.mark.parametrize(("layout", "size"), LAYOUTS.items())
def test_shard_numel_is_the_even_split_within_the_shard_group(layout: str, size: int) -> None:
    numels = [p.numel() for p in initial_model().parameters()]
    ranks = results()
    for rank, result in enumerate(ranks):
        expected = sum(EvenShard(n, size).shard_numel(rank % size) for n in numels)
        assert result[f"{layout}-adamw-stage2"]["shard_numel"] == expected, rank
    # Each shard group holds one whole copy.
    for group in HybridLayout(WORLD_SIZE, size).shard_groups():
        assert sum(ranks[r][f"{layout}-adamw-stage2"]["shard_numel"] for r in group) == sum(numels)


def test_shard_group_size_that_does_not_divide_the_world_fails_on_every_rank_with_the_choices() -> None:
    for rank, result in enumerate(results()):
        for size in (3, WORLD_SIZE + 1):
            message = result["errors"][size]
            assert f"shard_group_size={size} does not divide the world size 4" in message, rank
            assert "[1, 2, 4]" in message, rank
        assert result["after_error"] == WORLD_SIZE  # no collective was left half-entered


@pytest.mark.parametrize("size", [0, -2, 1.5, True])
def test_shard_group_size_below_one_fails_at_construction(size: Any) -> None:
    with pytest.raises(ValueError, match="shard_group_size must be an int >= 1 or None"):
        ZeroConfig(shard_group_size=size)
    with pytest.raises(ValueError, match="shard_group_size must be an int >= 1 or None"):
        ZeroLowLevelStrategy(shard_group_size=size)


def test_strategy_keeps_the_shard_group_size() -> None:
    assert ZeroLowLevelStrategy(stage=1, shard_group_size=8).zero_config.shard_group_size == 8
    assert ZeroLowLevelStrategy().zero_config.shard_group_size is None


def test_hybrid_layout_groups() -> None:
    layout = HybridLayout(8, 4)
    assert layout.shard_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.replica_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [layout.shard_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [layout.replica_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert HybridLayout(6, 6).is_flat and HybridLayout(6, 6).num_replicas == 1
    with pytest.raises(ValueError, match=r"Valid choices at world size 6: \[1, 2, 3, 6\]"):
        check_shard_group_size(4, 6)


TRAINER_CASE = Case(optimizer="adamw", steps=3, accumulate=2, clip_norm=0.05, scheduler=True)


@functools.cache
def trainer_fit() -> dict[str, Any]:
    from lightning.pytorch import Trainer
    from lightning_cases import NetModule, ZeroProbe, loader

    module = NetModule(TRAINER_CASE.optimizer, scheduler=True)
    trainer = Trainer(
        accelerator="cpu", devices=WORLD_SIZE, max_epochs=1, accumulate_grad_batches=TRAINER_CASE.accumulate,
        strategy=ZeroLowLevelStrategy(stage=2, bucket_size_mb=0.0005, shard_group_size=2,
                                      start_method="forkserver"),  # type: ignore[arg-type]
        gradient_clip_val=TRAINER_CASE.clip_norm, use_distributed_sampler=False, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[ZeroProbe()],
    )
    trainer.fit(module, loader(TRAINER_CASE.steps, TRAINER_CASE.accumulate, WORLD_SIZE))
    probe = {k.removeprefix("probe/"): v for k, v in trainer.callback_metrics.items() if k.startswith("probe/")}
    net: Any = module.net  # type: ignore[union-attr]
    return {"params": {n: p.detach().clone() for n, p in net.named_parameters()}, "probe": probe}


def test_trainer_2x2_with_clipping_accumulation_and_scheduler_matches_pytorch() -> None:
    from engine_cases import run_reference

    result = trainer_fit()
    expected = run_reference(WORLD_SIZE, TRAINER_CASE)
    for fqn, value in expected.items():
        torch.testing.assert_close(result["params"][fqn], value, atol=1e-6, rtol=1e-5,
                                   msg=lambda m, f=fqn: f"{f}: {m}")
    assert result["probe"]["rank_param_spread"].item() == 0.0
    numels = [p.numel() for p in initial_model().parameters()]
    assert result["probe"]["shard_numels"].tolist() == [
        sum(EvenShard(n, 2).shard_numel(rank % 2) for n in numels) for rank in range(WORLD_SIZE)]
