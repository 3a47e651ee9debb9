"""Fabric's loaders under fault tolerance, without a lighthouse: the sampler ``fabric.setup_dataloaders`` puts in, the
epoch it keeps ([Note: Fabric's epoch] in fabric_fault_tolerance.py), and how decisions and heals move it
(tests/faults/test_fault_tolerance.py runs real replica groups)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, DistributedSampler, WeightedRandomSampler

from lightning_zero import ElasticDistributedSampler, FaultTolerance
from lightning_zero.fabric import ZeroLowLevelStrategy
from lightning_zero.fabric_fault_tolerance import EpochReplicaGroupSampler


class Groups:
    """What the data position asks of a ReplicaGroups: the split, the heal's state and the decisions."""

    def __init__(self, ranks: int = 1) -> None:
        self.ranks = ranks
        self.joining = False
        self.state: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self.decided: list[Callable[[bool], None]] = []

    def data_split(self) -> tuple[int, int]:
        return self.ranks, 0

    def register_state(self, key: str, save: Callable[[], Any], load: Callable[[Any], None]) -> None:
        self.state[key] = (save, load)

    def on_commit(self, callback: Callable[[bool], None]) -> None:
        self.decided.append(callback)

    def decide(self, committed: bool = True) -> None:
        for callback in self.decided:
            callback(committed)


def set_up(fault_tolerance: bool, loader: DataLoader, **kwargs: Any) -> tuple[Fabric, Any, Groups]:
    """A Fabric of one rank in this process (``one_rank``), its strategy's groups replaced by :class:`Groups`."""
    ft = FaultTolerance(0, lighthouse="http://127.0.0.1:9") if fault_tolerance else None
    fabric = Fabric(accelerator="cpu", devices=1, strategy=ZeroLowLevelStrategy(fault_tolerance=ft))
    fabric.launch()
    groups = Groups()
    if fault_tolerance:
        fabric.strategy._data_position.serve(groups)
    return fabric, fabric.setup_dataloaders(loader, **kwargs), groups


def steps(loader: Any, groups: Groups, count: int | None = None, committed: bool = True) -> list[list[int]]:
    """The batches of up to ``count`` steps of a Fabric loop over ``loader`` (all of one iteration without)."""
    taken = []
    for batch in loader:
        taken.append(batch.tolist())
        groups.decide(committed)
        if count is not None and len(taken) == count:
            break
    return taken


def test_a_shuffled_loader_gets_a_replica_group_sampler_of_fabrics_settings(one_rank: None) -> None:
    fabric, loader, _ = set_up(True, DataLoader(range(40), batch_size=4, shuffle=True))
    sampler = loader.sampler
    assert type(sampler) is EpochReplicaGroupSampler
    assert (len(sampler.dataset), sampler.batch_size, sampler.shuffle, sampler.seed, sampler.drop_last) == (
        40, 4, True, 0, False)
    assert fabric.strategy._data_position.samplers == [sampler]


def test_a_plain_distributed_sampler_of_the_users_own_is_swapped_with_its_settings(one_rank: None) -> None:
    """Once Fabric set a loader up, its DistributedSampler and one of the user's are alike: both are swapped."""
    own = DistributedSampler(range(40), num_replicas=1, rank=0, shuffle=False, seed=5, drop_last=True)
    _, loader, _ = set_up(True, DataLoader(range(40), batch_size=3, sampler=own), use_distributed_sampler=False)
    sampler = loader.sampler
    assert type(sampler) is EpochReplicaGroupSampler
    assert (sampler.batch_size, sampler.shuffle, sampler.seed, sampler.drop_last) == (3, False, 5, True)


@pytest.mark.parametrize("case", ["elastic", "wrapped"])
def test_a_sampler_of_another_class_is_kept(one_rank: None, case: str) -> None:
    if case == "elastic":
        own: Any = ElasticDistributedSampler(range(40), shuffle=False)
        fabric, loader, _ = set_up(True, DataLoader(range(40), batch_size=4, sampler=own))
        assert loader.sampler is own
    else:  # Fabric wraps a sampler of the user's own in its DistributedSamplerWrapper, a subclass
        own = WeightedRandomSampler(torch.ones(40), 40)
        fabric, loader, _ = set_up(True, DataLoader(range(40), batch_size=4, sampler=own))
        assert loader.sampler.dataset._sampler is own
    assert not isinstance(loader.sampler, EpochReplicaGroupSampler)
    assert fabric.strategy._data_position.samplers == []


