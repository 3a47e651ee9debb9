"""Which tier a ``ckpt_path="last"`` resume reads, and the files a rank fetches from a replica holder.

[Note: choosing a tier] Every rank lists the committed local-tier checkpoints of its own directory (the
ranks whose files each marker lists and that are on disk); rank 0 adds the newest durable checkpoint (the
ModelCheckpoint ``last`` candidates, by global step). After one exchange every rank computes the same
answer. A local checkpoint is complete when every rank's file is on some node (its own or a replica) or,
saved at another world size or shard group size, when some node holds a file of every shard position and
old rank 0's. The newest complete local checkpoint is taken when it is at least as new (global step) as
the newest durable one; otherwise the durable one. Saved at this world size and shard group size, a rank
whose own directory lacks its file (its node lost its storage) receives it, and the marker, from the
lowest rank holding a copy, over the coordination group, writes both into its own directory and checks
the copy's CRCs, so the load that follows reads local files only and the node holds its copy again.
Saved at another one, it is resharded from the nodes holding it ([Note: fast-tier reshard] in
tiered/reshard.py). A damaged or unreadable copy found either way drops that checkpoint, with one warning
naming the rank, the file and the reason, and the choice is made again among the rest: an older local
one, else the durable one. Rank 0 logs the choice and the reason.
"""

from __future__ import annotations

import os
import socket
import time
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_zero.checkpoint.modes import local
from lightning_zero.checkpoint.runtime.team import all_gather_objects, make_team, set_up_coordination
from lightning_zero.checkpoint.store import file_io, storage
from lightning_zero.checkpoint.tiered import replication
from lightning_zero.checkpoint.tiered import reshard as tier_reshard
from lightning_zero.checkpoint.tiered.tiers import TIER_KEY, LocalTier, order_key, tier_markers


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
    resharded_from: int | None = None
    """The world size the local-tier checkpoint was saved at, when it was resharded to this one."""
    choose_s: float = 0.0
    """Listing every node's checkpoints and choosing (one exchange)."""
    reshard_s: float = 0.0
    """Making the chosen local-tier checkpoint readable here: missing files fetched, or the reshard."""
    steps_lost: int = 0
    """Checkpointed steps not recovered: the newest step any tier holds (complete or not) minus this one."""
    moved: dict[str, int] = field(default_factory=dict)
    """A reshard's bytes: read from this node (``read_bytes``), received from and sent to other nodes."""
    last_saved_at: float | None = None
    """Wall-clock time (``time.time()``, the coordinator's) of the newest local-tier save on any node,
    complete or not: the last moment the previous run is known to have been training ([Note: a recovery's
    timeline] in runtime/stats.py). None when the local tier holds no checkpoint."""


def _inventory(root: str) -> list[dict[str, Any]]:
    """This directory's committed local-tier checkpoints, with the rank files actually present."""
    found = []
    for path, marker in tier_markers(root):
        loc = storage.resolve(path)
        version_dir = storage.version_dir_of(loc, marker)
        ranks = [r for r in marker[TIER_KEY].get("ranks", [])
                 if os.path.isfile(local.rank_file(version_dir, r, int(marker["world_size"])))]
        found.append({"name": os.path.basename(path), "save_id": marker.get("save_id"), "key": order_key(marker),
                      "world_size": int(marker["world_size"]), "ranks": ranks, "data": marker["data"],
                      "shard_group_size": int(marker.get("shard_group_size", marker["world_size"])),
                      "durable": marker[TIER_KEY].get("durable")})
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


def _loads_as_saved(entry: dict[str, Any], held: dict[int, list[int]], world_size: int, shard_group_size: int) -> bool:
    """Saved at this world size and shard group size, with every rank's file on some node."""
    return (entry["world_size"] == world_size and entry["shard_group_size"] == shard_group_size
            and all(r in held for r in range(entry["world_size"])))


def _reshardable(entry: dict[str, Any], held: dict[int, list[int]]) -> bool:
    """Some node holds a file of every shard position, and old rank 0's (its non-shard tensors and state)."""
    size = entry["shard_group_size"]
    return 0 in held and all(any(r % size == k for r in held) for k in range(size))


