"""``local`` mode: every rank writes its own file of its own shards, no collective; a load reads the
rank's own file, at the world size it was saved with (or fewer replica groups of the same shard
group size, with hybrid sharding).

Layout: ``<version dir>/rank{r:05d}-of-{world:05d}.pt``, a ``torch.save`` of the tree with each
:class:`FlatShard` encoded as a plain dict (``weights_only`` loads accept it), its tensors packed into the
few flat buffers the stager copied them into ([Note: packed rank files] in formats/packed.py), plus the
integrity header (:mod:`~lightning_zero.checkpoint.formats.integrity`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_zero.checkpoint.formats import integrity, packed
from lightning_zero.checkpoint.formats.tree import (
    FlatShard,
    is_tensor_leaf,
    map_leaves,
    map_with_path,
    shard_group_size_of,
    walk,
)
from lightning_zero.checkpoint.modes.base import (
    CheckpointMode,
    OpenedCheckpoint,
    SaveTarget,
    check_into,
    copy_into,
    tensor_bytes,
)
from lightning_zero.checkpoint.runtime.team import Team, world
from lightning_zero.checkpoint.store import file_io
from lightning_zero.checkpoint.store.storage import CheckpointCorruptError, Location
from lightning_zero.checkpoint.store.tuning import DEFAULT_TUNING, CheckpointTuning


def encode_shards(state: Any) -> Any:
    """FlatShard -> a plain dict that ``torch.load(weights_only=True)`` accepts."""
    return map_leaves(state, lambda leaf: {"flat_shard": leaf.local, "shape": list(leaf.shape),
                                           "rank": leaf.rank, "world_size": leaf.world_size,
                                           "replicas": leaf.replicas, "replica_rank": leaf.replica_rank}
                      if isinstance(leaf, FlatShard) else leaf)


def rank_file(version_dir: str, rank: int, world_size: int) -> str:
    return f"{version_dir}/rank{rank:05d}-of-{world_size:05d}.pt"


def write_local(state: Any, loc: Location, version_dir: str, rank: int, world_size: int, save_id: str,
                tuning: CheckpointTuning = DEFAULT_TUNING, progress: Callable[[int], None] | None = None,
                recycle: Callable[[str], bool] | None = None) -> None:
    """This rank's file; ``progress`` and ``recycle``: a local tier's (see file_io.write_file). ``state``: a
    staged tree, or a filled pack plan ([Note: pack plans] in formats/packed.py)."""
    if isinstance(state, packed.FilledPlan):
        encoded, leaves = dict(state.content), state.checked
    else:
        encoded, leaves = packed.pack(state), None  # [Note: packed rank files]
        if encoded is state:
            encoded = encode_shards(state)
    encoded[integrity.HEADER_KEY] = integrity.header(encoded, save_id, rank, world_size, chunked=(packed.PACKED_KEY,),
                                                     leaves=leaves)
    # [Note: one checksum pass] The header holds a CRC32 of every tensor and bytes leaf of the file (the pack's
    # buffers and index included), and torch.load checks no zip record CRC ([Note: why our own checksums] in
    # formats/integrity.py): torch's own CRC32 of each record would be a second pass over every byte a save
    # writes, a third of torch.save's CPU on a few large tensors (bench/save_phases.py), for nothing any reader
    # checks. Without the header (checksums_disabled, a benchmark) the records keep theirs.
    file_io.torch_save_to(loc, rank_file(version_dir, rank, world_size), encoded, tuning, progress=progress,
                          recycle=recycle, record_crcs=not integrity.checksums_enabled())


def read_local(opened: OpenedCheckpoint, rank: int | None = None, shard_group_size: int | None = None,
               team: Team | None = None) -> Any:
    """This rank's file of a ``local`` checkpoint (refused at another world size, except with fewer
    replica groups of the same ``shard_group_size``: see :func:`_check_local_world`), checked."""
    own_rank, world_size = (team.rank, team.world_size) if team is not None else world()
    if rank is None or rank == own_rank:
        _check_local_world(opened.loc, opened.marker, world_size, shard_group_size)
    return read_rank_file(opened, own_rank if rank is None else rank)


def _check_local_world(loc: Location, marker: dict[str, Any], world_size: int, shard_group_size: int | None) -> None:
    """A ``local`` checkpoint loads at the world size it was saved with, or, saved with hybrid sharding
    (R replica groups of N ranks), with fewer replica groups of the same N, as SageMaker's rule is:
    rank r's file holds the shards of rank r % N of a shard group, which is what rank r needs."""
    saved_world = int(marker["world_size"])
    saved_n = int(marker.get("shard_group_size", saved_world))
    target_n = shard_group_size if shard_group_size is not None else saved_n
    if saved_world == world_size and target_n == saved_n:
        return
    if saved_n < saved_world:
        if world_size <= saved_world and world_size % saved_n == 0 and target_n == saved_n:
            return
        choices = [saved_n * k for k in range(1, saved_world // saved_n + 1)]
        raise ValueError(
            f"Checkpoint {loc.url!r} was saved in 'local' mode by {saved_world // saved_n} replica groups of"
            f" shard_group_size {saved_n} (world size {saved_world}); it resumes only with shard_group_size"
            f" {saved_n} and a world size in {choices} (the same or fewer replica groups), not world size"
            f" {world_size} with shard_group_size {target_n}. Resume with shard_group_size={saved_n}, or save"
            " with ZeroCheckpointIO(mode='sharded') to change the shard group size or grow the world."
        )
    if saved_world != world_size:
        raise ValueError(
            f"Checkpoint {loc.url!r} was saved in 'local' mode with world size {marker['world_size']}; it can only"
            f" be loaded with that world size, not {world_size}. Resume with {marker['world_size']} processes, or"
            " save with ZeroCheckpointIO(mode='sharded') to change the world size."
        )
    raise ValueError(
        f"Checkpoint {loc.url!r} was saved in 'local' mode sharded over the whole world ({saved_world} ranks); it"
        f" cannot be loaded with shard_group_size {target_n}. Load it without shard_group_size, or save with"
        " ZeroCheckpointIO(mode='sharded') to change the shard group size."
    )


def read_own_rank_file(opened: OpenedCheckpoint, rank: int, world_size: int) -> Any:
    """The rank file rank ``rank`` of ``world_size`` reads ahead of its load: its own when the world size
    matches (kept in ``opened``), rank 0's otherwise (the load will refuse the world size with a clear message)."""
    marker = opened.marker
    assert marker is not None
    hybrid = int(marker.get("shard_group_size", marker["world_size"])) < marker["world_size"]
    reader_rank = rank if world_size == marker["world_size"] or (hybrid and rank < marker["world_size"]) else 0
    return read_rank_file(opened, reader_rank, keep=True)


def read_rank_file(opened: OpenedCheckpoint, rank: int, keep: bool = False) -> Any:
    """Rank ``rank``'s file of a ``local`` checkpoint, checked to belong to this checkpoint and this
    rank and to be intact (see integrity.py), with its shards as :class:`FlatShard` leaves. Read once
    per load: ``keep`` holds it in ``opened`` for the read that follows (which takes it)."""
    loc, marker = opened.loc, opened.marker
    assert marker is not None
    path = rank_file(opened.version_dir, rank, marker["world_size"])
    if path in opened.read_ahead:
        return opened.read_ahead[path] if keep else opened.read_ahead.pop(path)
    opened.existing_version_dir()
    decoded = read_checked(loc, path, marker.get("save_id"), rank, marker["world_size"])
    if keep:
        opened.read_ahead.clear()  # at most one file held
        opened.read_ahead[path] = decoded
    return decoded



def read_checked(loc: Location, path: str, save_id: str | None, rank: int, world_size: int) -> Any:
    """The rank file at ``path``, checked to be rank ``rank`` of ``world_size`` of save ``save_id`` (None: a
    file older than save ids, which may carry no header) and intact, with its shards as :class:`FlatShard`
    leaves. Raises ``CheckpointCorruptError`` naming the file and what was wrong."""
    content, found = integrity.split(file_io.torch_load(loc, path), path, loc.url, required=save_id is not None)
    if found is not None:
        integrity.check_identity(found, path, loc.url, save_id, rank, world_size)
        integrity.verify(content, found, path, loc.url, locate=packed.locate(content))
    return decode_shards(packed.unpack(content))


def _is_encoded_shard(leaf: Any) -> bool:
    return isinstance(leaf, dict) and "flat_shard" in leaf


def decode_shards(tree: Any) -> Any:
    """Treat encoded shards as leaves again (walk would descend into their dicts)."""
    if _is_encoded_shard(tree):
        return FlatShard(tree["flat_shard"], tuple(tree["shape"]), tree["rank"], tree["world_size"],
                         tree.get("replicas", 1), tree.get("replica_rank", 0))
    if isinstance(tree, dict):
        return {k: decode_shards(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [decode_shards(v) for v in tree]
    return tree


def read_whole(opened: OpenedCheckpoint, optimizer: bool) -> dict[str, Any]:
    """The saved tree with every flat shard whole: the rank files' pieces side by side in rank order
    (``optimizer=False``: the model only)."""
    # Hybrid: the first shard group's files hold every shard once ([Note: hybrid layout]).
    loc, marker = opened.loc, opened.marker
    assert marker is not None
    world_size = int(marker.get("shard_group_size", marker["world_size"]))
    files = [read_rank_file(opened, rank) for rank in range(world_size)]
    pieces: dict[str, list[FlatShard]] = {}
    for content in files:
        for path, leaf in walk(content):
            if isinstance(leaf, FlatShard):
                pieces.setdefault("/".join(path), []).append(leaf)

    def whole(path: str, leaf: Any) -> Any:
        if not isinstance(leaf, FlatShard):
            return leaf  # rank 0's: buffers, replicated tensors, objects
        shards = sorted(pieces[path], key=lambda s: s.rank)
        if [s.rank for s in shards] != list(range(world_size)):
            raise CheckpointCorruptError(f"Checkpoint {loc.url!r}: the rank files do not all hold {path!r}.")
        return torch.cat([s.local for s in shards]).reshape(leaf.shape)

    tree = map_with_path(files[0], whole)
    if not optimizer:
        tree.pop("optimizer", None)
    return tree


class LocalMode(CheckpointMode):
    """``local``: each rank its own file, no collective; loads at the world size it was saved with."""

    name = "local"
    stages_flat = True
    plans_layout = True

    def write(self, state: Any, target: SaveTarget) -> int | None:
        team = target.team
        write_local(state, target.loc, target.version_dir, team.rank, team.world_size, target.save_id, target.tuning)
        return None

    def bytes_written(self, state: Any, rank: int) -> int:
        if isinstance(state, packed.FilledPlan):
            return state.nbytes
        return tensor_bytes(state, whole_shards=False, replicated=True)  # every rank writes its replicated copy

    def saved_tensor_keys(self, opened: OpenedCheckpoint) -> set[str]:
        content = read_own_rank_file(opened, *world())
        return {"/".join(p) for p, leaf in walk(content) if is_tensor_leaf(leaf)}

    def saved_objects(self, opened: OpenedCheckpoint) -> dict[str, Any]:
        return read_own_rank_file(opened, *world())

    def prepare_load(self, state_dict: dict[str, Any], opened: OpenedCheckpoint, team: Team,
                     strict: bool = True) -> Callable[[], dict[str, Any]]:
        loc = opened.loc
        content = read_local(opened, shard_group_size=shard_group_size_of(state_dict, team.world_size), team=team)
        check_into(state_dict, content, loc.url, rank_file(opened.version_dir, team.rank, team.world_size), strict)
        return lambda: copy_into(state_dict, content, loc.url)

    def read_whole(self, opened: OpenedCheckpoint, optimizer: bool) -> dict[str, Any]:
        return read_whole(opened, optimizer)
