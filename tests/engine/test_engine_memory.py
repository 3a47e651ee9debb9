"""Bounded memory of the engine's communication: at most MAX_IN_FLIGHT full-size bucket
buffers, shared by the reductions of a backward and the gathers of its step, and none kept
between steps ([Note: pool between steps] in engine/comm_pool.py); and between steps, nothing but the
master shards and the optimizer state ([Note: gradient shards between steps] in engine/grad_bucket.py).

Before this bound, every bucket's gathered buffer lived until the last gather finished: the
step's peak grew by a whole copy of the parameters. The collectives are watched directly (which
storages they write) rather than through the process's RSS, which the allocator blurs.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from _dist import run_distributed
from engine_cases import run_memory_between_steps, run_memory_bounds

from lightning_zero.engine.comm_pool import MAX_IN_FLIGHT

WORLD_SIZE = 2


@functools.cache
def results(stage: int) -> list[dict[str, Any]]:
    return run_distributed(run_memory_bounds, WORLD_SIZE, stage, start_method="forkserver")


@pytest.mark.parametrize("stage", [1, 2])
def test_gathers_and_reductions_of_a_step_reuse_at_most_max_in_flight_buffers(stage: int) -> None:
    for result in results(stage):
        assert result["buckets"] > 2 * MAX_IN_FLIGHT, "the model must have more buckets than buffers"
        assert result["gathers"] >= result["buckets"] and result["reductions"] >= result["buckets"]
        assert all(0 < n <= MAX_IN_FLIGHT for n in result["storages_per_step"]), result


@pytest.mark.parametrize("stage", [1, 2])
def test_pool_holds_at_most_max_in_flight_buckets_during_a_step(stage: int) -> None:
    for result in results(stage):
        first, *later = result["pool_bytes"]
        assert all(b == first for b in later), result["pool_bytes"]
        assert 0 < first <= MAX_IN_FLIGHT * result["largest_bucket_bytes"]
        # Far less than a second copy of the parameters (the old step peak).
        assert first < result["param_bytes"]


@pytest.mark.parametrize("stage", [1, 2])
def test_no_communication_buffer_stays_allocated_between_steps(stage: int) -> None:
    # Once the step's gathers are in the parameters the pool is empty: between steps a rank holds
    # its model states only (it kept MAX_IN_FLIGHT largest buckets, more than DDP at 2 ranks).
    for result in results(stage):
        assert result["pool_bytes_between_steps"] == [0] * len(result["pool_bytes"]), result


@functools.cache
def between_steps(stage: int, set_to_none: bool, release: bool = True) -> list[dict[str, Any]]:
    return run_distributed(run_memory_between_steps, WORLD_SIZE, stage, set_to_none, release, start_method="forkserver")


TORCH_SCALARS_BYTES = 64
"""What Python can reach besides the engine's and the model's tensors: a few 0-dim tensors torch keeps."""


@pytest.mark.parametrize("stage", [1, 2])
def test_between_steps_a_rank_holds_only_master_shards_and_optimizer_state(stage: int) -> None:
    # Every tensor storage Python can reach, counted from the storages themselves after zero_grad:
    # no gradient shard (4 Psi / N, what DeepSpeed's ZeRO-2 frees after its step too) and no
    # communication slot; the master shards and AdamW's moments are all there.
    for result in between_steps(stage, True):
        for step in result["between"]:
            assert step["grad_shards_held"] == 0, step
            assert step["missing"] == 0, step
            assert step["unexpected_bytes"] <= TORCH_SCALARS_BYTES < step["grad_shard_bytes"] // 100, step


@pytest.mark.parametrize(("stage", "set_to_none", "release"), [(1, False, True), (2, False, True), (2, True, False)])
def test_zero_grad_keeping_storage_keeps_exactly_the_gradient_shards(stage: int, set_to_none: bool,
                                                                     release: bool) -> None:
    # set_to_none=False (as PyTorch keeps .grad) or ZeroConfig(release_grad_shards=False) keeps the zeroed
    # shards, and nothing else: the same count finds them, so it would find them after a set_to_none=True
    # that failed to free them.
    for result in between_steps(stage, set_to_none, release):
        for step in result["between"]:
            assert step["grad_shards_held"] == step["buckets"], step
            extra = step["unexpected_bytes"] - step["grad_shard_bytes"]
            assert 0 <= extra <= TORCH_SCALARS_BYTES, step


@pytest.mark.parametrize("element_size", [2, 4])
@pytest.mark.parametrize("world_size", [1, 8, 64, 128, 512, 1024])
def test_default_bucket_gives_every_rank_a_million_elements_up_to_a_byte_ceiling(world_size: int,
                                                                                 element_size: int) -> None:
    from lightning_zero import ZeroConfig

    mib = 1024 * 1024
    numel = ZeroConfig().bucket_numel(world_size, element_size)
    assert numel * element_size <= 256 * mib  # the pool's memory does not grow with the world
    assert numel * element_size >= 25 * mib  # DDP's default as the floor
    if 1_000_000 * world_size * element_size <= 256 * mib:
        assert numel // world_size >= 1_000_000
    else:
        assert numel * element_size == 256 * mib
    assert ZeroConfig(bucket_size_mb=1.0).bucket_numel(world_size, element_size=2) == 512 * 1024
    assert ZeroConfig(bucket_size_mb=1024.0).bucket_numel(world_size, element_size=2) == 512 * mib
