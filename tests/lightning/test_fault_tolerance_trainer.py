"""The Trainer's side of fault tolerance without a lighthouse: the sampler that splits batches across replica
groups by committed steps, and LightningCLI configuring it (tests/faults/test_fault_tolerance.py runs real groups)."""

from __future__ import annotations

from typing import Any

import pytest
from lightning.pytorch.cli import LightningCLI

from lightning_zero import ElasticDistributedSampler, FaultTolerance, ZeroLowLevelStrategy
from lightning_zero.data import ReplicaGroupSampler


class Split:
    """The (ranks, rank) a ReplicaGroupSampler asks for at each batch: the quorum's groups times 2 ranks."""

    def __init__(self, groups: int, place: int, rank: int) -> None:
        self.groups, self.place, self.rank = groups, place, rank

    def __call__(self) -> tuple[int, int]:
        return self.groups * 2, self.place * 2 + self.rank


def sampler(split: Split, size: int = 100, batch: int = 4, **kwargs: Any) -> ReplicaGroupSampler:
    return ReplicaGroupSampler(list(range(size)), batch, split, seed=3, **kwargs)


def batches(samplers: list[ReplicaGroupSampler], its: list, count: int, commit: bool = True) -> list[list[int]]:
    """``count`` steps: each sampler's next batch (4 indices), then the step decided for all of them."""
    taken = []
    for _ in range(count):
        for it in its:
            taken.append([next(it) for _ in range(4)])
        for s in samplers:
            s.commit(commit)
    return taken


def test_with_a_steady_quorum_it_is_the_elastic_samplers_order_and_split() -> None:
    """2 groups x 2 ranks: the same batches as ElasticDistributedSampler over 4 ranks (DistributedSampler's)."""
    splits = [Split(2, g, r) for g in range(2) for r in range(2)]
    samplers = [sampler(s) for s in splits]
    its = [iter(s) for s in samplers]
    got = batches(samplers, its, 5)
    elastic = [iter(ElasticDistributedSampler(list(range(100)), num_replicas=4, rank=k, seed=3)) for k in range(4)]
    want = [[next(it) for _ in range(4)] for _ in range(5) for it in elastic]
    assert got == want


def test_a_discarded_step_is_drawn_again_and_the_next_split_follows_the_quorum() -> None:
    """A discarded step's samples come again; when a group leaves, the next steps take 2 ranks' worth each, and
    over the epoch every sample is taken once (the last step padded with the epoch's first samples)."""
    splits = [Split(2, g, r) for g in range(2) for r in range(2)]
    samplers = [sampler(s) for s in splits]
    its = [iter(s) for s in samplers]
    first = batches(samplers, its, 1)
    again = batches(samplers, its, 1, commit=False)
    assert again != first
    retaken = batches(samplers, its, 1)
    assert retaken == again  # nothing consumed by the discarded step
    for s in splits:
        s.groups = 1  # group 1 gone: group 0 alone, at place 0
    survivors, its = samplers[:2], its[:2]
    seen = [i for b in first + retaken for i in b]
    while not survivors[0].last_batch_drawn:
        seen += [i for b in batches(survivors, its, 1) for i in b]
    assert samplers[0].start == 100
    assert set(seen) == set(range(100)) and len(seen) - 100 < 8  # the padding of the last step
    with pytest.raises(StopIteration):
        next(its[0])


@pytest.mark.parametrize("micro_batches", [1, 2, 3])
def test_a_heal_inside_an_accumulated_step_moves_the_position_as_the_participants_do(micro_batches: int) -> None:
    """Group 0 (2 ranks) takes part alone; group 1 heals inside the step (torchft applies the heal at the decision,
    after the step's micro-batches were drawn). Both then commit the step: group 1 at group 0's position, moved by the
    step's ``micro_batches`` global batches of group 0's split, as group 0's is."""
    live = [sampler(Split(1, 0, r)) for r in range(2)]
    healer_splits = [Split(2, 1, r) for r in range(2)]  # its own, older split: it drew other batches
    healer = [sampler(split) for split in healer_splits]
    live_its, healer_its = [iter(s) for s in live], [iter(s) for s in healer]
    batches(live + healer, live_its + healer_its, 2)  # two steps all four committed (their positions now differ)
    before = (live[0].epoch, live[0].start)  # what group 0 serves: read when the step's quorum forms
    for _ in range(micro_batches):
        for it in live_its + healer_its:
            [next(it) for _ in range(4)]
    for s in healer:
        s.heal(*before, in_step_ranks=2)
    for s in live + healer:
        s.commit(True)
    assert live[0].start == before[1] + micro_batches * 2 * 4
    assert [s.start for s in healer] == [live[0].start] * 2
    for split in healer_splits:  # the step's quorum splits its next batches ([Note: data quorum]): group 0's place
        split.groups, split.place = 1, 0
    assert [next(it) for it in healer_its] == [next(it) for it in live_its]  # the same next samples as group 0's ranks


def test_the_length_keeps_lightning_from_reading_ahead_and_never_ends_the_epoch() -> None:
    s = sampler(Split(1, 0, 0))
    assert len(s) == ReplicaGroupSampler.HUGE


def test_lightningcli_configures_fault_tolerance(tmp_path: Any) -> None:
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    config = tmp_path / "ft.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  strategy:\n"
        "    class_path: lightning_zero.ZeroLowLevelStrategy\n"
        "    init_args:\n"
        "      stage: 2\n"
        "      fault_tolerance:\n"
        "        class_path: lightning_zero.FaultTolerance\n"
        "        init_args:\n"
        "          replica_group_id: 3\n"
        "          lighthouse: http://127.0.0.1:29510\n"
        "          min_replica_groups: 2\n"
        "          timeout_s: 5\n"
    )
    cli = LightningCLI(BoringModel, BoringDataModule, run=False, args=["--config", str(config)])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ZeroLowLevelStrategy)
    ft = strategy.fault_tolerance
    assert isinstance(ft, FaultTolerance)
    assert (ft.replica_group_id, ft.lighthouse, ft.min_replica_groups, ft.timeout_s) == (3, "http://127.0.0.1:29510", 2, 5.0)
