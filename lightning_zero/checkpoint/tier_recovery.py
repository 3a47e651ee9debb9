"""Which tier a ``ckpt_path="last"`` resume reads, and the files a rank fetches from a replica holder.

[Note: choosing a tier] Every rank lists the committed local-tier checkpoints of its own directory (the
ranks whose files each marker lists and that are on disk); rank 0 adds the newest durable checkpoint (the
ModelCheckpoint ``last`` candidates, by global step). After one exchange every rank computes the same
answer: a local checkpoint is complete when it was saved at the current world size and every rank's file
is on some node (its own or a replica). The newest complete local checkpoint is taken when it is at least
as new (global step) as the newest durable one; otherwise the durable one (another world size always
takes it: it is the tier that reshards). A rank whose own directory lacks its file (its node lost its
storage) receives it, and the marker, from the lowest rank holding a copy, over the coordination group,
and writes both into its own directory, so the load that follows reads local files only and the node
holds its copy again. Rank 0 logs the choice and the reason.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_zero.checkpoint import file_io, replication, storage
from lightning_zero.checkpoint.modes import local
from lightning_zero.checkpoint.team import all_gather_objects, make_team, set_up_coordination
from lightning_zero.checkpoint.tiers import TIER_KEY, LocalTier, order_key, tier_markers


class NothingToResume(storage.CheckpointNotFoundError):
    """``ckpt_path="last"`` with a local tier found no checkpoint on any tier (every rank alike): the fit
    starts from scratch, as Lightning's own "last" does."""


@dataclass(frozen=True)
class TierChoice:
    """The checkpoint a resume reads: ``path`` (this rank's: a local-tier path differs per node), its tier
    (``"local"`` or ``"durable"``), the durable fallback (None if there is none) and why."""

    path: str
    tier: str
    durable: str | None
    reason: str
    step: int | None = None


def _inventory(root: str) -> list[dict[str, Any]]:
    """This directory's committed local-tier checkpoints, with the rank files actually present."""
    found = []
    for path, marker in tier_markers(root):
        loc = storage.resolve(path)
        version_dir = storage.version_dir_of(loc, marker)
        ranks = [r for r in marker[TIER_KEY].get("ranks", [])
                 if os.path.isfile(local.rank_file(version_dir, r, int(marker["world_size"])))]
        found.append({"name": os.path.basename(path), "save_id": marker.get("save_id"), "key": order_key(marker),
                      "world_size": int(marker["world_size"]), "ranks": ranks, "data": marker["data"]})
    return found


def _durable_step(url: str, storage_options: dict[str, Any]) -> int:
    """The global step a durable checkpoint was saved at (-1 if unknown): a commit marker carries Lightning's
    top-level fields, as a ``full`` file does ([Note: marker format] in storage.py), so one read serves both."""
    loc = storage.resolve(url, storage_options)
    step = file_io.torch_load(loc, loc.path).get("global_step")
    return step if isinstance(step, int) else -1


def _newest_durable(candidates: list[str], storage_options: dict[str, Any]) -> tuple[str, int] | None:
    best: tuple[str, int] | None = None
    for url in candidates:
        try:
            step = _durable_step(url, storage_options)
        except Exception:  # damaged or unreadable: the load's own fallback deals with the rest
            continue
        if best is None or step > best[1]:
            best = (url, step)
    return best


