"""The data position survives a change of world size (lightning_zero/data.py).

The sampler alone: the same global order and split as ``DistributedSampler``; after a resume at M ranks the
rest of the epoch's order split over M. Through the Trainer: an epoch interrupted on 2 ranks and resumed on 3
(and on 1, and on 2) trains on every sample id exactly once, and a same-size resume sees what the
uninterrupted run sees, rank by rank.
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from _dist import run_distributed
from data_cases import BATCH, SAMPLES, Ids, fit_ids
from torch.utils.data import DistributedSampler

from lightning_zero.data import ElasticDistributedSampler


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("shuffle", [True, False])
def test_the_order_and_split_are_distributed_samplers(world_size: int, shuffle: bool) -> None:
    for rank in range(world_size):
        ours = ElasticDistributedSampler(Ids(), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=4)
        theirs = DistributedSampler(Ids(), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=4)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


@pytest.mark.parametrize(("before", "after", "steps_before"), [(2, 3, 3), (3, 2, 2), (4, 1, 1), (2, 2, 2), (1, 4, 2)])
def test_a_resume_at_another_world_size_takes_the_rest_of_the_order_once(before: int, after: int,
                                                                          steps_before: int) -> None:
    consumed = steps_before * BATCH * before
    seen: list[int] = []
    for rank in range(before):
        sampler = ElasticDistributedSampler(Ids(), num_replicas=before, rank=rank, seed=1)
        sampler.set_epoch(5)
        seen += list(sampler)[: steps_before * BATCH]
    for rank in range(after):
        sampler = ElasticDistributedSampler(Ids(), num_replicas=after, rank=rank, seed=1)
        sampler.resume_at(5, consumed)
        sampler.set_epoch(5)  # Lightning sets the epoch again: the position stays
        rest = list(sampler)
        assert len(rest) == sampler.remaining() == (SAMPLES - consumed) // after
        assert len(sampler) == SAMPLES // after  # the whole epoch's, as DistributedSampler's
        seen += rest
    assert sorted(seen) == list(range(SAMPLES))


def test_a_rest_that_does_not_divide_is_padded_by_its_first_samples_as_distributed_sampler_pads() -> None:
    consumed = 8  # 16 left over 3 ranks: 6 each, 2 samples twice
    order = ElasticDistributedSampler(Ids(), num_replicas=1, rank=0, seed=1).global_order()
    seen = []
    for rank in range(3):
        sampler = ElasticDistributedSampler(Ids(), num_replicas=3, rank=rank, seed=1)
        sampler.resume_at(0, consumed)
        seen += list(sampler)
    assert len(seen) == 18 and set(seen) == set(order[consumed:])
    assert sorted(i for i, n in Counter(seen).items() if n == 2) == sorted(order[consumed:consumed + 2])


def test_a_new_epoch_starts_from_its_first_sample() -> None:
    sampler = ElasticDistributedSampler(Ids(), num_replicas=2, rank=0)
    sampler.resume_at(0, 12)
    sampler.set_epoch(1)
    assert sampler.start == 0 and sampler.remaining() == len(sampler) == SAMPLES // 2


def test_a_position_beyond_the_dataset_is_refused() -> None:
    with pytest.raises(ValueError, match="another dataset"):
        ElasticDistributedSampler(Ids(), num_replicas=2, rank=0).resume_at(0, SAMPLES + 1)


# -- through the Trainer ----------------------------------------------------------------------------------

STEPS_BEFORE = 3  # saved at step 3: 3 steps x 2 samples x 2 ranks = 12 of 24 samples


@functools.cache
def interrupted(root: str) -> list[dict[str, Any]]:
    """Trains one step past the save at step 3 (lost, as in a job killed after it); ``seen`` is cut at the save."""
    results = run_distributed(fit_ids, 2, root, "interrupted", STEPS_BEFORE + 1, None, start_method="forkserver")
    return [{**result, "seen": result["seen"][: STEPS_BEFORE * BATCH]} for result in results]


def _resumed(root: str, world_size: int) -> list[dict[str, Any]]:
    path = interrupted(root)[0]["path"]
    return run_distributed(fit_ids, world_size, root, f"resumed-{world_size}", -1, path, start_method="forkserver")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("data-position"))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3, 1, 2])
def test_an_epoch_interrupted_on_two_ranks_and_resumed_on_another_number_sees_each_sample_once(
        root: str, world_size: int) -> None:
    before = [i for result in interrupted(root) for i in result["seen"]]
    assert len(before) == STEPS_BEFORE * BATCH * 2
    resumed = _resumed(root, world_size)
    after = [i for result in resumed for i in result["seen"]]
    counts = Counter(before + after)
    assert sorted(counts) == list(range(SAMPLES)) and set(counts.values()) == {1}, counts
    assert all(result["epoch"] == 1 for result in resumed)  # the epoch ended; no second epoch began


@pytest.mark.slow
def test_a_same_size_resume_sees_what_the_uninterrupted_run_sees(root: str, tmp_path: Path) -> None:
    whole = run_distributed(fit_ids, 2, str(tmp_path), "whole", -1, None, start_method="forkserver")
    resumed = _resumed(root, 2)
    for rank in range(2):
        assert interrupted(root)[rank]["seen"] + resumed[rank]["seen"] == whole[rank]["seen"], f"rank {rank}"
