"""Fault tolerance across replica groups, on torchft: a lost group costs one step, not a restart.

A *replica group* is one ordinary job of K ranks (one torchrun or SLURM job), ZeRO-sharded inside as
without fault tolerance. Across groups, each bucket's reduced shard is averaged through a torchft
``Manager``'s process group (the same group rank in every group holds the same shard), and the update
is applied only when the Manager says every participant's reduction succeeded.

[Note: one step across groups] Per optimizer step, on every rank of every group:

1. :meth:`ReplicaGroups.start_step` starts the quorum (the strategy calls it before the forward, so
   the lighthouse's answer overlaps it; otherwise the first reduction starts it);
2. the first reduction of the backward waits for the quorum and sets each bucket's divisor to
   ``K * participants`` (:meth:`ReplicaGroups.before_reduction`): a healing group is not a
   participant (torchft zeroes its contribution);
3. each bucket's second hop (``[Note: hybrid reduction]`` in grad_bucket.py) is
   :meth:`ReplicaGroups.all_reduce`, a sum over the participating groups; a failure there is
   swallowed by the Manager and remembered;
4. before the update (a pre-update hook) :meth:`ReplicaGroups.commit` asks ``should_commit``: all
   ranks of a group get the same answer, and a group whose peers failed during the step discards
   it (no shard, moment or counter changes) and goes on in the same process with the next quorum.

[Note: healing] A group that (re)joins behind the others is healed by torchft from a live group,
group rank to group rank: the state this rank registered (:meth:`ReplicaGroups.register_state`:
the engine's masters, optimizer state and buffers from :func:`engine_state`, and whatever the
front end adds: loop counters, LR schedulers, the data position) is served by the source's
checkpoint server while its training thread runs forward and backward (nothing it serves changes
before its own ``should_commit``, which waits for the transfer), and applied on the healer's
training thread inside ``should_commit``, before the update. The healer's gradient of that step
counts for nothing (zeroed), so it applies the participants' average to the healed state and ends
the step bit-identical to its source; its parameters are rebuilt by the step's all-gather.

This module imports torchft only when a :class:`ReplicaGroups` is built; without fault tolerance
nothing of torchft is imported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import AllreduceOptions

if TYPE_CHECKING:
    from lightning_zero.engine.optimizer import ZeroOptimizer

FT_EXTRA = 'pip install "lightning-zero[ft]"'
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


class FaultTolerance:
    """Fault tolerance across replica groups (torchft), for ``ZeroLowLevelStrategy(fault_tolerance=...)``.

    Args:
        replica_group_id: this group's id (every rank of one group passes the same; groups differ).
        lighthouse: the torchft lighthouse's address (``http://host:port``); defaults to
            ``$TORCHFT_LIGHTHOUSE``.
        min_replica_groups: the fewest groups a step may commit with.
        timeout_s: bounds every cross-group collective, ``should_commit`` and a heal's transfer.
        quorum_timeout_s: bounds the wait for the lighthouse's quorum (at the start, groups starting at
            different times wait for each other until the lighthouse's ``--min_replicas`` have joined).

    After each optimizer step the strategy's ``fault_tolerance`` reports ``committed`` (was the step
    applied), ``participants`` (groups in its quorum), ``heals`` (how often this group was healed),
    ``last_heal_s`` (the last heal: the quorum that asked for it, the transfer and the load) and ``last_stall_s`` (the last discarded
    step: from its start to the decision), ``discarded`` (steps discarded so far) and ``steps`` (the steps
    the job has committed since it started, carried to a group by its heal: a Fabric loop counts by it).
    """

    def __init__(self, replica_group_id: int, lighthouse: str | None = None, min_replica_groups: int = 1,
                 timeout_s: float = 10.0, quorum_timeout_s: float = 60.0) -> None:
        if not isinstance(replica_group_id, int) or replica_group_id < 0:
            raise ValueError(f"replica_group_id must be an int >= 0, got {replica_group_id!r}.")
        if min_replica_groups < 1:
            raise ValueError(f"min_replica_groups must be at least 1, got {min_replica_groups}.")
        if timeout_s <= 0 or quorum_timeout_s <= 0:
            raise ValueError(f"timeout_s and quorum_timeout_s must be positive, got {timeout_s}, {quorum_timeout_s}.")
        self.replica_group_id = replica_group_id
        self.lighthouse = lighthouse
        self.min_replica_groups = min_replica_groups
        self.timeout_s = float(timeout_s)
        self.quorum_timeout_s = float(quorum_timeout_s)
        # What the last optimizer step did (written by ReplicaGroups.commit).
        self.committed = False
        self.participants = 0
        self.heals = 0
        self.discarded = 0
        self.steps = 0
        self.last_heal_s: float | None = None
        self.last_stall_s: float | None = None

    def lighthouse_address(self) -> str:
        address = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not address:
            raise ValueError(
                f"FaultTolerance needs the torchft lighthouse's address: pass lighthouse='http://HOST:PORT' or set"
                f" ${LIGHTHOUSE_ENV}. Start one with `torchft_lighthouse --min_replicas 1 --bind [::]:29510`."
            )
        return address

    def __repr__(self) -> str:
        return (f"FaultTolerance(replica_group_id={self.replica_group_id}, lighthouse={self.lighthouse!r},"
                f" min_replica_groups={self.min_replica_groups}, timeout_s={self.timeout_s})")


def import_torchft() -> Any:
    """torchft, or an error naming the extra that installs the tested version."""
    # torchft's Rust half logs at INFO unless RUST_LOG says otherwise: about ten lines a step (every quorum and
    # commit), written by the training processes. Read once, when its extension is imported: WARN for it, unless
    # the user asked for a level; the variable is put back, so nothing else in the process sees it.
    quiet = "RUST_LOG" not in os.environ
    if quiet:
        os.environ["RUST_LOG"] = "warn"
    try:
        import torchft
        import torchft.process_group  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"Fault tolerance needs torchft, which is not installed ({exc}). Install the tested version with {FT_EXTRA}."
        ) from exc
    finally:
        if quiet:
            del os.environ["RUST_LOG"]
    return torchft


@dataclasses.dataclass(frozen=True)
class DataQuorum:
    """A quorum as the data split sees it: this group's place in it (None: not taking part: a group that
    heals contributes nothing) and the number of groups taking part."""

    place: int | None
    participants: int

    def splits_like(self, other: DataQuorum) -> bool:
        """Whether batches split by ``other`` are this quorum's split: the same groups, this one in the same place
        (the lighthouse's quorum id is no test: torchft bumps it after any discarded step)."""
        return (self.place, self.participants) == (other.place, other.participants)


class ReplicaGroups:
    """This rank's torchft ``Manager`` and the cross-group half of each step ([Note: one step across groups]).

    ``group_rank``/``group_size``: this rank's place in its replica group (the job's own process group).
    The store the Manager needs is the group's (``MASTER_ADDR``/``MASTER_PORT``, as torchrun and
    Lightning's launcher set them)."""

    def __init__(self, config: FaultTolerance, group_rank: int, group_size: int, device: torch.device) -> None:
        self.config = config
        self.group_rank, self.group_size = group_rank, group_size
        # The Manager reconfigures the process group at each new quorum; the buckets' hop runs on it.
        self._pg, self.manager = self._connect(device)
        self._started_at: float | None = None
        self._buckets: Sequence[Any] = ()
        self._healed_at: float | None = None
        self._on_commit: list[Callable[[bool], None]] = []
        self._device = device
        self._contributors: Tensor | None = None
        self._contributors_work: Any = None
        self._participants = 1
        self._factor: Tensor | None = None
        self._reducing = False  # this step's before_reduction has run
        self._step_before_quorum = 0  # torchft's step when this step's quorum was asked for
        self._joined_by_heal: bool | None = None  # join's heal: loaded (True) or failed (False); None: none
        self._split_by_this_quorum = False  # this step's batches wait for its quorum (the last step was discarded)
        self._source_splits: bool | None = None  # the heal's source: its batches of this step split as asked
        self._deciding = False  # inside should_commit (where a heal of the step is applied)
        self.joining = False
        """True while :meth:`join` applies a heal (outside any optimizer step)."""
        self.data_quorum: DataQuorum | None = None
        """The quorum of the last decided step: how the next step's batches are split ([Note: data quorum])."""
        self.register_state("replica_groups", self.state, self.load_state)

    def _connect(self, device: torch.device) -> tuple[Any, Any]:
        """torchft's process group for the cross-group hop and this rank's ``Manager`` over it."""
        import_torchft()
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        config = self.config
        timeout = timedelta(seconds=config.timeout_s)
        # On GPUs the cross-group reduction runs on NCCL (gloo would stage every byte through the host).
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        manager = Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=config.min_replica_groups,
            use_async_quorum=True, timeout=timeout, quorum_timeout=timedelta(seconds=config.quorum_timeout_s),
            connect_timeout=timeout, rank=self.group_rank, world_size=self.group_size,
            replica_id=f"lightning_zero_{config.replica_group_id}", lighthouse_addr=config.lighthouse_address(),
        )
        return pg, manager

    def register_state(self, key: str, save: Callable[[], Any], load: Callable[[Any], None]) -> None:
        """``save`` (called on a torchft thread while the training thread runs forward and backward)
        returns this rank's part of ``key``; ``load`` puts a live peer's back ([Note: healing])."""

        def timed_load(state: Any) -> None:
            if self._healed_at is None:
                self._healed_at = time.perf_counter()
            load(state)

        self.manager.register_state_dict_fn(key, timed_load, save)

    def on_commit(self, callback: Callable[[bool], None]) -> None:
        """``callback(committed)`` after each step's decision (a front end's counters)."""
        self._on_commit.append(callback)

    def bind(self, buckets: Sequence[Any]) -> None:
        """The engine's buckets, whose divisor each backward sets."""
        self._buckets = buckets

    def join(self) -> None:
        """Before the first forward: the first quorum, and a heal applied at once when this group is
        behind (a relaunched group, or the first step's weight sync), so that its first forward already
        runs on the healed state and its first gradient counts."""
        started = time.perf_counter()
        self.start_step()
        with self._quorum_errors():
            self.manager.wait_quorum()  # a heal's transfer runs inside the quorum (torchft's thread)
        if _torchft_heal_pending(self.manager):
            self.joining = True
            self._healed_at = None
            try:
                _torchft_apply_heal(self.manager)
            finally:
                self.joining = False
            self._joined_by_heal = self._healed_at is not None  # False: the transfer failed, nothing loaded
            self.config.heals += 1
            self.config.last_heal_s = time.perf_counter() - started
            self.config.steps = self.manager.current_step()
        if self.data_quorum is None:  # the job's start (a heal brings its source's)
            self.data_quorum = self._quorum()

    def start_step(self) -> None:
        """Start this step's quorum, once (before the forward, so the lighthouse's answer overlaps it)."""
        if self._started_at is None:
            self._started_at = time.perf_counter()
            self._step_before_quorum = self.manager.current_step()  # [Note: a heal counts with its step]
            with self._quorum_errors():  # it first waits for the last quorum's end
                self.manager.start_quorum()

    def state(self) -> dict[str, Any]:
        """What a heal carries of this object: the split this step's batches were fetched with, and whether this
        step's quorum splits them so ([Note: a healer decides as its source]). Called on torchft's quorum thread once
        this step's quorum is in, maybe before this group's training thread has read it: after a discarded step, the
        batches are fetched with this very quorum, whatever ``data_quorum`` says yet."""
        quorum = _torchft_quorum_now(self.manager)
        fetched_by = self._fetched_by(quorum)
        return {"data_quorum": None if fetched_by is None else dataclasses.astuple(fetched_by),
                "splits": self._splits_as_fetched(quorum)}

    def load_state(self, state: dict[str, Any]) -> None:
        saved = state["data_quorum"]
        # The source's quorum, without the source's place: this group has none until it takes part in a step.
        self.data_quorum = None if saved is None else dataclasses.replace(DataQuorum(*saved), place=None)
        self._source_splits = bool(state.get("splits", True))  # a source of an older version: its own check only
        if self._deciding and not self._source_splits:  # a heal inside the step: before the group's answer
            self.manager.report_error(self._split_changed("the group this rank healed from"))

    def _fetched_by(self, quorum: DataQuorum) -> DataQuorum | None:
        """The split this step's batches were fetched with, ``quorum`` being this step's ([Note: data quorum]):
        after a discarded step they waited for ``quorum`` itself, whether or not ``data_quorum`` says so yet."""
        return quorum if self._split_by_this_quorum else self.data_quorum

    def _splits_as_fetched(self, quorum: DataQuorum) -> bool:
        """Whether this step's ``quorum`` splits the batches as they were fetched."""
        fetched_by = self._fetched_by(quorum)
        return fetched_by is None or quorum.splits_like(fetched_by)

    def _split_changed(self, who: str) -> RuntimeError:
        return RuntimeError(f"the quorum changed: {who} fetched this step's batches for another split of the groups"
                            f" ({self.data_quorum} -> {self._quorum()})")

    def before_reduction(self) -> None:
        """The first reduction of a step: the quorum is known; average over its participants. Once per step
        (a backward's end calls it again, and so does each backward of an accumulated step).

        [Note: contributors] torchft zeroes a healing rank's contribution, and counts among the participants
        only the groups at the quorum's newest step, so a group that heals because it is behind is neither
        summed nor counted. One heal is counted all the same: at the job's first step (the quorum's step 0)
        torchft's weight sync heals every group but one, per group rank, from one group or another, and every
        group is at step 0, so counted. At that step each backward also sums a 1 from every rank that
        contributes (a one-element all-reduce beside the buckets'), and each reduced row is rescaled by
        ``participants / contributors``: the average over the groups that contributed to that shard, exact
        whatever heals. The quorum's step (``current_step`` once the quorum is in: a healer takes its source's)
        is the same on every rank of every group in the quorum, so all take the same branch and launch the same
        collectives; past step 0 the all-reduce and the rescaling are skipped (a factor of 1). On the device,
        no host read: the factor is a tensor."""
        if self._reducing:
            return
        self._reducing = True
        self.start_step()
        with self._quorum_errors():
            participants = max(self.manager.num_participants(), 1)
        for bucket in self._buckets:
            bucket.average_over = self.group_size * participants
        self._participants = participants
        self._factor = None
        self._contributors_work = None
        if self.manager.current_step() == 0:  # the weight sync may count a healer: [Note: contributors]
            self._contributors = torch.ones(1, dtype=torch.float32, device=self._device)
            self._contributors_work = self.all_reduce(self._contributors).work

    def all_reduce(self, tensor: Tensor) -> Any:
        """(cross-group) Sum ``tensor`` over the contributing groups, rescaled as [Note: contributors]
        says; a failure is swallowed and makes :meth:`commit` discard the step.

        [Note: the cross-group hop] This is torchft's ``Manager.allreduce`` with the same rules (no collective
        once the step has failed, zeros from a healing rank, a failure reported to the Manager, which discards
        the step), on the same process group, without its wrapping: torchft chains futures on each work and
        arms a timeout on its timer thread when it is waited for, thread hand-offs that cost a step more than
        the sum itself on a small model (BENCHMARKS.md). The wait is bounded by ``timeout_s`` here."""
        manager = self.manager
        if manager.errored() is not None:
            return _CrossGroupSum(None, tensor, self)
        with self._quorum_errors():
            manager.wait_quorum()  # the process group is (re)configured by the quorum
        if not manager.is_participating():
            tensor.zero_()
        options = AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        try:
            work = self._pg.allreduce([tensor], options)
        except Exception as exc:  # a peer already gone: the step is discarded
            manager.report_error(exc)
            work = None
        return _CrossGroupSum(work, tensor, self)

    def wait_hop(self, work: Any) -> bool:
        """Wait for a cross-group work within ``timeout_s``; False (and the failure reported) if it failed."""
        if work is None:
            return False
        try:
            work.wait(timedelta(seconds=self.config.timeout_s))
        except Exception as exc:
            self.manager.report_error(exc)
            return False
        return True

    def rescale_factor(self) -> Tensor | None:
        """``participants / contributors`` of this step, or None where every participant contributes (or
        the step failed: it is discarded)."""
        if self._factor is None and self._contributors_work is not None:
            if not self.wait_hop(self._contributors_work):
                return None
            self._factor = self._contributors.clamp(min=1.0).reciprocal().mul_(float(self._participants))
        return self._factor

    def commit(self) -> bool:
        """Whether this step's update may be applied (the same answer on every rank of the group).
        A heal's state is applied in here, before the answer.

        [Note: data quorum] The batches of a step are split by the quorum they were fetched under
        (``data_quorum``): the last committed step's, or after a discarded step the next step's, asked for
        and waited for before its batches are fetched. A step whose own quorum splits otherwise (a group
        joined: the groups or this group's place differ) is discarded by every group that sees it, and the
        next is split by the new quorum. So no sample of a committed step is missed or seen twice, a group
        lost costs the step it was lost in, and a group that joins costs one step. Every group asks for
        one quorum per step, as torchft's lighthouse expects. (torchft's quorum id is no test of a change:
        it is bumped after any discarded step.)

        [Note: a healer decides as its source] Each group answers ``should_commit`` alone, so the groups of a
        quorum must reach the same answer from what each knows. A group that heals in the step contributes
        nothing and fetched its batches by its own history, which is not its source's: were it to judge its own
        split, it could commit a step its source discards (or the reverse) and end a step ahead of its source,
        which then heals from it, judges its own split, and so on: two groups taking turns, neither committing
        the steps the other does. So the healer judges no split of its own: its source serves, with its state,
        whether its own batches of the step were split as the quorum splits them, and the healer discards the
        step when that check fails the source (the heal is applied inside ``should_commit`` before the group's
        answer, or before the step in :meth:`join`). A failure only the source sees (a sum that broke for it
        alone) is not carried: that costs a step more, once (the former healer's split names no place, so the
        next quorum that counts it changes every group's split). After a discarded step the next batches wait
        for the next quorum, so its split is the one they were fetched with, whichever thread reads it first.
        """
        self.start_step()  # a step with no reduction (no backward) still takes part in the quorum
        with self._quorum_errors():
            self.manager.wait_quorum()  # is_participating() reads this step's quorum without waiting for it
            healing = not self.manager.is_participating()
            participants = self.manager.num_participants()
            quorum = self._quorum()
        if not healing and not self._splits_as_fetched(quorum):
            self.manager.report_error(self._split_changed("this group"))
        elif healing and self._source_splits is False:  # healed before the step (join): as its source decides
            self.manager.report_error(self._split_changed("the group this rank healed from"))
        self._healed_at = None
        heal_start = time.perf_counter()
        self._deciding = True
        try:
            committed = bool(self.manager.should_commit())
        except Exception as exc:
            raise RuntimeError(
                f"Replica group {self.config.replica_group_id}: its ranks did not decide the step together within"
                f" {self.config.timeout_s} s ({exc}): a rank of this group stopped (its own log says why). torchrun"
                " restarts the group, which heals from a live group."
            ) from exc
        finally:
            self._deciding, self._source_splits = False, None
        report = self.config
        report.committed = committed
        report.participants = participants
        report.steps = self.manager.current_step()
        if healing and self._healed_at is not None:
            report.heals += 1
            report.last_heal_s = time.perf_counter() - heal_start
        # Did this step's quorum heal this rank, and was a state loaded ([Note: a heal counts with its step])?
        heal_loaded = self._joined_by_heal if self._joined_by_heal is not None else (
            self._healed_at is not None if healing else None)
        self._joined_by_heal = None
        if not committed:
            report.discarded += 1
            assert self._started_at is not None
            report.last_stall_s = time.perf_counter() - self._started_at
            if quorum.place is None and heal_loaded is not None and not self._whole_group_loaded(heal_loaded):
                self._forget_heal()
        self._started_at = None
        self._reducing = False
        self._split_by_this_quorum = not committed  # before the next quorum is asked for (a heal may read it)
        if committed:
            self.data_quorum = quorum
        else:
            # The groups may have changed (a group lost fails the step): the next batches are split by the next
            # quorum, asked for now, once, as at the start of any step (the next step does not ask again).
            self.start_step()
            with self._quorum_errors():
                self.manager.wait_quorum()
                self.data_quorum = self._quorum()
        for callback in self._on_commit:
            callback(committed)
        return committed

    def _whole_group_loaded(self, loaded: bool) -> bool:
        """(collective over this group's ranks) Whether every rank of the group loaded its heal's state."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return loaded
        flag = torch.tensor([1.0 if loaded else 0.0], device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, async_op=True).wait(timedelta(seconds=self.config.timeout_s))
        return bool(flag.item())

    def _forget_heal(self) -> None:
        """[Note: a heal counts with its step] A group's ranks heal from different sources (torchft spreads them
        over the live groups), and each rank's transfer succeeds or fails alone: when a source dies during a heal,
        one rank may hold its source's state and the other its own (its step discarded, as the failed transfer
        says). torchft then reports the group to the lighthouse at the step of whichever rank asked last, and a
        group reported at the newest step is not healed again. So after a discarded step whose quorum healed this
        group (it was behind: no place in the quorum, the same on all its ranks), the group's ranks ask each other
        whether all of them loaded a state (a collective on the group's own process group, only then; after
        should_commit, which every rank of the group reached). If one did not, each goes back to the step it had
        before that quorum, and the next quorum heals the whole group again, from the groups then alive: no rank
        keeps a state that its group did not take whole."""
        manager = self.manager
        manager.load_state_dict({"step": self._step_before_quorum, "batches_committed": manager.batches_committed()})

    def decide(self, optimizer: ZeroOptimizer) -> bool:
        """The pre-update hook of ``optimizer``: :meth:`commit`, and for a discarded step no update (and,
        when the step healed this rank, its parameters gathered from the healed masters now)."""
        heals = self.config.heals
        if self.commit():
            return True
        optimizer.skip_next_update()
        if self.config.heals != heals:
            optimizer.gather_params(all_buckets=True)
        return False

    def data_split(self) -> tuple[int, int]:
        """(ranks, rank) of the next batch across the replica groups ([Note: every sample once across replica
        groups] in data.py): the last decided quorum's groups times this group's ranks, and this rank's place."""
        quorum = self.data_quorum
        if quorum is None:
            return self.group_size, self.group_rank
        return quorum.participants * self.group_size, (quorum.place or 0) * self.group_size + self.group_rank

    def writes_checkpoints(self) -> bool:
        """Whether this group writes the job's checkpoints: the first group of the last step's quorum
        (one group writes; the others skip without waiting for it)."""
        return self.data_quorum is None or self.data_quorum.place == 0

    def _quorum(self) -> DataQuorum:
        return DataQuorum(self.manager.participating_rank(), max(self.manager.num_participants(), 1))

    @contextlib.contextmanager
    def _quorum_errors(self) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            raise RuntimeError(
                f"Replica group {self.config.replica_group_id}: no quorum from the torchft lighthouse at"
                f" {self.config.lighthouse_address()} within {self.config.quorum_timeout_s} s ({exc}). The lighthouse"
                " is down or unreachable, or fewer groups than its --min_replicas are up. Restart the lighthouse"
                " and the groups: they resume from the last checkpoint (trainer.fit(ckpt_path=\"last\"))."
            ) from exc

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def _torchft_heal_pending(manager: Any) -> bool:
    """Whether the quorum just waited for asks this rank to heal (``Manager._healing``, torchft 2026.10)."""
    return bool(manager._healing)


