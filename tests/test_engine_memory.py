"""Bounded memory of the engine's communication: at most MAX_IN_FLIGHT full-size bucket
buffers, reused from step to step, for the reductions of backward and the gathers of the step.

Before this bound, every bucket's gathered buffer lived until the last gather finished: the
step's peak grew by a whole copy of the parameters. The collectives are watched directly (which
storages they write) rather than through the process's RSS, which the allocator blurs.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from _dist import run_distributed
from engine_cases import run_memory_bounds

from lightning_zero.buckets import MAX_IN_FLIGHT

WORLD_SIZE = 2


@functools.cache
def results(stage: int) -> list[dict[str, Any]]:
    return run_distributed(run_memory_bounds, WORLD_SIZE, stage, start_method="forkserver")


@pytest.mark.parametrize("stage", [1, 2])
def test_gathers_and_reductions_reuse_at_most_max_in_flight_buffers(stage: int) -> None:
    for result in results(stage):
        assert result["buckets"] > 2 * MAX_IN_FLIGHT, "the model must have more buckets than buffers"
        assert result["gathers"] >= result["buckets"] and result["reductions"] >= result["buckets"]
        assert result["all_storages"] <= MAX_IN_FLIGHT, result


@pytest.mark.parametrize("stage", [1, 2])
def test_pool_stops_growing_after_the_first_step_and_holds_at_most_max_in_flight_buckets(stage: int) -> None:
    for result in results(stage):
        first, *later = result["pool_bytes"]
        assert all(b == first for b in later), result["pool_bytes"]
        assert first <= MAX_IN_FLIGHT * result["largest_bucket_bytes"]
        # Far less than a second copy of the parameters (the old step peak).
        assert first < result["param_bytes"]


@pytest.mark.parametrize("world_size", [1, 8, 64, 512, 1024])
def test_default_bucket_gives_every_rank_at_least_a_million_elements_and_keeps_ddp_floor(world_size: int) -> None:
    from lightning_zero import ZeroConfig

    numel = ZeroConfig().bucket_numel(world_size, element_size=2)
    assert numel // world_size >= 1_000_000
    assert numel >= 25 * 1024 * 1024 // 2
    assert ZeroConfig(bucket_size_mb=1.0).bucket_numel(world_size, element_size=2) == 512 * 1024
