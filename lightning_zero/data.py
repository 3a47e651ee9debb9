"""The data position of a run, kept across a resume at another world size.

:class:`ElasticDistributedSampler` is a drop-in for ``torch.utils.data.DistributedSampler``: the same
global order of an epoch (``randperm(len(dataset))`` seeded with ``seed + epoch``, the same split of it
over the ranks), and in addition a position: the number of samples of the epoch's global order already
consumed. After a resume at M ranks the rest of the same global order is split over the M ranks, so no
sample of the epoch is repeated or skipped, and a resume at the world size that saved continues exactly
as the uninterrupted run would have.

:class:`DataPosition` is the Lightning callback that records the position in every checkpoint (the
number of batches the training loop finished, not what the loader's workers prefetched) and gives it
back to the samplers when a fit resumes.

[Note: the data position by default] ``ZeroLowLevelStrategy`` calls :func:`keep_data_position` for every run:
the ``DistributedSampler`` Lightning puts into a training loader (``use_distributed_sampler=True``, the loader's
sampler a ``RandomSampler`` or ``SequentialSampler``) becomes an :class:`ElasticDistributedSampler` of the same
settings, and a fit without a :class:`DataPosition` gets one (``strict=False``), added before the callbacks'
``setup`` and the restore of their state. So ``trainer.fit(ckpt_path="last")`` continues the epoch at any world
size without the user asking. A loader's own sampler, and every loader under ``use_distributed_sampler=False``,
is left as it is. Lightning asks a resumable loader for ``state_dict``/``load_state_dict``; the position is kept
by the callback instead, so that a checkpoint still resumes under a strategy without it (plain DDP: Lightning
refuses a checkpoint whose loader states its loaders cannot take), and Lightning's "not resumable" warning is
left out only when the callback did resume every training loader (``_compat.quiet_not_resumable_warning``).

[Note: the global batch on a new world size] Each rank keeps its batch size, so a run that shrinks from
N to M ranks takes global batches of ``M / N`` the size (and more steps per epoch). Learning-rate
schedules written per step see more steps; a user who must keep the global batch raises
``accumulate_grad_batches`` by ``N / M`` where it divides. The sampler does not change the batch: the
loader's batch size is the user's, and changing it silently would change the optimisation.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightning_zero import _compat


class ElasticDistributedSampler(DistributedSampler):
    """``DistributedSampler`` with a position in the epoch that survives a change of world size.

    Args:
        dataset, shuffle, seed, drop_last: as in ``DistributedSampler``.
        num_replicas, rank: as in ``DistributedSampler``; None takes them from the default process group
            when the sampler is first iterated (so a loader may be built before the group exists).

    A subclass of ``DistributedSampler``, so Lightning leaves it in place (``use_distributed_sampler`` does
    not replace it). The epoch's global order is padded by its first samples to a multiple of the world size
    (``drop_last=False``) or cut to one (``drop_last=True``), as ``DistributedSampler`` does: only then can a
    sample repeat or be left out, and only at the epoch's end.
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        # DistributedSampler.__init__ reads the process group at once; here it is read when first needed.
        if rank is not None and num_replicas is not None and not 0 <= rank < num_replicas:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
        self.dataset = dataset
        self._num_replicas = num_replicas
        self._rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.start = 0
        """Samples of this epoch's global order consumed before this iteration (by any world size)."""

    @classmethod
    def from_distributed_sampler(cls, sampler: DistributedSampler) -> ElasticDistributedSampler:
        """The sampler of ``sampler``'s order and split: its dataset, world size, rank, shuffle, seed, drop_last
        and epoch."""
        dataset: Sized = sampler.dataset  # type: ignore[assignment]
        elastic = cls(dataset, num_replicas=sampler.num_replicas, rank=sampler.rank, shuffle=sampler.shuffle,
                      seed=sampler.seed, drop_last=sampler.drop_last)
        elastic.epoch = sampler.epoch
        return elastic

    @property  # type: ignore[override]
    def num_replicas(self) -> int:
        return self._num_replicas if self._num_replicas is not None else _world_size()

    @num_replicas.setter
    def num_replicas(self, value: int) -> None:
        self._num_replicas = value

    @property  # type: ignore[override]
    def rank(self) -> int:
        return self._rank if self._rank is not None else (dist.get_rank() if dist.is_initialized() else 0)

    @rank.setter
    def rank(self, value: int) -> None:
        self._rank = value

    @property  # type: ignore[override]
    def num_samples(self) -> int:
        """This rank's samples in a whole epoch, as ``DistributedSampler`` counts them (``len(sampler)``)."""
        return self._per_rank(len(self.dataset))

    @property  # type: ignore[override]
    def total_size(self) -> int:
        return self.num_samples * self.num_replicas

    def remaining(self) -> int:
        """This rank's samples in the rest of the epoch: what an iteration yields. After a resume in the middle
        of an epoch it is less than ``len(sampler)``, which stays the whole epoch's, as Lightning counts an
        epoch's batches ([Note: batches of a resumed epoch])."""
        return self._per_rank(len(self.dataset) - self.start)

    def _per_rank(self, samples: int) -> int:
        if self.drop_last:
            return samples // self.num_replicas
        return math.ceil(samples / self.num_replicas)

    def global_order(self) -> list[int]:
        """The epoch's order over all ranks, the same at every world size."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            return torch.randperm(len(self.dataset), generator=generator).tolist()
        return list(range(len(self.dataset)))

    @override
    def __iter__(self) -> Iterator[int]:
        rest = self.global_order()[self.start:]
        total = self.remaining() * self.num_replicas
        if len(rest) < total:  # padded with the rest's first samples, as DistributedSampler pads
            rest += (rest * math.ceil(total / max(len(rest), 1)))[: total - len(rest)]
        return iter(rest[:total][self.rank:total:self.num_replicas])

    @override
    def __len__(self) -> int:
        return self.num_samples

    @override
    def set_epoch(self, epoch: int) -> None:
        """A new epoch starts from its first sample; the epoch a resume is in keeps its position."""
        if epoch != self.epoch:
            self.start = 0
        self.epoch = epoch

    def resume_at(self, epoch: int, consumed: int) -> None:
        """Continue epoch ``epoch`` after its first ``consumed`` samples (of the global order)."""
        if not 0 <= consumed <= len(self.dataset):
            raise ValueError(f"ElasticDistributedSampler.resume_at: {consumed} samples consumed of an epoch of"
                             f" {len(self.dataset)}: the checkpoint was saved with another dataset.")
        self.epoch = epoch
        self.start = consumed


class ReplicaGroupSampler(ElasticDistributedSampler):
    """The sampler of a fault-tolerant fit ([Note: every sample once across replica groups]): the epoch's global
    order (as :class:`ElasticDistributedSampler`'s), consumed by committed steps.

    [Note: every sample once across replica groups] Each step takes the next ``participants x K x batch`` samples
    of the order, split as ``DistributedSampler`` splits them over ``participants x K`` ranks (this group's place
    in the quorum, then its rank), where the quorum is the one the batch is fetched under (the last decided
    step's: [Note: data quorum] in engine/fault_tolerance.py). The batch is drawn when the loop fetches it (the loader's
    length is known, so Lightning does not read ahead; with workers, the loader does: see the guide). The
    position moves only when a step commits, so a discarded step's samples are drawn again for the next one,
    and a group that joins starts at the position its heal carries. The global batch shrinks and grows with
    the participants. The epoch's last step is padded to a whole global batch with the epoch's first samples
    (``DistributedSampler`` pads to a multiple of the world size), so that a discarded last step is drawn again
    like any other; the epoch ends when its order is consumed, which the strategy tells the loop."""

    HUGE = 1 << 40
    """``len()``: a length, so that Lightning does not fetch a batch ahead, and one the epoch never reaches (the
    strategy ends the epoch at its last batch, however many steps were discarded or groups came and went)."""

    def __init__(self, dataset: Sized, batch_size: int, split: Callable[[], tuple[int, int]], shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False) -> None:
        super().__init__(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.batch_size = batch_size
        self._split = split
        self._pending = 0
        """Samples of the order taken by batches whose step is not decided yet."""
        self._drawn = 0
        """Batches drawn since the last decision: the micro-batches of the step (``accumulate_grad_batches``)."""
        self.last_batch_drawn = False
        """Whether the batch drawn last ends the epoch if its step commits."""
        self._order: tuple[int, list[int]] | None = None

    @override
    def __len__(self) -> int:
        return self.HUGE

    @override
    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._pending = self._drawn = 0
        super().set_epoch(epoch)

    def heal(self, epoch: int, start: int, in_step_ranks: int | None) -> None:
        """A live group's position (read before its step), put here. ``in_step_ranks``: the heal is applied inside
        a step that every group splits over that many ranks and commits, so its samples are this sampler's pending
        ones too: as many global batches as this group drew micro-batches in the step (the batches themselves were
        not split with the others and count for nothing: a healing group contributes nothing)."""
        self.resume_at(epoch, start)
        in_step = 0 if in_step_ranks is None else self._drawn * in_step_ranks * self.batch_size
        self._pending = min(in_step, len(self.dataset) - start)

    @classmethod
    def in_place_of(cls, loader: DataLoader, sampler: DistributedSampler,
                    split: Callable[[], tuple[int, int]]) -> ReplicaGroupSampler:
        """The sampler of ``sampler``'s order (its dataset, shuffle, seed, drop_last and epoch) for ``loader``'s
        batch size, split by ``split() -> (ranks, rank)``."""
        batch_size = getattr(loader.batch_sampler, "batch_size", None)
        if not isinstance(batch_size, int):
            raise ValueError("Fault tolerance splits each global batch by committed steps: give the training DataLoader"
                             " a batch_size (not a batch_sampler of its own), or a sampler of your own.")
        dataset: Sized = sampler.dataset  # type: ignore[assignment]
        ft = cls(dataset, batch_size, split, shuffle=sampler.shuffle, seed=sampler.seed, drop_last=sampler.drop_last)
        ft.epoch = sampler.epoch
        return ft

    def steps_left(self, world: int, at: int | None = None) -> int:
        """Global batches of ``world`` ranks left in this epoch's order after its first ``at`` samples (by default
        the committed position): the last one padded, or with ``drop_last`` none short of a whole one."""
        rest = max(len(self.dataset) - (self.start if at is None else at), 0)
        block = world * self.batch_size
        return rest // block if self.drop_last else math.ceil(rest / block)

    def commit(self, committed: bool) -> None:
        """The step of the batches drawn since the last decision: their samples are consumed, or drawn again."""
        if committed:
            self.start = min(self.start + self._pending, len(self.dataset))
        self._pending = self._drawn = 0

    def _epoch_order(self) -> list[int]:
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, self.global_order())
        return self._order[1]

    @override
    def __iter__(self) -> Iterator[int]:
        while True:
            world, rank = self._split()
            order = self._epoch_order()
            at = self.start + self._pending
            if self.steps_left(world, at) == 0:
                return
            block = world * self.batch_size
            taken = order[at:at + block]
            if len(taken) < block:
                taken += (order * math.ceil(block / len(order)))[: block - len(taken)]
            self._pending += min(block, len(order) - at)
            self._drawn += 1
            self.last_batch_drawn = self.steps_left(world, self.start + self._pending) == 0
            yield from taken[rank::world]


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class DataPosition(Callback):
    """Records where each :class:`ElasticDistributedSampler` of the training loaders is in its epoch, in every
    checkpoint, and puts it back when a fit resumes, at any world size::

        sampler = ElasticDistributedSampler(dataset, shuffle=True, seed=7)
        loader = DataLoader(dataset, batch_size=8, sampler=sampler)
        trainer = Trainer(strategy="zero2", callbacks=[DataPosition()], ...)
        trainer.fit(model, loader, ckpt_path="last")

    The position is counted from the batches the training loop finished (each rank's batch size times the
    world size), not from the sampler, whose loader's workers read ahead. Every rank of a data-parallel run
    finishes the same number of batches, so every rank saves the same position. ``ZeroLowLevelStrategy`` adds
    one (``strict=False``) to a fit that has none ([Note: the data position by default]).

    Args:
        strict: a recorded position that does not fit the training loaders (another number of
            ElasticDistributedSamplers, another dataset size) is a ``ValueError``; False warns and leaves the
            samplers at the epoch's start, as a loader without a position resumes.
    """

    def __init__(self, strict: bool = True) -> None:
        self.strict = strict
        self.resumed_exactly = False
        """Whether this fit put every training loader where the checkpoint left it (Lightning's "not resumable"
        warning is then left out)."""
        self._base: list[int] = []
        """Per sampler: samples of the epoch consumed before this fit's first batch of it."""
        self._batches = 0
        """Batches finished since then."""
        self._loaded: dict[str, Any] | None = None

    @property
    @override
    def state_key(self) -> str:
        return "lightning_zero.DataPosition"

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        samplers = _samplers(trainer)
        self._base = [0] * len(samplers)
        self._batches = 0
        self.resumed_exactly = False
        loaded, self._loaded = self._loaded, None
        positions = [] if loaded is None else loaded.get("samplers", [])
        if loaded is None or not (positions or self.strict):  # no position recorded: nothing to put back
            return
        mismatch = _mismatch(positions, samplers)
        if mismatch is not None:
            if self.strict:
                raise ValueError(mismatch)
            rank_zero_warn(f"{mismatch} DataPosition(strict=False) leaves the samplers at the epoch's start: the rest"
                           " of this epoch is not the rest of the saved one.")
            return
        for index, (sampler, position) in enumerate(zip(samplers, positions)):
            sampler.resume_at(position["epoch"], position["consumed"])
            self._base[index] = position["consumed"]
        if positions and positions[0]["epoch"] == trainer.current_epoch and not isinstance(samplers[0],
                                                                                           ReplicaGroupSampler):
            _renumber_batches(trainer, positions[0]["consumed"] // (_batch_size(_loaders(trainer)[0])
                                                                    * samplers[0].num_replicas))
            _compat.restart_training_iterator(trainer)  # made before this hook, from the epoch's start
        self.resumed_exactly = len(samplers) == len(_leaves(trainer))

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Not called when a fit resumes in the middle of an epoch: the loaded position stays the base.
        self._base = [0] * len(self._base)
        self._batches = 0

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._batches += 1

    @override
    def state_dict(self) -> dict[str, Any]:
        """``{"samplers": [...]}``, one position per ElasticDistributedSampler; empty (Lightning writes nothing)
        without one."""
        trainer = getattr(self, "_trainer", None)
        if trainer is None:
            return {}
        positions = []
        for sampler, loader, base in zip(_samplers(trainer), _loaders(trainer), self._base):
            consumed = base + self._batches * _batch_size(loader) * sampler.num_replicas
            if isinstance(sampler, ReplicaGroupSampler):
                consumed = sampler.start  # moved by committed steps only
            positions.append({"epoch": sampler.epoch, "consumed": min(consumed, len(sampler.dataset)),
                              "dataset_size": len(sampler.dataset), "seed": sampler.seed})
        return {"samplers": positions} if positions else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = state_dict

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer
        if stage == TrainerFn.FITTING:
            _compat.quiet_not_resumable_warning(trainer, self._resumed_exactly)

    def _resumed_exactly(self) -> bool:
        return self.resumed_exactly