def _torchft_quorum_now(manager: Any) -> DataQuorum:
    """The quorum as torchft's quorum thread has just set it (``Manager._participating_replica_rank`` and
    ``_participating_replica_world_size``, torchft 2026.10), read on that thread: a state function runs inside the
    quorum's future, where ``participating_rank()`` would wait for that very future."""
    return DataQuorum(manager._participating_replica_rank, max(manager._participating_replica_world_size, 1))


def _torchft_apply_heal(manager: Any) -> None:
    """Apply the received state now, as torchft itself does with a synchronous quorum
    (``Manager._apply_pending_state_dict``, torchft 2026.10); this rank then takes part in the step."""
    manager._apply_pending_state_dict()
    manager._healing = False


class _CrossGroupSum:
    """A bucket row's cross-group sum ([Note: the cross-group hop]): once it has arrived, rescaled by
    [Note: contributors]. ``work`` None: the step had failed before it (nothing was sent)."""

    def __init__(self, work: Any, tensor: Tensor, groups: ReplicaGroups) -> None:
        self.work, self.tensor, self.groups = work, tensor, groups

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self.groups.wait_hop(self.work):
            factor = self.groups.rescale_factor()
            if factor is not None:
                self.tensor.mul_(factor.to(self.tensor.dtype))
        return True  # a failed sum leaves the row as it is: commit discards the step


