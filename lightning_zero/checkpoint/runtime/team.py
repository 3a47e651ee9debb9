"""The ranks a save or load runs over, and the exchanges between them that survive a failing rank.

Background saves coordinate over a gloo group of their own (the coordination group), never the
training group: a collective there from another thread could interleave with training collectives
and deadlock. Every exchange here either completes on every rank or raises :func:`peer_lost` on
each; [Note: same collectives on every rank] in saver.py says why a failure is exchanged, not raised.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from lightning_zero.checkpoint.runtime import process
from lightning_zero.checkpoint.store.storage import CheckpointCorruptError, Location
from lightning_zero.engine.collectives import new_group, peer_failure

T = TypeVar("T")


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def set_up_coordination(local_ranks: int | None = None) -> None:
    """(collective, every rank, training thread) Create what background saves coordinate over:
    the gloo group. The strategy calls this at setup, so that no save (in ``local`` mode: no
    collective at all) has to make a collective on the training thread. ``local_ranks``: the
    ranks on this node, which share its CPUs between their reader threads ([Note: parallel reads])."""
    coordination_group()
    if local_ranks is not None:
        process.state().local_ranks = local_ranks


def ranks_on_this_node() -> int:
    """What ``set_up_coordination`` was told, else torchrun's ``LOCAL_WORLD_SIZE``, else every rank (the safe
    guess: fewer reader threads)."""
    local_ranks = process.state().local_ranks
    if local_ranks is not None:
        return local_ranks
    if os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return world()[1]


def coordination_group() -> Any:
    """(collective, training thread, first call) a gloo group for background coordination.

    Its timeout is the training group's (the strategy's ``timeout``): a peer that died or froze in a
    save then fails the save within the time the user chose for training collectives, instead of
    gloo's 30 minutes."""
    current = process.state()
    if current.coordination_group is None and world()[1] > 1:
        current.coordination_group = new_group(backend="gloo")
    return current.coordination_group


@dataclass(frozen=True)
class Team:
    """The ranks one save or load runs over, and its coordinator.

    The default is every rank, over the coordination group, coordinated by rank 0. With the
    functional API's ``process_group`` (SageMaker's argument: a replica group saving as a unit),
    only that group's ranks take part; its ``coordinator_rank`` (a global rank; default: the
    group's lowest) names the version directory and writes the commit marker and ``objects.pt``."""

    group: Any  # a gloo group (background coordination and DCP run on it), None with one process
    rank: int  # this rank's position in the team
    world_size: int
    coordinator: int  # the coordinator's position in the team
    coordinator_global: int  # its global rank
    default: bool  # every rank, coordinated by rank 0 (what the Trainer and plugin use)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.coordinator

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """The team's global ranks, in team order."""
        if self.group is None:
            return (0,)
        return tuple(dist.get_process_group_ranks(self.group))


def make_team(process_group: Any = None, coordinator_rank: int | None = None) -> Team:
    """(training thread) Validate the functional API's group arguments; the same on every rank."""
    rank, world_size = world()
    if process_group is None:
        coordinator = 0 if coordinator_rank is None else coordinator_rank
        if not 0 <= coordinator < world_size:
            raise ValueError(f"coordinator_rank={coordinator_rank} is not a rank of the world (size {world_size}).")
        return Team(coordination_group(), rank, world_size, coordinator, coordinator, coordinator == 0)
    if "gloo" not in dist.get_backend(process_group):
        raise ValueError(
            f"process_group must be a gloo group (its backend is {dist.get_backend(process_group)!r}): saves"
            " coordinate on a background thread with CPU collectives. Create it with"
            " torch.distributed.new_group(ranks, backend='gloo')."
        )
    ranks = dist.get_process_group_ranks(process_group)
    if rank not in ranks:
        raise ValueError(f"rank {rank} is not in process_group (ranks {ranks}): only its ranks may call this.")
    coordinator_global = ranks[0] if coordinator_rank is None else coordinator_rank
    if coordinator_global not in ranks:
        raise ValueError(f"coordinator_rank={coordinator_rank} is not in process_group (ranks {ranks}).")
    return Team(process_group, ranks.index(rank), len(ranks), ranks.index(coordinator_global), coordinator_global,
                 len(ranks) == world_size and coordinator_global == 0)