def keep_data_position(trainer: Trainer, split: Callable[[], tuple[int, int]] | None = None) -> None:
    """The training loaders' data position kept without the user asking ([Note: the data position by default]):
    called by the strategy before the callbacks' ``setup``. ``split`` (fault tolerance): a
    :class:`ReplicaGroupSampler` splitting each batch by ``split() -> (ranks, rank)`` instead."""
    _compat.replace_inserted_sampler(trainer, _elastic_in_place_of if split is None
                                     else functools.partial(ReplicaGroupSampler.in_place_of, split=split))
    if trainer.state.fn == TrainerFn.FITTING and not any(isinstance(c, DataPosition) for c in trainer.callbacks):
        # First: Lightning runs ModelCheckpoint last, and the batch it saves after must be counted by then.
        trainer.callbacks.insert(0, DataPosition(strict=False))


def _elastic_in_place_of(loader: DataLoader, sampler: DistributedSampler) -> ElasticDistributedSampler | None:
    if not isinstance(getattr(loader.batch_sampler, "batch_size", None), int):
        return None  # DataPosition counts samples as batches x batch size: a loader without one keeps Lightning's
    return ElasticDistributedSampler.from_distributed_sampler(sampler)


def replica_group_samplers(trainer: Trainer) -> list[ReplicaGroupSampler]:
    """The training loaders' :class:`ReplicaGroupSampler` (fault tolerance), in a fixed order."""
    return [s for s in _samplers(trainer) if isinstance(s, ReplicaGroupSampler)]