def engine_state(engine: Any) -> dict[str, Any]:
    """This rank's part of a :class:`~lightning_zero.engine.ZeroEngine`'s training state, for a heal: the master shards, each optimizer's
    state and hyper-parameters (in the engine's order, the same in every group of the same size), and
    the module's buffers. Tensors are the live ones: torchft serves them before they next change."""
    optimizers = []
    for opt in engine.optimizers:
        state = {index: dict(opt.state[sp.master]) for index, sp in enumerate(opt.sharded_params)
                 if opt.state.get(sp.master)}
        groups = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
        optimizers.append({"state": state, "param_groups": groups})
    return {
        "masters": [sp.master for sp in engine.sharded_params.values()],
        "optimizers": optimizers,
        "buffers": [b.detach() for b in engine.module_buffers()],
    }


@torch.no_grad()
def load_engine_state(engine: Any, state: dict[str, Any]) -> None:
    """Put a peer's :func:`engine_state` into this rank's engine (the layout is the same: the same
    module, group size and group rank)."""
    masters = [sp.master for sp in engine.sharded_params.values()]
    if len(state["masters"]) != len(masters) or any(
            a.shape != b.shape for a, b in zip(state["masters"], masters, strict=True)):
        raise RuntimeError("A heal's state does not match this rank's shards: the replica groups differ in model or size.")
    torch._foreach_copy_(masters, [t.to(m.device) for t, m in zip(state["masters"], masters, strict=True)])
    engine.drop_save_caches()  # the state's tensors are replaced
    for opt, saved in zip(engine.optimizers, state["optimizers"], strict=True):
        for index, sp in enumerate(opt.sharded_params):
            entry = saved["state"].get(index)
            if entry is None:
                opt.state.pop(sp.master, None)
                continue
            local = opt.state.get(sp.master) or {}
            opt.state[sp.master] = {k: _placed(v, local.get(k), sp.master.device) for k, v in entry.items()}
        for group, hyper in zip(opt.param_groups, saved["param_groups"], strict=True):
            group.update(hyper)
    for buffer, saved_buffer in zip(engine.module_buffers(), state["buffers"], strict=True):
        buffer.detach().copy_(saved_buffer)


def _placed(value: Any, local: Any, device: torch.device) -> Any:
    """A received state value on the device this rank keeps it on: where its own value is, else with the
    master for shards and on the host for scalars (Adam's ``step`` outside capturable mode)."""
    if not isinstance(value, Tensor):
        return value
    if isinstance(local, Tensor):
        target = local.device
    else:
        target = device if value.dim() > 0 else torch.device("cpu")
    return value.to(target, copy=True)