def all_gather_objects(value: Any, group: Any) -> list[Any]:
    if world()[1] == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(out, value, group=group)
    except Exception as exc:  # gloo: "Connection closed by peer" (killed) or "Timed out" (frozen)
        raise peer_lost(exc) from exc
    return out


def peer_lost(exc: BaseException, loading: bool = False) -> RuntimeError:
    """The error for a checkpoint collective that another rank never completed."""
    outcome = ("Nothing was loaded" if loading else
               "Nothing of this checkpoint is committed unless rank 0 wrote its marker")
    return RuntimeError(
        f"rank {world()[0]}: lost contact with another rank in a checkpoint collective: {peer_failure(exc)}"
        f" {outcome}; check the other ranks' logs."
    )



def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` where Python has it (3.11+)."""
    if hasattr(error, "add_note"):
        error.add_note(note)


def sendable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling (to other ranks), else a RuntimeError with its text (raised
    on the coordinator too, so every rank raises the same type)."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - an exception class that does not pickle
        converted = RuntimeError(f"{type(error).__name__}: {error}")
        converted.__cause__ = error
        return converted
    return error


def fail_together(error: BaseException | None, loc: Location, team: Team | None = None) -> None:
    """(collective over the coordination group, or the team's, when there is more than one rank) Raise
    on every rank if any rank failed: this rank's own error, or one that names the failing ranks."""
    team = team if team is not None else make_team()
    reports: list[str | None] = [None]
    if team.world_size > 1:
        report = None if error is None else f"rank {world()[0]}: {type(error).__name__}: {error}"
        reports = all_gather_objects(report, team.group)
    if error is not None:
        raise error
    failed = [r for r in reports if r]
    if failed:
        raise CheckpointCorruptError(f"Loading checkpoint {loc.url!r} failed on another rank, so no rank loads it: "
                                     + "; ".join(failed))



def checked_on_every_rank(check: Callable[[], T], loc: Location, team: Team | None = None) -> T:
    """Run ``check`` (reads and checks that may fail on this rank only), then :func:`fail_together`: every rank
    raises together, or every rank goes on with its result (DCP's ``_DistWrapper`` collects each rank's
    exception the same way)."""
    result: T | None = None
    error: BaseException | None = None
    try:
        result = check()
    except Exception as exc:
        error = exc
    fail_together(error, loc, team)
    return result  # type: ignore[return-value]


def from_coordinator(read: Callable[[], T], team: Team, what: str) -> T:
    """(collective over the team) ``read()`` on the team's coordinator only; its result on every rank, or
    its error raised on every rank with a note naming the rank that read ``what``.

    The broadcast is where every rank is, before anything that may fail on one rank only, so no rank
    waits in it for a rank that has left."""
    result: T | None = None
    error: BaseException | None = None
    if team.is_coordinator:
        try:
            result = read()
        except Exception as exc:
            error = sendable(exc)
    payload = [(result, error)]
    try:
        dist.broadcast_object_list(payload, src=team.coordinator_global, group=team.group)
    except Exception as exc:  # gloo: a peer died or froze
        if error is not None:  # the cause, which the others may have timed out waiting for
            add_note(error, f"Sending it to the other ranks failed too: {type(exc).__name__}: {exc}")
            raise error  # noqa: B904 - its own cause (the storage error) stays; exc is its context
        raise peer_lost(exc, loading=True) from exc
    if error is not None:
        raise error
    result, received = payload[0]
    if received is not None:
        add_note(received, f"rank {team.coordinator_global} read {what} for every rank ([Note: shared metadata]).")
        raise received
    return result  # type: ignore[return-value]