def _mismatch(positions: list[dict[str, Any]], samplers: list[ElasticDistributedSampler]) -> str | None:
    """Why the recorded ``positions`` do not fit the training loaders' ``samplers``, or None."""
    if len(positions) != len(samplers):
        return (f"The checkpoint records the position of {len(positions)} ElasticDistributedSampler(s), the training"
                f" loaders have {len(samplers)}: resume with the loaders it was saved with.")
    for sampler, position in zip(samplers, positions):
        if position["dataset_size"] != len(sampler.dataset):
            return (f"The checkpoint's data position is for a dataset of {position['dataset_size']} samples, this"
                    f" loader's has {len(sampler.dataset)}: resume with the same dataset.")
    return None


def _renumber_batches(trainer: Trainer, done: int) -> None:
    """[Note: batches of a resumed epoch] Lightning counts an epoch in batches of the world size that saved
    (3 batches done of 6 on 2 ranks); at another world size the same samples are another number of batches
    (2 of 4 on 3 ranks). The epoch loop ends the epoch by that count and numbers ``batch_idx`` by it, so its
    counters are moved to the batches the consumed samples make at this world size, each by the same amount
    (their differences say at which hook the checkpoint was saved). The loader, built on the full epoch,
    has its length; the sampler yields the rest, and the epoch ends where both do."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    shift = done - progress.ready
    for counter in ("ready", "started", "processed", "completed"):
        setattr(progress, counter, max(0, getattr(progress, counter) + shift))


def _leaves(trainer: Trainer) -> list[Any]:
    """The training loaders (every iterable in the train dataloaders' dicts, lists and tuples), in a fixed order."""
    found: list[Any] = []
    _collect_leaves(trainer.train_dataloader, found)  # [Note: no closure cycles on a save's path] in packed.py
    return found


def _collect_leaves(value: Any, found: list[Any]) -> None:
    if isinstance(value, dict):
        for key in sorted(value):
            _collect_leaves(value[key], found)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect_leaves(item, found)
    elif value is not None:
        found.append(value)


def _loaders(trainer: Trainer) -> list[DataLoader]:
    """The training DataLoaders whose sampler is an ElasticDistributedSampler, in a fixed order."""
    return [leaf for leaf in _leaves(trainer)
            if isinstance(leaf, DataLoader) and isinstance(leaf.sampler, ElasticDistributedSampler)]


def _samplers(trainer: Trainer) -> list[ElasticDistributedSampler]:
    return [loader.sampler for loader in _loaders(trainer)]  # type: ignore[misc]


def _batch_size(loader: DataLoader) -> int:
    batch_sampler = loader.batch_sampler
    size = getattr(batch_sampler, "batch_size", None)
    if not isinstance(size, int):
        raise ValueError("DataPosition counts samples as batches x batch size: give the DataLoader a batch_size"
                         " (not a batch_sampler of its own) with an ElasticDistributedSampler.")
    return size
