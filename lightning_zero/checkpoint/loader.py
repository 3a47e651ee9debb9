"""Loading: any checkpoint into a state dict, in place, at the world size it was saved at or (``sharded``,
``full``) any other.

Call order (every rank makes each call):

1. ``load(state, id)``: finalizes the save in flight, then opens the checkpoint (``opening.open_checkpoint``:
   the commit marker, the mode and, for ``sharded``, DCP's ``.metadata``, read once by the team's
   coordinator for every rank).
2. Everything that can fail on one rank only (a missing or damaged file, another model, a transient read
   error) is read and checked without touching ``state``; the ranks agree over the coordination group
   (``team.checked_on_every_rank``), so all fail together, each naming the failing rank.
3. The tensors are copied into ``state`` (``full``/``local``) or DCP's collective read fills them
   (``sharded``, resharded to this world size).

Steps 2 and 3 are the mode's (``opened.mode.prepare_load``: [Note: modes as objects] in modes/base.py).

:mod:`~lightning_zero.checkpoint.saver` writes what this reads; the Lightning resume built on it is
:mod:`~lightning_zero.checkpoint.lightning.resume`."""

from __future__ import annotations

from typing import Any, cast

from lightning_zero.checkpoint.modes import Mode, OpenedCheckpoint
from lightning_zero.checkpoint.opening import open_checkpoint
from lightning_zero.checkpoint.runtime.team import Team, checked_on_every_rank, make_team
from lightning_zero.checkpoint.store.tuning import DEFAULT_TUNING, CheckpointTuning


def load(state_dict: dict[str, Any], checkpoint_id: str, *,
         storage_options: dict[str, Any] | None = None, process_group: Any = None,
         coordinator_rank: int | None = None, strict: bool = True,
         tuning: CheckpointTuning | None = None) -> dict[str, Any]:
    """Fill the tensors and :class:`FlatShard` leaves of ``state_dict`` in place from a checkpoint
    of any mode (``sharded`` and ``full`` at any world size, ``local`` at the one it was saved
    with). Returns the checkpoint's non-tensor content (and, for ``full``, everything).

    (every rank) Everything that can fail on one rank only (a missing or damaged file, a transient
    read error, another model) is read and checked first, then the ranks agree (one exchange over the
    coordination group) before any of them copies a tensor or enters DCP's collectives: all fail
    together, each naming the failing rank, instead of the others waiting in DCP.

    ``process_group`` (a gloo group) and ``coordinator_rank``: only that group's ranks load, as a
    unit, and their exchanges run over it (see :func:`async_save`); a ``local`` checkpoint is then
    read by the rank's position in the group. ``strict=False``: tensors the checkpoint holds beyond
    ``state_dict``'s are ignored (every leaf of ``state_dict`` must still be in it).
    """
    team = make_team(process_group, coordinator_rank)
    # Finalizes the save in flight first.
    opened = open_checkpoint(checkpoint_id, storage_options, team=team, tuning=tuning or DEFAULT_TUNING)
    return load_opened(state_dict, opened, team=team, strict=strict)


def load_opened(state_dict: dict[str, Any], opened: OpenedCheckpoint, *, team: Team | None = None,
                strict: bool = True) -> dict[str, Any]:
    """:func:`load` from a checkpoint already opened for this load (``opening.open_checkpoint``, over the
    same ``team``): its marker and ``.metadata`` are not read again."""
    team = team if team is not None else make_team()
    finish = checked_on_every_rank(lambda: opened.mode.prepare_load(state_dict, opened, team, strict), opened.loc, team)
    return finish()


def saved_tensor_keys(opened: OpenedCheckpoint) -> set[str]:
    """Paths of the tensors a ``local`` or ``sharded`` checkpoint holds (a ``local`` one from
    :func:`~lightning_zero.checkpoint.modes.local.read_own_rank_file`)."""
    return opened.mode.saved_tensor_keys(opened)


def saved_param_groups(opened: OpenedCheckpoint) -> list[list[dict[str, Any]]]:
    """Each saved optimizer's param groups (hyper-parameters, ``params`` as parameter names) of a ``local``
    or ``sharded`` checkpoint, read before the load that follows (a ``local`` rank file stays read ahead)."""
    objects = opened.mode.saved_objects(opened)
    saved = objects.get("optimizer") or []
    return [list(entry.get("param_groups") or []) for entry in saved]


def read_mode(checkpoint_id: str, storage_options: dict[str, Any] | None = None) -> Mode:
    """``local``, ``sharded`` or ``full`` (a file without a commit marker)."""
    return cast(Mode, open_checkpoint(checkpoint_id, storage_options).mode.name)