def resolve_last(tier: LocalTier, root: str, durable_candidates: list[str],
                 storage_options: dict[str, Any], shard_group_size: int | None = None) -> TierChoice:
    """(collective over the coordination group, every rank, training thread) See [Note: choosing a tier].
    ``shard_group_size``: the resuming strategy's (None: the whole world)."""
    started = time.perf_counter()
    set_up_coordination()
    team = make_team()
    world_size = team.world_size
    target_size = shard_group_size or world_size
    place = (socket.gethostname(), root)
    durable = _newest_durable(durable_candidates, storage_options) if team.is_coordinator else None
    gathered = all_gather_objects((place, _inventory(root), durable), team.group)
    durable = gathered[team.coordinator][2]
    node_of = [g[0] for g in gathered]
    holders: dict[str, dict[int, list[int]]] = {}
    entries: dict[str, dict[str, Any]] = {}
    for holder, (_, inventory, _) in enumerate(gathered):
        for entry in inventory:
            sid = entry["save_id"]
            entries.setdefault(sid, entry)
            for r in entry["ranks"]:
                holders.setdefault(sid, {}).setdefault(r, []).append(holder)
    durable_url, durable_step = durable if durable is not None else (None, -1)
    newest_known = max([durable_step, *(e["key"][0] for e in entries.values())])
    last_saved_at = max((e["key"][1] for e in entries.values()), default=None) or None
    rejected: set[str] = set()
    while True:
        usable = [e for sid, e in entries.items() if sid not in rejected
                  and (_loads_as_saved(e, holders[sid], world_size, target_size) or _reshardable(e, holders[sid]))]
        # Of one step, the checkpoint that needs no reshard first.
        newest = max(usable, key=lambda e: (e["key"], _loads_as_saved(e, holders[e["save_id"]], world_size,
                                                                     target_size)), default=None)
        candidates = [e for sid, e in entries.items() if sid not in rejected]
        newest_any = max(candidates, key=lambda e: e["key"], default=None)
        lost = ""
        if newest_any is not None and (newest is None or newest_any["key"] > newest["key"]):
            lost = (f"the newest local-tier checkpoint {newest_any['name']!r} (step {newest_any['key'][0]}) is not"
                    " complete: both copies of some rank's file are lost")
        if newest is not None and newest["key"][0] >= durable_step:
            reason = (f"local tier: {newest['name']!r} at step {newest['key'][0]} is complete on the nodes' local"
                      " storage" + (f" and not older than the durable {durable_url!r} (step {durable_step})"
                                    if durable_url else " and no durable checkpoint exists"))
            if lost:
                rank_zero_warn(f'ckpt_path="last": {lost}; resuming from an older one. ' + reason)
            chosen_at = time.perf_counter()
            try:
                choice = _take_local(newest, holders[newest["save_id"]], gathered, node_of, root, team,
                                     shard_group_size, durable_url, reason)
            except tier_reshard.ReshardFailed as exc:
                # The causes alone (a reshard joins one per rank): their advice is what happens next.
                cause = str(exc).replace(f" {storage.RESUME_ELSEWHERE}", "").rstrip(". ")
                rank_zero_warn(f'ckpt_path="last": the local-tier checkpoint {newest["name"]!r} (step'
                               f' {newest["key"][0]}) cannot be used ({cause}); resuming from the next newest'
                               ' complete state instead.')
                rejected.add(newest["save_id"])
                continue
            choice = replace(choice, choose_s=chosen_at - started, reshard_s=time.perf_counter() - chosen_at,
                             steps_lost=newest_known - newest["key"][0], last_saved_at=last_saved_at)
        elif durable_url is not None:
            reason = (f"durable tier: {durable_url!r} at step {durable_step}, "
                      + (lost if lost and newest is None else
                         f"newer than the local tier's newest complete checkpoint (step {newest['key'][0]})"
                         if newest is not None else "no complete local-tier checkpoint"))
            if lost:
                rank_zero_warn(f'ckpt_path="last": {lost}; falling back to the durable tier. ' + reason)
            choice = TierChoice(durable_url, "durable", durable_url, reason, durable_step,
                                choose_s=time.perf_counter() - started, steps_lost=newest_known - durable_step,
                                last_saved_at=last_saved_at)
        elif lost or rejected:
            raise storage.CheckpointNotFoundError(
                f'ckpt_path="last": {lost or "no local-tier checkpoint could be used"}, and no durable checkpoint'
                " exists. Pass the path of a checkpoint to resume from, or start without ckpt_path.")
        else:
            raise NothingToResume('ckpt_path="last": no checkpoint on the local tier or the durable path.')
        break
    rank_zero_info(f'ckpt_path="last" resumes from the {choice.reason}.')
    return choice


def _take_local(entry: dict[str, Any], held: dict[int, list[int]], gathered: list[Any], node_of: list[Any],
                root: str, team: Any, shard_group_size: int | None, durable_url: str | None,
                reason: str) -> TierChoice:
    """(every rank) The chosen local-tier checkpoint made readable by this rank's load: its missing file
    fetched and checked (same world size), or its shards cut at the new world size ([Note: fast-tier
    reshard]). Raises ``ReshardFailed`` on every rank alike when a copy is damaged."""
    step = entry["key"][0]
    if _loads_as_saved(entry, held, team.world_size, shard_group_size or team.world_size):
        _fetch_missing(entry, held, gathered, root, team)
        return TierChoice(os.path.join(root, entry["name"]), "local", durable_url, reason, step)
    copies = [next((e["ranks"] for e in inventory if e["save_id"] == entry["save_id"]), [])
              for _, inventory, _ in gathered]
    path, moved = tier_reshard.reshard(entry, copies, node_of, root, team, shard_group_size)
    return TierChoice(path, "local", durable_url,
                      reason + f", resharded from {entry['world_size']} to {team.world_size} ranks", step,
                      resharded_from=int(entry["world_size"]), moved=moved)


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
    failure = None  # a fetched copy is checked before use: a damaged one makes the caller take the next state
    for _, receiver, key in plan:
        if receiver == team.rank and key.startswith("file:"):
            try:
                tier_reshard.TierFiles(root, entry).file(int(key.split(":")[1]))
            except Exception as exc:
                failure = f"rank {team.rank}: the copy it received, {path_of(key)!r}: {exc}"
                with suppress(OSError):
                    os.remove(path_of(key))
    errors = [e for e in all_gather_objects(failure, team.group) if e]
    if errors:
        raise tier_reshard.ReshardFailed("; ".join(errors))
    fetched = sorted({receiver for _, receiver, _ in plan})
    rank_zero_info(f"Local tier: rank(s) {fetched} fetched their files of {entry['name']!r} from a replica holder.")
