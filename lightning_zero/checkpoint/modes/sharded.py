"""``sharded`` mode: torch.distributed.checkpoint (DCP) writes every rank's shards into one directory
with a ``.metadata`` index; a load at any world size reads the regions it needs. Rank 0 adds
``objects.pt`` (the non-tensor leaves, the save id and the full shape of every tensor).

The DCP adapter itself (flat chunks, planners, plan cache, parallel and verifying readers) is in
:mod:`~lightning_zero.checkpoint.dcp.adapter` and :mod:`~lightning_zero.checkpoint.formats.integrity`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException

from lightning_zero import _compat
from lightning_zero.checkpoint.dcp import storage as dcp_storage
from lightning_zero.checkpoint.dcp.adapter import (
    FlatChunk,
    FlatChunkLoadPlanner,
    FlatChunkSavePlanner,
    forget_other_plans,
    forget_plans,
    plan_cache_key,
    read_threads,
    tree_signature,
)
from lightning_zero.checkpoint.formats import integrity
from lightning_zero.checkpoint.formats.tree import (
    FlatShard,
    check_same_keys,
    is_tensor_leaf,
    map_leaves,
    map_with_path,
    tensor_leaves,
    walk,
)
from lightning_zero.checkpoint.modes.base import CheckpointMode, OpenedCheckpoint, SaveTarget, tensor_bytes
from lightning_zero.checkpoint.runtime.team import Team, ranks_on_this_node
from lightning_zero.checkpoint.store import file_io, storage
from lightning_zero.checkpoint.store.storage import CheckpointCorruptError, Location
from lightning_zero.checkpoint.store.tuning import DEFAULT_TUNING, CheckpointTuning


def save_signature(state: Any) -> int:
    return tree_signature({"/".join(path): leaf for path, leaf in tensor_leaves(state)})


def write_sharded(state: Any, loc: Location, version_dir: str, team: Team, save_id: str,
                  signatures: list[int], tuning: CheckpointTuning = DEFAULT_TUNING) -> int:
    """DCP first, on every rank (it reports a failure on any rank to all of them), then rank 0's
    objects file, which records the save id (``.metadata`` carries it too) and the full shape of
    every tensor (flat shards hide it from DCP's metadata). ``signatures``: every rank's
    :func:`save_signature`, the same list on every rank."""
    tensors, objects = split_for_dcp(state)
    writer = dcp_storage.writer(loc, version_dir, save_id, tuning)
    # Replicated tensors (buffers, parameters no optimizer holds) are written by the lowest rank
    # holding them, so a checkpoint holds rank 0's buffers, the ones DDP keeps.
    spread = _has_replicas(state)
    cache_key = plan_cache_key(team.global_ranks, spread, signatures)
    forget_other_plans(cache_key)
    planner = FlatChunkSavePlanner(spread_replicas=spread, cache_key=cache_key, pause_gc=tuning.pause_gc)
    try:
        # DCP's own coordinator (its plans and ``.metadata``) is the group's first rank; the commit that
        # makes the checkpoint valid (the marker) is ours, written by ``team``'s coordinator.
        _compat.dcp_save_tensors(tensors, storage_writer=writer, planner=planner, process_group=team.group)
    except BaseException as exc:
        forget_plans(cache_key)  # DCP fails every rank together: all of them plan the next save afresh
        if isinstance(exc, CheckpointException):
            raise dcp_failure(exc) from exc
        raise
    if team.is_coordinator:
        shapes = {path: list(leaf.shape) for path, leaf in tensor_leaves(state)}
        objects[integrity.HEADER_KEY] = integrity.header(objects, save_id, world_size=team.world_size, shapes=shapes)
        file_io.torch_save_to(loc, f"{version_dir}/objects.pt", objects, tuning)
    return planner.bytes_planned


def _has_replicas(state: Any) -> bool:
    return any(isinstance(leaf, FlatShard) and leaf.replicas > 1 for _, leaf in walk(state))



def dcp_failure(exc: CheckpointException) -> Exception:
    """DCP reports the ranks' errors as one CheckpointException, a BaseException that ``except
    Exception`` (ours, Lightning's, the user's) misses: the lowest failing rank's own error instead,
    so a full disk or refused access is classified like any other storage error."""
    rank, (cause, _) = min(exc.failures.items(), key=lambda item: item[0])
    if isinstance(cause, Exception):
        return cause
    return RuntimeError(f"torch.distributed.checkpoint failed on rank {rank}: {cause!r}")



def split_for_dcp(state: Any) -> tuple[dict[str, Any], Any]:
    """Tensors (FlatShard as a FlatChunk, [Note: flat chunks for DCP]) for DCP, keyed by path; the
    rest for ``objects.pt``."""
    tensors: dict[str, Any] = {}
    for path, leaf in walk(state):
        key = "/".join(path)
        if isinstance(leaf, FlatShard):
            tensors[key] = FlatChunk.of(leaf)
        elif isinstance(leaf, Tensor):
            tensors[key] = leaf
    objects = map_leaves(state, _object_leaf)
    return tensors, objects


def _object_leaf(leaf: Any) -> Any:
    """What ``objects.pt`` keeps of a leaf: the value, nothing for a tensor (DCP holds it), and the
    full shape of a flat shard (DCP stores it flattened; readers of the whole checkpoint reshape it)."""
    if isinstance(leaf, FlatShard):
        return {"flat_shard_shape": list(leaf.shape)}
    return None if is_tensor_leaf(leaf) else leaf



def read_metadata_bytes(opened: OpenedCheckpoint) -> bytes:
    """(a team's coordinator) The ``.metadata`` bytes of a ``sharded`` checkpoint, for every rank
    ([Note: shared metadata] in opening.py)."""
    opened.existing_version_dir()
    reader = dcp_reader(opened)
    with _reading_dcp_metadata(opened.loc):
        return reader.metadata_bytes()


def dcp_reader(opened: OpenedCheckpoint, require_checksums: bool = False) -> Any:
    """A verifying, parallel DCP reader of ``opened``'s data, using the ``.metadata`` shared for this
    load if there is one."""

    threads = read_threads(ranks_on_this_node(), opened.tuning.max_read_threads)
    reader = dcp_storage.reader(opened.loc, opened.version_dir, require_checksums, threads)
    reader.shared_metadata = opened.metadata  # [Note: shared metadata]
    return reader


def read_dcp_metadata(loc: Location, reader: Any) -> Any:
    """A committed DCP directory's metadata; a clear error when it is missing or damaged."""
    with _reading_dcp_metadata(loc):
        return reader.read_metadata()


@contextlib.contextmanager
def _reading_dcp_metadata(loc: Location) -> Iterator[None]:
    """Turn a failed read of ``.metadata`` into an error that says what to do."""
    try:
        yield
    except CheckpointCorruptError:
        raise
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"Checkpoint {loc.url!r} is committed but its DCP metadata is missing.") from exc
    except OSError as exc:
        raise storage.storage_error(loc, "read", exc) from exc
    except Exception as exc:
        raise CheckpointCorruptError(
            f"Could not read the DCP metadata of checkpoint {loc.url!r} ({type(exc).__name__}: {exc}); the"
            " checkpoint is damaged. Resume from another checkpoint."
        ) from exc


def read_objects(opened: OpenedCheckpoint) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A ``sharded`` checkpoint's ``objects.pt`` (every non-tensor leaf), checked against the marker and its
    CRCs, and its integrity header (None in files older than the header)."""
    loc, marker = opened.loc, opened.marker
    assert marker is not None
    objects_file = f"{opened.existing_version_dir()}/objects.pt"
    objects, found = integrity.split(file_io.torch_load(loc, objects_file), objects_file, loc.url,
                                     required="save_id" in marker)
    if found is not None:
        integrity.check_identity(found, objects_file, loc.url, marker.get("save_id"), world_size=marker["world_size"])
        integrity.verify(objects, found, objects_file, loc.url)
    return objects, found


def open_sharded(opened: OpenedCheckpoint) -> tuple[str, dict[str, Any], dict[str, Any] | None, Any, Any]:
    """A ``sharded`` checkpoint's version directory, objects (checked), integrity header, a verifying
    DCP reader and its metadata, refused when the metadata belongs to another save."""
    loc, marker = opened.loc, opened.marker
    assert marker is not None
    version_dir = opened.existing_version_dir()
    objects, found = read_objects(opened)
    reader = dcp_reader(opened, require_checksums=found is not None and found.get("tensors") is not None)
    metadata = read_dcp_metadata(loc, reader)
    save_id = marker.get("save_id")
    if save_id is not None and getattr(metadata.storage_meta, "save_id", None) != save_id:
        raise CheckpointCorruptError(
            f"'{version_dir}/.metadata' belongs to another save than checkpoint {loc.url!r} (save id"
            f" {metadata.storage_meta.save_id!r}, the commit marker says {save_id!r}): it was replaced."
            " Resume from another checkpoint."
        )
    return version_dir, objects, found, reader, metadata


def prepare_sharded(state_dict: dict[str, Any], opened: OpenedCheckpoint, team: Team,
                    strict: bool = True) -> Callable[[], dict[str, Any]]:
    """Read and check without touching ``state_dict``; returns what completes the load (DCP's reads,
    collective over the team)."""
    loc = opened.loc
    _, objects, found, reader, metadata = open_sharded(opened)
    # DCP copies each item into its target as it reads it: fresh buffers keep the state untouched
    # when an item further on turns out damaged (one more copy of this rank's shards, at load only).
    targets, _ = split_for_dcp(map_leaves(state_dict, _empty_like))
    check_same_keys(set(targets), set(metadata.state_dict_metadata), loc.url, strict)
    _read_whole_where_saved_whole(state_dict, targets, metadata)
    if found is not None:
        integrity.check_shapes({key: leaf.shape for key, leaf in tensor_leaves(state_dict)}, found["shapes"], loc.url)
    return lambda: _load_sharded(state_dict, targets, reader, loc, objects, team, opened.tuning)


def _read_whole_where_saved_whole(state_dict: dict[str, Any], targets: dict[str, Any], metadata: Any) -> None:
    """A flat shard whose tensor the checkpoint holds whole, in its own shape (saved where no engine
    existed: after ``validate``, before any ``fit``), is read whole and sliced ([Note: saved whole]).

    [Note: saved whole] A save outside ``fit`` has no engine and so no shards: every parameter is
    written whole, in its shape. DCP reads any region of a saved tensor but not across shapes, so a
    2-D weight saved whole does not fill the flat ``[numel]`` chunk a resume asks for; reading the
    whole tensor (each rank, this case only) and taking this rank's elements does."""
    for path, leaf in walk(state_dict):
        key = "/".join(path)
        saved = metadata.state_dict_metadata.get(key)
        if (isinstance(leaf, FlatShard) and len(leaf.shape) != 1 and saved is not None
                and tuple(getattr(saved, "size", ())) == tuple(leaf.shape)):
            targets[key] = torch.empty(leaf.shape, dtype=leaf.local.dtype, device=leaf.local.device)


def _empty_like(leaf: Any) -> Any:
    if isinstance(leaf, FlatShard):
        return dataclasses.replace(leaf, local=torch.empty_like(leaf.local))
    return torch.empty_like(leaf) if isinstance(leaf, Tensor) else leaf


def _load_sharded(state_dict: dict[str, Any], targets: dict[str, Any], reader: Any, loc: Location,
                  objects: dict[str, Any], team: Team, tuning: CheckpointTuning = DEFAULT_TUNING) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(targets, storage_reader=reader, planner=FlatChunkLoadPlanner(pause_gc=tuning.pause_gc),
                 process_group=team.group)
    except CheckpointException as exc:  # raised on every rank: DCP gathers the failures
        raise _read_failure(exc, loc) from exc
    with torch.no_grad():
        for path, leaf in walk(state_dict):
            key = "/".join(path)
            if isinstance(leaf, FlatShard):
                target = targets[key]
                if isinstance(target, Tensor):  # [Note: saved whole]
                    leaf.load_from_full(target)
                else:
                    leaf.local.copy_(target.local)
            elif isinstance(leaf, Tensor):
                leaf.copy_(targets[key])
    return objects


def _read_failure(exc: CheckpointException, loc: Location) -> Exception:
    """What a failed DCP read of ``loc``'s data raises: a damaged file as such, a storage error (the
    store, not the file, failed) as one, anything else as a damaged checkpoint."""
    cause = dcp_failure(exc)
    if isinstance(cause, CheckpointCorruptError):
        return cause
    if isinstance(cause, OSError) and not isinstance(cause, FileNotFoundError):
        return storage.storage_error(loc, "read", cause)
    return CheckpointCorruptError(
        f"Could not read the data of checkpoint {loc.url!r} ({type(cause).__name__}: {cause}); its files are"
        " damaged or missing. Resume from another checkpoint."
    )


def read_whole(opened: OpenedCheckpoint, optimizer: bool) -> dict[str, Any]:
    """The saved tree with every tensor whole, read by DCP in this process alone (resharding to one
    process; ``optimizer=False``: the model only)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    loc = opened.loc
    _, objects, _, reader, dcp_metadata = open_sharded(opened)
    metadata = dcp_metadata.state_dict_metadata
    targets: dict[str, Tensor] = {}
    for key, md in metadata.items():
        if not isinstance(md, TensorStorageMetadata) or (not optimizer and key.startswith("optimizer/")):
            continue
        targets[key] = torch.empty(md.size, dtype=md.properties.dtype)
    try:
        # The reader that read .metadata (it keeps what it read): DCP's load sets it up for this plan.
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(targets, storage_reader=reader, no_dist=True)
    except CheckpointException as exc:
        raise _read_failure(exc, loc) from exc

    def whole(path: str, leaf: Any) -> Any:
        if path not in targets:
            return leaf
        if isinstance(leaf, dict) and "flat_shard_shape" in leaf:
            return targets[path].reshape(leaf["flat_shard_shape"])
        return targets[path]

    tree = map_with_path(objects, whole, is_leaf=lambda leaf: isinstance(leaf, dict) and "flat_shard_shape" in leaf)
    if not optimizer:
        tree.pop("optimizer", None)
    return tree


class ShardedMode(CheckpointMode):
    """``sharded``: DCP, every rank its shards with global metadata; loads at any world size (resharded)."""

    name = "sharded"

    def plan_signature(self, state: Any) -> Any:
        return save_signature(state)

    def write(self, state: Any, target: SaveTarget) -> int | None:
        # The job holds the collector paused ([Note: the collector and a save's objects] in saver.py). The pause
        # lasts as long as the save's collectives: a peer that hangs one holds it until the process group's timeout.
        return write_sharded(state, target.loc, target.version_dir, target.team, target.save_id, target.signatures,
                             target.tuning)

    def bytes_written(self, state: Any, rank: int) -> int:
        # Replicated tensors: DCP takes rank 0's.
        return tensor_bytes(state, whole_shards=False, replicated=rank == 0)

    def shared_metadata(self, opened: OpenedCheckpoint) -> bytes | None:
        return read_metadata_bytes(opened)

    def saved_tensor_keys(self, opened: OpenedCheckpoint) -> set[str]:
        return set(read_dcp_metadata(opened.loc, dcp_reader(opened)).state_dict_metadata)

    def saved_objects(self, opened: OpenedCheckpoint) -> dict[str, Any]:
        return read_objects(opened)[0]

    def prepare_load(self, state_dict: dict[str, Any], opened: OpenedCheckpoint, team: Team,
                     strict: bool = True) -> Callable[[], dict[str, Any]]:
        return prepare_sharded(state_dict, opened, team, strict)

    def read_whole(self, opened: OpenedCheckpoint, optimizer: bool) -> dict[str, Any]:
        return read_whole(opened, optimizer)
