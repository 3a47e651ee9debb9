"""A local-tier checkpoint resumed at another world size (or shard group size): every new rank's shards cut
from the old rank files the surviving nodes hold, over the coordination group, in pieces.

[Note: fast-tier reshard] A saved rank file holds, of every flattened tensor, the elements
``EvenShard(numel, S).local_slice(k)`` of its position ``k`` in the shard group (``S`` ranks; the old world
without hybrid sharding); the new rank ``m`` needs ``EvenShard(numel, S').local_slice(m % S')``. Every rank
computes the same plan from one exchange of what each node holds: for each new rank and each old shard
position whose elements overlap its own, a copy on its own node is read there (memory-mapped), else the
lowest rank holding one sends the overlapping elements. The tensors that are not flat shards (buffers,
replicated tensors, Lightning's state) come from old rank 0's file, as a ``sharded`` load takes rank 0's,
so the state is the one a ``sharded`` save of that step gives at the new world size, bit for bit.

Checked before use: every rank that reads an old file (for itself or to send from it) first checks its
identity (save id, rank, world size) and every tensor's CRC32 against the file's own header
(integrity.py); the ranks exchange what failed, and a failure anywhere makes the caller take the next
complete state, naming the rank, the file and the reason. What is sent carries a CRC32 per piece as well,
checked by the receiver. Pieces are at most ``replication.CHUNK_BYTES``: no file is ever held whole in
memory, only the new rank's own shards, which its engine holds anyway.

The new rank's shards are written as a ``local`` checkpoint at the new world size into its node's tier
directory (named after the old one with ``-ws<M>``, one marker per directory written by its lowest rank),
which the load that follows reads as any same-size local-tier checkpoint; the old checkpoint stays, so a
second failure before the next save can still go back to it.

Call order (every rank, training thread, inside ``tier_recovery.resolve_last``): :func:`reshard` = the
skeleton from the holder of old rank 0's file (a broadcast), the reads checked (an exchange of errors), the
pieces in plan order (point-to-point), the new files written (an exchange), the markers (an exchange).
"""

from __future__ import annotations

import os
import re
import uuid
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.checkpoint.formats.tree import FlatShard, map_leaves, map_with_path, walk
from lightning_zero.checkpoint.modes import local
from lightning_zero.checkpoint.runtime.team import Team, all_gather_objects, peer_lost
from lightning_zero.checkpoint.store import file_io, storage
from lightning_zero.checkpoint.tiered import replication
from lightning_zero.checkpoint.tiered.tiers import TIER_KEY
from lightning_zero.engine.sharding import EvenShard

_TAG_STRIDE = 1 << 16


class ReshardFailed(RuntimeError):
    """A copy the reshard needed is damaged or unreadable (the message names the rank, the file and why),
    or a rank failed to write its new file; the same on every rank."""


@dataclass(frozen=True, order=True)
class Send:
    """One point-to-point stream of the plan: ``sender`` cuts, from its node's copy of old rank
    ``old_rank``'s file, the elements new rank ``receiver`` needs of old shard position ``position``."""

    sender: int
    receiver: int
    old_rank: int
    position: int


@dataclass(frozen=True)
class Layout:
    """A checkpoint's split: ``world_size`` ranks, flat shards over groups of ``shard_group_size``."""

    world_size: int
    shard_group_size: int

    def position(self, rank: int) -> int:
        return rank % self.shard_group_size


def new_name(name: str, world_size: int) -> str:
    """The resharded checkpoint's marker name: ``epoch=0-step=3.ckpt`` -> ``epoch=0-step=3-ws2.ckpt``."""
    stem, ext = os.path.splitext(name)
    return f"{re.sub(r'-ws[0-9]+$', '', stem)}-ws{world_size}{ext}"


def sources(old: Layout, copies: list[list[int]], node_of: list[Any]) -> dict[int, dict[int, tuple[int, int]]]:
    """For each new rank and each old shard position: (the rank that reads it, the old rank whose file it
    reads), preferring a copy on the new rank's own node, else the lowest rank holding one. Pure."""
    out: dict[int, dict[int, tuple[int, int]]] = {}
    for rank in range(len(copies)):
        mine: dict[int, tuple[int, int]] = {}
        for position in range(old.shard_group_size):
            here = [n for r, held in enumerate(copies) if node_of[r] == node_of[rank] for n in held
                    if old.position(n) == position]
            if here:
                mine[position] = (rank, min(here))
                continue
            anywhere = [(r, min(n for n in held if old.position(n) == position)) for r, held in enumerate(copies)
                        if any(old.position(n) == position for n in held)]
            if not anywhere:
                raise ReshardFailed(f"no node holds a file of shard position {position}")
            mine[position] = min(anywhere)
        out[rank] = mine
    return out


