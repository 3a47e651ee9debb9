"""Fabric's side of fault tolerance across replica groups ([Note: one step across groups] in engine/fault_tolerance.py):
the sampler its training loaders get, which each step's decision moves and a heal carries ([Note: every sample once
across replica groups] in data.py), and the epoch, which in a loop of the user's own that sampler keeps ([Note:
Fabric's epoch])."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightning_zero import _compat
from lightning_zero.data import ReplicaGroupSampler
from lightning_zero.engine.fault_tolerance import ReplicaGroups


class EpochReplicaGroupSampler(ReplicaGroupSampler):
    """The :class:`~lightning_zero.data.ReplicaGroupSampler` of a Fabric loop: the same batches, and the epoch its own.

    [Note: Fabric's epoch] The Trainer's loop is told where an epoch ends (the strategy marks its last batch); a loop
    the user writes is not, and its counters are its process's: Fabric's loader calls ``set_epoch`` with the number
    of times it was iterated, which a heal does not carry and a relaunched group counts from 0 again. So the sampler
    keeps the epoch, which a heal carries with the position: an iteration yields batches until the epoch's order is
    consumed by committed steps and then ends (a discarded last step is drawn again first), and the next iteration
    begins the next epoch. ``set_epoch`` is ignored, so Fabric's count neither moves the epoch back nor skips one. An
    iteration left before its end (a ``break``) is continued by the next one from the committed position: what it
    drew for no decided step counts for nothing. ``len()`` is this rank's samples in the rest of the epoch at the last
    decided split (once the epoch is consumed, the next one's), as many as an iteration yields if every step commits
    and the groups stay: a loop stops by ``fault_tolerance.steps``, not by it. Every such loader moves with the
    training steps' decisions, so a loader the steps do not read (validation) needs a sampler of another class.
    (When a step is decided is no sign of which loader it read: a loader with workers reads ahead past the
    epoch's end, and a step may be decided after the loop that drew its batches.)"""

    @override
    def __len__(self) -> int:
        world = self._split()[0]
        return (self.steps_left(world) or self.steps_left(world, at=0)) * self.batch_size

    @override
    def set_epoch(self, epoch: int) -> None:
        """Ignored: the epoch is the job's, not Fabric's count of this process's iterations ([Note: Fabric's
        epoch])."""

    @override
    def __iter__(self) -> Iterator[int]:
        self._pending = 0  # drawn by an iteration left before its step was decided
        if self.steps_left(self._split()[0]) == 0:
            self.resume_at(self.epoch + 1, 0)
        yield from super().__iter__()


class FabricDataPosition:
    """The samplers of a fault-tolerant Fabric job's loaders: put in by ``process_dataloader`` (:meth:`adopt`), moved
    by each step's decision and carried by heals (:meth:`serve`)."""

    def __init__(self) -> None:
        self.samplers: list[EpochReplicaGroupSampler] = []
        """In the order their loaders were set up (the same in every group running the same program)."""
        self._groups: ReplicaGroups | None = None
        self._healed: list[tuple[int, int]] = []
        """The last heal's (epoch, start) per sampler: a loader set up after the heal (``fabric.setup`` heals a group
        behind the others before the loop's loaders are set up) starts there."""

    def adopt(self, loader: DataLoader) -> DataLoader:
        """``loader`` with a :class:`EpochReplicaGroupSampler` in place of its ``DistributedSampler`` (the one
        Fabric put in, or one of the user's own of that exact class: the two are alike once Fabric set the loader up);
        a loader with a sampler of another class, ``ElasticDistributedSampler`` and Fabric's
        ``DistributedSamplerWrapper`` included, comes back as it is."""
        sampler = loader.sampler
        if type(sampler) is not DistributedSampler:
            return loader
        replica_group_sampler = EpochReplicaGroupSampler.in_place_of(loader, sampler, self.split)
        if self.samplers:  # a second one: rarely a training loader, and a validation one would move with the steps
            rank_zero_warn(
                f"Fault tolerance gave {len(self.samplers) + 1} loaders a sampler that every training step's decision"
                " moves (an EpochReplicaGroupSampler in place of their DistributedSampler). A loader the training steps"
                " do not read (validation) would yield only what the steps left of it: give it a sampler of another"
                " class, e.g. `sampler=lightning_zero.ElasticDistributedSampler(dataset, shuffle=False)`.")
        if len(self._healed) > len(self.samplers):
            replica_group_sampler.resume_at(*self._healed[len(self.samplers)])
        self.samplers.append(replica_group_sampler)
        return _compat.update_dataloader(loader, replica_group_sampler)

    def serve(self, groups: ReplicaGroups) -> None:
        """Registered before the group joins: a heal carries the samplers' positions, each decision moves them."""
        self._groups = groups
        groups.register_state("data", self._save, self._load)
        groups.on_commit(self._follow)

    def split(self) -> tuple[int, int]:
        """(ranks, rank) of the next batch across the replica groups; before ``fabric.setup`` built them, this group's."""
        if self._groups is not None:
            return self._groups.data_split()
        return (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)

    def _save(self) -> list[tuple[int, int]]:
        return [(sampler.epoch, sampler.start) for sampler in self.samplers]

    def _load(self, state: list[Any]) -> None:
        assert self._groups is not None
        # Inside a step every group splits it over the ranks of the quorum the source's state brought (loaded first).
        in_step_ranks = None if self._groups.joining else self._groups.data_split()[0]
        self._healed = [(int(epoch), int(start)) for epoch, start in state]
        for sampler, (epoch, start) in zip(self.samplers, self._healed):
            sampler.heal(epoch, start, in_step_ranks)

    def _follow(self, committed: bool) -> None:
        for sampler in self.samplers:
            sampler.commit(committed)
