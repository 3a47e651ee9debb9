"""The data position survives a change of world size (lightning_zero/data.py).

The sampler alone: the same global order and split as ``DistributedSampler``; after a resume at M ranks the
rest of the epoch's order split over M. Through the Trainer: an epoch interrupted on 2 ranks and resumed on 3
(and on 1, and on 2) trains on every sample id exactly once, and a same-size resume sees what the
uninterrupted run sees, rank by rank. By default: a loader without a sampler of its own gets an
ElasticDistributedSampler from ZeroLowLevelStrategy and its position is kept without the callback, with
Lightning's "not resumable" warning left out; a user's own sampler is left alone.
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from _dist import run_distributed
from data_cases import BATCH, SAMPLES, Ids, RecordsIds, fit_ids
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from lightning_zero import ZeroLowLevelStrategy
from lightning_zero.data import DataPosition, ElasticDistributedSampler


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


@pytest.mark.parametrize(("shuffle", "seed", "drop_last"), [(True, 0, False), (True, 9, True), (False, 0, True)])
def test_from_a_distributed_sampler_keeps_its_order_and_split(shuffle: bool, seed: int, drop_last: bool) -> None:
    dataset = list(range(SAMPLES + 1))  # 25 over 3 ranks: padded or cut
    for rank in range(3):
        theirs = DistributedSampler(dataset, num_replicas=3, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        theirs.set_epoch(2)
        ours = ElasticDistributedSampler.from_distributed_sampler(theirs)
        assert list(ours) == list(theirs) and len(ours) == len(theirs)
        ours.set_epoch(3)
        theirs.set_epoch(3)
        assert list(ours) == list(theirs)


# -- by default: ZeroLowLevelStrategy's sampler and position --------------------------------------------------


def _fit_in_process(tmp_path: Path, loader: DataLoader, **trainer_args: Any) -> Trainer:
    trainer = Trainer(accelerator="cpu", devices=1, strategy=ZeroLowLevelStrategy(stage=2), max_steps=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path), **trainer_args)
    trainer.fit(RecordsIds(), loader)
    return trainer


def test_a_loader_without_a_sampler_gets_an_elastic_one_of_lightnings_order_and_a_position_callback(
        tmp_path: Path, in_process_trainer_group: None) -> None:
    trainer = _fit_in_process(tmp_path, DataLoader(Ids(), batch_size=BATCH, shuffle=True))
    sampler = trainer.train_dataloader.sampler
    assert type(sampler) is ElasticDistributedSampler
    expected = DistributedSampler(Ids(), num_replicas=1, rank=0, shuffle=True, seed=0)  # Lightning's settings
    assert list(sampler) == list(expected) and sampler.drop_last is False
    [position] = [c for c in trainer.callbacks if isinstance(c, DataPosition)]
    assert position.strict is False
    assert position.state_dict()["samplers"] == [{"epoch": 0, "consumed": BATCH, "dataset_size": SAMPLES, "seed": 0}]


def test_a_data_position_the_user_gave_is_the_only_one(tmp_path: Path, in_process_trainer_group: None) -> None:
    given = DataPosition()
    trainer = _fit_in_process(tmp_path, DataLoader(Ids(), batch_size=BATCH, shuffle=True), callbacks=[given])
    assert [c for c in trainer.callbacks if isinstance(c, DataPosition)] == [given]
    assert type(trainer.train_dataloader.sampler) is ElasticDistributedSampler


def test_a_users_own_distributed_sampler_is_left_alone(tmp_path: Path, in_process_trainer_group: None) -> None:
    own = DistributedSampler(Ids(), num_replicas=1, rank=0, seed=5)
    trainer = _fit_in_process(tmp_path, DataLoader(Ids(), batch_size=BATCH, sampler=own))
    assert trainer.train_dataloader.sampler is own


def test_without_the_distributed_sampler_the_loader_is_left_alone(tmp_path: Path,
                                                                   in_process_trainer_group: None) -> None:
    trainer = _fit_in_process(tmp_path, DataLoader(Ids(), batch_size=BATCH, shuffle=True),
                              use_distributed_sampler=False)
    assert type(trainer.train_dataloader.sampler) is RandomSampler
    [position] = [c for c in trainer.callbacks if isinstance(c, DataPosition)]
    assert position.state_dict() == {}  # nothing recorded, nothing written


def test_a_lenient_position_that_does_not_fit_warns_and_leaves_the_samplers_at_the_start(
        tmp_path: Path, in_process_trainer_group: None) -> None:
    position = DataPosition(strict=False)
    position.load_state_dict({"samplers": [{"epoch": 0, "consumed": 4, "dataset_size": SAMPLES + 1, "seed": 0}]})
    with pytest.warns(UserWarning, match="the same dataset.*strict=False"):
        trainer = _fit_in_process(tmp_path, DataLoader(Ids(), batch_size=BATCH, shuffle=True), callbacks=[position])
    assert trainer.train_dataloader.sampler.start == 0 and not position.resumed_exactly


# -- through the Trainer ----------------------------------------------------------------------------------

STEPS_BEFORE = 3  # saved at step 3: 3 steps x 2 samples x 2 ranks = 12 of 24 samples


@functools.cache
def interrupted(root: str, sampler: str = "elastic", data_position: bool = True) -> list[dict[str, Any]]:
    """Trains one step past the save at step 3 (lost, as in a job killed after it); ``seen`` is cut at the save."""
    results = run_distributed(fit_ids, 2, root, f"interrupted-{sampler}-{data_position}", STEPS_BEFORE + 1, None, 1,
                              sampler, data_position, start_method="forkserver")
    return [{**result, "seen": result["seen"][: STEPS_BEFORE * BATCH]} for result in results]


def _resumed(root: str, world_size: int, sampler: str = "elastic", data_position: bool = True,
             saved_with: tuple[str, bool] = ("elastic", True)) -> list[dict[str, Any]]:
    path = interrupted(root, *saved_with)[0]["path"]
    return run_distributed(fit_ids, world_size, root, f"resumed-{world_size}-{sampler}-{data_position}", -1, path, 1,
                           sampler, data_position, start_method="forkserver")


def _each_sample_once(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> None:
    counts = Counter([i for result in before for i in result["seen"]] + [i for result in after for i in result["seen"]])
    assert sorted(counts) == list(range(SAMPLES)) and set(counts.values()) == {1}, counts
    assert all(result["epoch"] == 1 for result in after)  # the epoch ended; no second epoch began


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("data-position"))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3, 1, 2])
def test_an_epoch_interrupted_on_two_ranks_and_resumed_on_another_number_sees_each_sample_once(
        root: str, world_size: int) -> None:
    before = interrupted(root)
    assert sum(len(result["seen"]) for result in before) == STEPS_BEFORE * BATCH * 2
    _each_sample_once(before, _resumed(root, world_size))


@pytest.mark.slow
def test_a_same_size_resume_sees_what_the_uninterrupted_run_sees(root: str, tmp_path: Path) -> None:
    whole = run_distributed(fit_ids, 2, str(tmp_path), "whole", -1, None, start_method="forkserver")
    resumed = _resumed(root, 2)
    for rank in range(2):
        assert interrupted(root)[rank]["seen"] + resumed[rank]["seen"] == whole[rank]["seen"], f"rank {rank}"


LIGHTNINGS = ("lightning", False)
"""A loader without a sampler of its own and a Trainer without DataPosition: what users write."""


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3, 1])
def test_by_default_an_epoch_interrupted_on_two_ranks_resumes_on_another_number_with_each_sample_once(
        root: str, world_size: int) -> None:
    before = interrupted(root, *LIGHTNINGS)
    assert {result["sampler"] for result in before} == {"ElasticDistributedSampler"}
    resumed = _resumed(root, world_size, *LIGHTNINGS, saved_with=LIGHTNINGS)
    _each_sample_once(before, resumed)
    assert all(result["sampler"] == "ElasticDistributedSampler" and result["positions"] == 1 for result in resumed)
    assert [result["not_resumable"] for result in resumed] == [[]] * world_size  # Lightning's warning left out


@pytest.mark.slow
def test_a_data_position_given_by_the_user_resumes_the_default_position_once(root: str) -> None:
    resumed = _resumed(root, 2, "lightning", True, saved_with=LIGHTNINGS)
    _each_sample_once(interrupted(root, *LIGHTNINGS), resumed)
    assert [result["positions"] for result in resumed] == [1, 1]
    assert [result["not_resumable"] for result in resumed] == [[], []]


@pytest.mark.slow
def test_a_users_own_sampler_is_left_alone_and_its_checkpoint_without_a_position_still_resumes(root: str) -> None:
    own = interrupted(root, "own", False)
    assert all(result["sampler"] == "DistributedSampler" and result["own_sampler"] for result in own)
    resumed = _resumed(root, 2, *LIGHTNINGS, saved_with=("own", False))
    assert all(result["global_step"] == SAMPLES // (BATCH * 2) for result in resumed)
    # No position to continue from: Lightning's warning stays, as it should.
    assert resumed[0]["not_resumable"] and not resumed[1]["not_resumable"]