def _overlap(numel: int, old: Layout, position: int, new: Layout, rank: int) -> tuple[int, int, int] | None:
    """(source offset, destination offset, elements) of old ``position``'s piece in new ``rank``'s shard."""
    src, dst = EvenShard(numel, old.shard_group_size), EvenShard(numel, new.shard_group_size)
    lo = max(src.start(position), dst.start(new.position(rank)))
    hi = min(src.end(position), dst.end(new.position(rank)))
    if hi <= lo:
        return None
    return lo - src.start(position), lo - dst.start(new.position(rank)), hi - lo


def _segments(skeleton: Any, old: Layout, position: int, new: Layout, rank: int) -> list[tuple[str, int, int, int]]:
    """(leaf path, source byte offset, destination byte offset, bytes) of every flat shard, in walk order."""
    out = []
    for path, leaf in walk(skeleton):
        if not isinstance(leaf, FlatShard):
            continue
        piece = _overlap(leaf.numel, old, position, new, rank)
        if piece is not None:
            size = leaf.local.element_size()
            out.append(("/".join(path), piece[0] * size, piece[1] * size, piece[2] * size))
    return out


def _chunks(segments: list[tuple[str, int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """The stream of ``segments`` cut into pieces of at most ``CHUNK_BYTES``: (segment, start, end) each."""
    chunks: list[list[tuple[int, int, int]]] = [[]]
    room = replication.CHUNK_BYTES
    for index, (_, _, _, length) in enumerate(segments):
        start = 0
        while start < length:
            if room == 0:
                chunks.append([])
                room = replication.CHUNK_BYTES
            take = min(room, length - start)
            chunks[-1].append((index, start, start + take))
            start, room = start + take, room - take
    return [c for c in chunks if c]


def _bytes(tensor: Tensor) -> Tensor:
    return tensor.reshape(-1).view(torch.uint8)


class TierFiles:
    """The old rank files this rank reads (from its own node), each opened memory-mapped and checked once."""

    def __init__(self, root: str, entry: dict[str, Any]) -> None:
        self.loc = storage.resolve(os.path.join(root, entry["name"]))
        self.version_dir = os.path.join(root, entry["data"])
        self.entry = entry
        self._files: dict[int, dict[str, Any]] = {}

    def path(self, old_rank: int) -> str:
        return local.rank_file(self.version_dir, old_rank, int(self.entry["world_size"]))

    def file(self, old_rank: int) -> dict[str, Any]:
        """Old rank ``old_rank``'s file with its leaves by path, checked (raises CheckpointCorruptError)."""
        if old_rank not in self._files:
            tree = local.read_checked(self.loc, self.path(old_rank), self.entry["save_id"], old_rank,
                                      int(self.entry["world_size"]))
            self._files[old_rank] = {"tree": tree, "leaves": {"/".join(p): leaf for p, leaf in walk(tree)}}
        return self._files[old_rank]

    def shard(self, old_rank: int, path: str) -> Tensor:
        return _bytes(self.file(old_rank)["leaves"][path].local)


def _skeleton(tree: Any) -> Any:
    """The tree without the flat shards' data (their shape, split and dtype kept); other tensors copied."""
    return map_leaves(tree, lambda leaf: FlatShard(torch.empty(0, dtype=leaf.local.dtype), leaf.shape, leaf.rank,
                                                     leaf.world_size, leaf.replicas, leaf.replica_rank)
                      if isinstance(leaf, FlatShard) else leaf.clone() if isinstance(leaf, Tensor) else leaf)


def _naming(exc: BaseException, path: str) -> str:
    """The error's message, with the file's path where it does not name it."""
    text = f"{exc}" if isinstance(exc, storage.CheckpointCorruptError) else f"{type(exc).__name__}: {exc}"
    return text if path in text else f"{path!r}: {text}"


def _broadcast(value: Any, src: int, team: Team) -> Any:
    if team.world_size == 1:
        return value
    payload = [value]
    try:
        dist.broadcast_object_list(payload, src=src, group=team.group)
    except Exception as exc:
        raise peer_lost(exc, loading=True) from exc
    return payload[0]


def reshard(entry: dict[str, Any], copies: list[list[int]], node_of: list[Any], root: str, team: Team,
            shard_group_size: int | None) -> tuple[str, dict[str, int]]:
    """(every rank) Write this rank's shards of ``entry`` at the team's world size into ``root`` (see
    [Note: fast-tier reshard]); ``copies[r]``: the old ranks whose files rank r's node holds. Returns the new
    checkpoint's path in this rank's directory and what was moved (bytes read here, received, sent). Raises
    :class:`ReshardFailed` on every rank alike when a copy is damaged or a write failed."""
    world_size = team.world_size
    old = Layout(int(entry["world_size"]), int(entry.get("shard_group_size") or entry["world_size"]))
    new = Layout(world_size, shard_group_size or world_size)
    reader = TierFiles(root, entry)
    # 1. The skeleton (every leaf but the flat shards' data) and the marker's Lightning fields, from the
    # lowest rank holding old rank 0's file.
    zero = min(r for r, held in enumerate(copies) if 0 in held)
    shipped: tuple[Any, dict[str, Any] | None, str | None] = (None, None, None)
    if team.rank == zero:
        try:
            marker = file_io.torch_load(reader.loc, reader.loc.path)
            fields = {k: v for k, v in marker.items() if k not in (storage.MARKER_KEY, "note")}
            shipped = (_skeleton(reader.file(0)["tree"]), fields, None)
        except Exception as exc:
            shipped = (None, None, f"rank {team.rank}: {_naming(exc, reader.path(0))}")
    skeleton, fields, error = _broadcast(shipped, team.global_ranks[zero], team)
    if error is not None:
        raise ReshardFailed(error)
    # 2. Every file this rank reads, checked before any piece of it is used.
    plan = sources(old, copies, node_of)
    sends = sorted(Send(reader_rank, rank, old_rank, position)
                   for rank, by_position in plan.items() for position, (reader_rank, old_rank) in by_position.items()
                   if reader_rank != rank and _segments(skeleton, old, position, new, rank))
    mine = {old_rank for rank, by_position in plan.items() for reader_rank, old_rank in by_position.values()
            if reader_rank == team.rank}
    failure = None
    for old_rank in sorted(mine):
        try:
            reader.file(old_rank)
        except Exception as exc:
            failure = (reader.path(old_rank), f"rank {team.rank}: {_naming(exc, reader.path(old_rank))}")
            break
    found = {}  # one report per file: the ranks of a node read the same copy
    for item in all_gather_objects(failure, team.group):
        if item is not None:
            found.setdefault(item[0], item[1])
    if found:
        raise ReshardFailed("; ".join(found.values()))
    # 3. This rank's shards: its own node's pieces read here, the others received, in plan order.
    shards: dict[str, Tensor] = {}
    for path, leaf in walk(skeleton):
        if isinstance(leaf, FlatShard):
            key = "/".join(path)
            shards[key] = torch.empty(EvenShard(leaf.numel, new.shard_group_size).shard_numel(
                new.position(team.rank)), dtype=leaf.local.dtype)
    moved = {"read_bytes": 0, "received_bytes": 0, "sent_bytes": 0}
    for position, (reader_rank, old_rank) in plan[team.rank].items():
        if reader_rank == team.rank:
            for key, src, dst, length in _segments(skeleton, old, position, new, team.rank):
                _bytes(shards[key])[dst:dst + length].copy_(reader.shard(old_rank, key)[src:src + length])
                moved["read_bytes"] += length
    failure = None
    for index, send in enumerate(sends):
        segments = _segments(skeleton, old, send.position, new, send.receiver)
        try:
            if team.rank == send.sender:
                moved["sent_bytes"] += _send(reader, send, segments, team, index * _TAG_STRIDE)
            elif team.rank == send.receiver:
                moved["received_bytes"] += _receive(shards, send, segments, team, index * _TAG_STRIDE)
        except ReshardFailed as exc:
            failure = failure or f"rank {team.rank}: {exc}"
    # 4. The new files, then one marker per directory.
    proposal = (uuid.uuid4().hex[:12], uuid.uuid4().hex) if team.is_coordinator else None
    gathered = all_gather_objects((proposal, failure), team.group)
    version, save_id = gathered[team.coordinator][0]
    errors = [g[1] for g in gathered if g[1]]
    if errors:
        raise ReshardFailed("; ".join(errors))
    name = new_name(entry["name"], world_size)
    loc = storage.resolve(os.path.join(root, name))
    version_dir = loc.join(loc.data_root(), version)
    tree = _with_shards(skeleton, shards, new, team.rank)
    failure = None
    try:
        os.makedirs(version_dir, exist_ok=True)
        local.write_local(tree, loc, version_dir, team.rank, world_size, save_id)
    except Exception as exc:
        failure = f"rank {team.rank}: writing {local.rank_file(version_dir, team.rank, world_size)!r}: {exc}"
    del tree, shards
    errors = [e for e in all_gather_objects(failure, team.group) if e]
    if errors:
        raise ReshardFailed("; ".join(errors))
    here = [r for r in range(world_size) if node_of[r] == node_of[team.rank]]
    failure = None
    if team.rank == min(here):
        try:
            marker_fields: dict[str, Any] = {
                "mode": "local", "world_size": world_size, "data": version_dir[len(loc.parent) + 1:],
                "save_id": save_id,
                TIER_KEY: {"ranks": here, "step": entry["key"][0], "seq": entry["key"][1] + 1e-3, "replicated": False,
                           "durable": entry.get("durable"), "resharded_from": old.world_size}}
            if new.shard_group_size != world_size:
                marker_fields["shard_group_size"] = new.shard_group_size
            storage.write_marker(loc, marker_fields, fields)
        except Exception as exc:
            failure = f"rank {team.rank}: writing the marker {loc.path!r}: {exc}"
    errors = [e for e in all_gather_objects(failure, team.group) if e]
    if errors:
        raise ReshardFailed("; ".join(errors))
    return loc.path, moved


def _with_shards(skeleton: Any, shards: dict[str, Tensor], new: Layout, rank: int) -> Any:
    """The skeleton with this rank's new flat shards in place."""
    replicas = new.world_size // new.shard_group_size

    def fill(path: str, leaf: Any) -> Any:
        if isinstance(leaf, FlatShard):
            return FlatShard(shards[path], leaf.shape, new.position(rank), new.shard_group_size, replicas,
                             rank // new.shard_group_size)
        return leaf

    return map_with_path(skeleton, fill)


def _send(reader: TierFiles, send: Send, segments: list[tuple[str, int, int, int]], team: Team, tag: int) -> int:
    in_flight: deque[Any] = deque()
    dst = team.global_ranks[send.receiver]
    sent = 0
    try:
        for k, chunk in enumerate(_chunks(segments)):
            data = torch.cat([reader.shard(send.old_rank, segments[i][0])[segments[i][1] + a:segments[i][1] + b]
                              for i, a, b in chunk])
            header = torch.tensor([data.numel(), zlib.crc32(data.numpy())], dtype=torch.int64)
            in_flight.append(dist.isend(header, dst, group=team.group, tag=tag + 2 * k + 1))
            in_flight.append(dist.isend(data, dst, group=team.group, tag=tag + 2 * k + 2))
            sent += data.numel()
            while len(in_flight) > 2 * replication.PIECES_IN_FLIGHT:
                in_flight.popleft().wait()
    finally:
        for request in in_flight:
            request.wait()
    return sent


def _receive(shards: dict[str, Tensor], send: Send, segments: list[tuple[str, int, int, int]], team: Team,
             tag: int) -> int:
    src = team.global_ranks[send.sender]
    received = 0
    bad: str | None = None
    for k, chunk in enumerate(_chunks(segments)):
        length = sum(b - a for _, a, b in chunk)
        header = torch.zeros(2, dtype=torch.int64)
        data = torch.empty(length, dtype=torch.uint8)
        dist.recv(header, src, group=team.group, tag=tag + 2 * k + 1)
        dist.recv(data, src, group=team.group, tag=tag + 2 * k + 2)
        if int(header[0]) != length or zlib.crc32(data.numpy()) != int(header[1]):
            bad = bad or (f"piece {k} of old rank {send.old_rank}'s file from rank {send.sender} failed its CRC32"
                          " check in transfer")
            continue  # the rest is still received, so that the sender is not left waiting
        offset = 0
        for i, a, b in chunk:
            key, _, dst, _ = segments[i]
            _bytes(shards[key])[dst + a:dst + b].copy_(data[offset:offset + b - a])
            offset += b - a
        received += length
    if bad is not None:
        raise ReshardFailed(bad)
    return received