def resolve_last(tier: LocalTier, root: str, durable_candidates: list[str],
                 storage_options: dict[str, Any]) -> TierChoice:
    """(collective over the coordination group, every rank, training thread) See [Note: choosing a tier]."""
    set_up_coordination()
    team = make_team()
    world_size = team.world_size
    place = (socket.gethostname(), root)
    durable = _newest_durable(durable_candidates, storage_options) if team.is_coordinator else None
    gathered = all_gather_objects((place, _inventory(root), durable), team.group)
    durable = gathered[team.coordinator][2]
    holders: dict[str, dict[int, list[int]]] = {}
    entries: dict[str, dict[str, Any]] = {}
    for holder, (_, inventory, _) in enumerate(gathered):
        for entry in inventory:
            sid = entry["save_id"]
            entries.setdefault(sid, entry)
            for r in entry["ranks"]:
                holders.setdefault(sid, {}).setdefault(r, []).append(holder)
    complete = [e for sid, e in entries.items()
                if e["world_size"] == world_size and all(r in holders[sid] for r in range(world_size))]
    newest = max(complete, key=lambda e: e["key"], default=None)
    newest_any = max(entries.values(), key=lambda e: e["key"], default=None)
    durable_url, durable_step = durable if durable is not None else (None, -1)
    lost = ""
    if newest_any is not None and (newest is None or newest_any["key"] > newest["key"]):
        lost = (f"the newest local-tier checkpoint {newest_any['name']!r} (step {newest_any['key'][0]}) is not"
                " complete at this world size" + (f" (saved with {newest_any['world_size']} ranks)"
                                                  if newest_any["world_size"] != world_size else
                                                  ": both copies of some rank's file are lost"))
    if newest is not None and newest["key"][0] >= durable_step:
        reason = (f"local tier: {newest['name']!r} at step {newest['key'][0]} is complete on the nodes' local storage"
                  + (f" and not older than the durable {durable_url!r} (step {durable_step})" if durable_url else
                     " and no durable checkpoint exists"))
        if lost:
            rank_zero_warn(f'ckpt_path="last": {lost}; resuming from an older one. ' + reason)
        _fetch_missing(newest, holders[newest["save_id"]], gathered, root, team)
        choice = TierChoice(os.path.join(root, newest["name"]), "local", durable_url, reason, newest["key"][0])
    elif durable_url is not None:
        reason = (f"durable tier: {durable_url!r} at step {durable_step}, "
                  + (lost if lost and newest is None else
                     f"newer than the local tier's newest complete checkpoint (step {newest['key'][0]})"
                     if newest is not None else "no complete local-tier checkpoint"))
        if lost:
            rank_zero_warn(f'ckpt_path="last": {lost}; falling back to the durable tier. ' + reason)
        choice = TierChoice(durable_url, "durable", durable_url, reason, durable_step)
    elif lost:
        raise storage.CheckpointNotFoundError(
            f'ckpt_path="last": {lost}, and no durable checkpoint exists. Pass the path of a checkpoint to resume'
            " from, or start without ckpt_path.")
    else:
        raise NothingToResume('ckpt_path="last": no checkpoint on the local tier or the durable path.')
    rank_zero_info(f'ckpt_path="last" resumes from the {choice.reason}.')
    return choice


def _fetch_missing(entry: dict[str, Any], holders: dict[int, list[int]], gathered: list[Any], root: str,
                   team: Any) -> None:
    """(every rank) Ranks whose own directory lacks their file of ``entry`` receive it (and the marker)
    from the lowest rank holding a copy; written whole into their own directory before the load."""
    world_size = entry["world_size"]
    plan: list[tuple[int, int, str]] = []
    for r in range(world_size):
        own = [e for e in gathered[r][1] if e["save_id"] == entry["save_id"]]
        if own and r in own[0]["ranks"]:
            continue
        holder = min(holders[r])
        plan.append((holder, r, f"file:{r}"))
        if not own:  # after the file: a marker never names a file that is not there
            plan.append((holder, r, "marker"))
    if not plan:
        return
    marker_path = os.path.join(root, entry["name"])
    version_dir = os.path.join(root, entry["data"])

    def path_of(key: str) -> str:
        if key == "marker":
            return marker_path
        return local.rank_file(version_dir, int(key.split(":")[1]), world_size)

    replication.send_plan(plan, team.rank, team.group, path_of)
    fetched = sorted({receiver for _, receiver, _ in plan})
    rank_zero_info(f"Local tier: rank(s) {fetched} fetched their files of {entry['name']!r} from a replica holder.")