def test_without_fault_tolerance_the_loader_is_fabrics(one_rank: None) -> None:
    _, loader, _ = set_up(False, DataLoader(range(40), batch_size=4, shuffle=True))
    assert type(loader.sampler) is DistributedSampler
    assert len(loader) == 10 and sum(len(batch) for batch in loader) == 40


def test_an_iteration_is_the_rest_of_the_epoch_and_the_next_begins_the_next_one(one_rank: None) -> None:
    """Fabric's own set_epoch (its count of iterations) moves nothing: the epoch ends where committed steps consumed
    its order; a discarded step is drawn again; a loop left by a break goes on from the committed position."""
    _, loader, groups = set_up(True, DataLoader(range(10), batch_size=2, shuffle=True))
    sampler = loader.sampler
    assert len(loader) == 5
    first = steps(loader, groups, 2)
    again = steps(loader, groups, 1, committed=False)  # a new iteration (Fabric: set_epoch(1)) of the same epoch
    rest = steps(loader, groups)  # Fabric: set_epoch(2)
    assert sampler.epoch == 0 and sampler.start == 10 and again == rest[:1]
    assert sorted(sum(first + rest, [])) == list(range(10))
    assert len(loader) == 5  # the next epoch's, once this one is consumed
    second = steps(loader, groups)
    assert sampler.epoch == 1 and sorted(sum(second, [])) == list(range(10)) and second != first + rest
    sampler.set_epoch(0)
    assert sampler.epoch == 1


def test_a_heal_puts_the_epoch_and_position_in_loaders_set_up_after_it_and_in_live_ones(one_rank: None) -> None:
    """``fabric.setup`` heals a group behind the others before the loop sets up its loaders: a loader set up after the
    heal starts at the healed epoch and position. A heal inside a step moves a live loader, and that step's samples
    count when it commits."""
    fabric, _, groups = set_up(True, DataLoader(range(10), batch_size=2, sampler=ElasticDistributedSampler(range(10))))
    save, load = groups.state["data"]
    groups.joining = True
    load([(3, 4)])
    groups.joining = False
    loader = fabric.setup_dataloaders(DataLoader(range(10), batch_size=2, shuffle=True))
    assert (loader.sampler.epoch, loader.sampler.start) == (3, 4) and save() == [(3, 4)]
    batches = iter(loader)
    next(batches)
    load([(3, 6)])  # inside the step: the step's samples (this rank's batch, one rank taking part) are pending
    groups.decide(True)
    assert (loader.sampler.epoch, loader.sampler.start) == (3, 8)



def test_steps_decided_after_the_iteration_ended_still_consume_its_batches(one_rank: None) -> None:
    """The batches an iteration drew count when their steps are decided, even after the iterator ended (a loader
    with workers reads ahead past the epoch's end; a loop may step once after drawing several batches)."""
    _, loader, groups = set_up(True, DataLoader(range(8), batch_size=2, shuffle=True))
    sampler = loader.sampler
    for epoch in range(3):
        drawn = [batch.tolist() for batch in loader]  # the whole iteration first, as read-ahead does
        assert sorted(sum(drawn, [])) == list(range(8))
        for _ in drawn:
            groups.decide(True)
        assert (sampler.epoch, sampler.start) == (epoch, 8)


def test_a_second_loader_given_the_sampler_is_warned_about(one_rank: None) -> None:
    """A validation loader set up with Fabric's defaults would move with the training steps: the user is told."""
    fabric, _, _ = set_up(True, DataLoader(range(10), batch_size=2, shuffle=True))
    with pytest.warns(UserWarning, match="do not read \\(validation\\)"):
        val = fabric.setup_dataloaders(DataLoader(range(6), batch_size=2))
    assert type(val.sampler) is EpochReplicaGroupSampler
    own = fabric.setup_dataloaders(DataLoader(range(6), batch_size=2,
                                              sampler=ElasticDistributedSampler(range(6), shuffle=False)))
    assert type(own.sampler) is ElasticDistributedSampler  # the advice: kept as it is, no warning needed
