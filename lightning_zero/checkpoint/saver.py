"""When and how checkpoints are written: the async saver, the three modes, and the commit.

Call order (every rank makes each call unless marked):

1. ``async_save(state, id)`` on the training thread: finalizes the previous save (raising its
   error, if any), snapshots non-tensor leaves and hands the tensors to the background thread.
   Returns at once.
2. (background) staging: every tensor is copied off the live state. Only the optimizer step
   mutates saved tensors, so the strategy calls :func:`wait_for_staging` right before it
   (torchtitan's ``maybe_wait_for_staging``); forward and backward overlap the copy.
3. (background) writing: ``local`` each rank its own file; ``sharded`` DCP (each rank its own
   shard, plus metadata); ``full`` shards gathered to rank 0, which writes one file.
4. (background) every rank reports success or its error over a dedicated gloo group (never
   the training group: a collective there from another thread could interleave with training
   collectives and deadlock), then (coordinator) rank 0 writes the commit marker and runs the
   removals queued behind this save (see [Note: checkpoint layout] in storage.py).
5. ``maybe_finalize_async_calls(blocking=True)``: waits, raising the background error with the
   path and the cause. Called by the next save and at teardown.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException

from lightning_zero.checkpoint import storage
from lightning_zero.checkpoint.storage import CheckpointCorruptError, Location
from lightning_zero.checkpoint.tree import FlatShard, check_same_keys, is_tensor_leaf, map_leaves, stage, walk

log = logging.getLogger(__name__)

Mode = Literal["local", "sharded", "full"]
MODES: tuple[Mode, ...] = ("local", "sharded", "full")


class CheckpointSaveError(RuntimeError):
    """A background save failed; the previous checkpoint is untouched."""


def validate_mode(mode: str) -> Mode:
    if mode not in MODES:
        raise ValueError(f"Checkpoint mode must be one of {MODES}, got {mode!r}.")
    return mode  # type: ignore[return-value]


# ---- process-group helpers ----------------------------------------------------------------


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_coordination_group: Any = None


def prepare() -> None:
    """(collective, every rank, training thread) Create what background saves coordinate over:
    the gloo group and the device mesh. The strategy calls this at setup, so that no save (in
    ``local`` mode: no collective at all) has to make a collective on the training thread."""
    coordination_group()
    if _world()[1] > 1:
        _mesh()


def coordination_group() -> Any:
    """(collective, training thread, first call) a gloo group for background coordination."""
    global _coordination_group
    if _coordination_group is None and _world()[1] > 1:
        _coordination_group = dist.new_group(backend="gloo", timeout=timedelta(minutes=30))
    return _coordination_group


def _all_gather_objects(value: Any, group: Any) -> list[Any]:
    if _world()[1] == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


# ---- the async machinery ------------------------------------------------------------------


@dataclass
class _PendingSave:
    url: str
    future: Future
    staged: threading.Event
    started: float = field(default_factory=time.perf_counter)


class _AsyncSaver:
    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._pending: _PendingSave | None = None
        self._removals: list[tuple[Location, Future]] = []

    def executor(self) -> ThreadPoolExecutor:
        if self._executor is None:
            # One worker: saves and removals run in submission order.
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_zero_ckpt")
        return self._executor

    def submit(self, url: str, job: Callable[[threading.Event], Any]) -> _PendingSave:
        self.finalize(blocking=True)
        staged = threading.Event()
        self._pending = _PendingSave(url, self.executor().submit(job, staged), staged)
        return self._pending

    def wait_for_staging(self) -> None:
        if self._pending is not None:
            self._pending.staged.wait()

    def finalize(self, blocking: bool) -> bool:
        """True when nothing is left in flight. Raises a failed save's error once; a failed
        removal only warns (the checkpoint it meant to delete is still a valid one)."""
        self._reap_removals(blocking)
        pending = self._pending
        if pending is None:
            return not self._removals
        if not blocking and not pending.future.done():
            return False
        self._pending = None
        try:
            pending.future.result()
        except CheckpointSaveError:
            raise
        except Exception as exc:
            raise CheckpointSaveError(f"Saving checkpoint {pending.url!r} failed: {exc}") from exc
        return True

    def remove_after_pending(self, loc: Location) -> None:
        """Remove ``loc`` once the save in flight has committed (never before; not if it fails)."""
        pending = self._pending
        after = pending.future if pending is not None else None

        def job() -> None:
            if after is not None and after.exception() is not None:
                log.warning("Keeping %s: the newer checkpoint failed to save.", loc.url)
                return
            storage.remove(loc)

        self._removals.append((loc, self.executor().submit(job)))

    def link_after_pending(self, target: Location, link: Location) -> None:
        """Make ``link`` name the checkpoint ``target`` once the save in flight has committed."""
        pending = self._pending
        after = pending.future if pending is not None else None

        def job() -> None:
            if after is not None and after.exception() is not None:
                log.warning("Not linking %s: %s failed to save.", link.url, target.url)
                return
            storage.link(target, link)

        self._removals.append((link, self.executor().submit(job)))

    def _reap_removals(self, blocking: bool) -> None:
        still_running = []
        for loc, future in self._removals:
            if not blocking and not future.done():
                still_running.append((loc, future))
                continue
            error = future.exception()
            if error is not None:
                rank_zero_warn(f"Could not remove old checkpoint {loc.url!r}: {error}. Delete it by hand.")
        self._removals = still_running


_SAVER = _AsyncSaver()


# ---- public functional API ----------------------------------------------------------------


def async_save(state_dict: dict[str, Any], checkpoint_id: str, *, mode: Mode = "sharded",
               storage_options: dict[str, Any] | None = None, marker_fields: dict[str, Any] | None = None) -> None:
    """Save ``state_dict`` (nested dicts of tensors, :class:`FlatShard` and plain objects) in the
    background. Returns once the work is queued; tensors must not change until
    :func:`wait_for_staging` returns (the strategy calls it before each optimizer update).

    ``marker_fields`` (rank 0's are used): small plain values copied into the commit marker, where
    readers of ordinary Lightning files look for them (see [Note: marker format] in storage.py)."""
    validate_mode(mode)
    group = coordination_group()
    loc = storage.resolve(checkpoint_id, storage_options)
    # New containers, same leaves: the caller may rebuild or mutate its dicts once we return.
    snapshot = map_leaves(state_dict, lambda leaf: leaf)
    fields = dict(marker_fields or {})
    _SAVER.submit(loc.url, lambda staged: _save_job(snapshot, loc, mode, group, staged, fields))


def save(state_dict: dict[str, Any], checkpoint_id: str, *, mode: Mode = "sharded",
         storage_options: dict[str, Any] | None = None, marker_fields: dict[str, Any] | None = None) -> None:
    """Synchronous save: :func:`async_save` then wait for the commit."""
    async_save(state_dict, checkpoint_id, mode=mode, storage_options=storage_options, marker_fields=marker_fields)
    maybe_finalize_async_calls(blocking=True)


def maybe_finalize_async_calls(blocking: bool = True) -> bool:
    """Finish the save in flight (``blocking``) or check on it; True when none is left.
    Raises :class:`CheckpointSaveError` if it failed."""
    return _SAVER.finalize(blocking)


def wait_for_staging() -> None:
    """Block until the save in flight has copied its tensors (call before mutating them)."""
    _SAVER.wait_for_staging()


def link(checkpoint_id: str, link_id: str, storage_options: dict[str, Any] | None = None) -> None:
    """(one rank) Make ``link_id`` another name of checkpoint ``checkpoint_id``, after the save in
    flight has committed (``ModelCheckpoint(save_last="link")``)."""
    _SAVER.link_after_pending(storage.resolve(checkpoint_id, storage_options), storage.resolve(link_id, storage_options))


def remove(checkpoint_id: str, storage_options: dict[str, Any] | None = None) -> None:
    """(one rank) Delete a checkpoint, after the save in flight has committed."""
    _SAVER.remove_after_pending(storage.resolve(checkpoint_id, storage_options))


# ---- the background job -------------------------------------------------------------------


def _save_job(state: dict[str, Any], loc: Location, mode: Mode, group: Any, staged: threading.Event,
              marker_fields: dict[str, Any]) -> None:
    rank, world_size = _world()
    try:
        state = stage(state)
    finally:
        staged.set()
    # Rank 0 names the fresh version directory; every rank writes into that one.
    version_dir = _all_gather_objects(loc.new_version_dir(), group)[0] if mode != "full" else ""
    error: str | None = None
    try:
        if mode == "local":
            _write_local(state, loc, version_dir, rank, world_size)
        elif mode == "sharded":
            _write_sharded(state, loc, version_dir, group)
        else:
            _write_full(state, loc, rank, group)
    except Exception as exc:  # reported to every rank below, raised at the next finalize
        error = f"rank {rank}: {storage.storage_error(loc, 'write', exc) if isinstance(exc, OSError) else exc!r}"
    errors = [e for e in _all_gather_objects(error, group) if e]
    if errors:
        if rank == 0 and version_dir:
            _discard(loc, version_dir)
        raise CheckpointSaveError(
            f"Saving checkpoint {loc.url!r} failed; the previous checkpoint is intact. " + "; ".join(errors)
        )
    commit_error: str | None = None
    if rank == 0 and mode != "full":
        try:
            # The data directory relative to the marker's folder: a copy of the marker beside it (a
            # `save_last="link"` on S3) names the same data.
            data = version_dir[len(loc.parent) + 1:] if loc.parent else version_dir
            storage.write_marker(loc, {"mode": mode, "world_size": world_size, "data": data}, marker_fields)
        except Exception as exc:
            commit_error = f"writing the commit marker failed: {exc}"
            _discard(loc, version_dir)
        else:
            try:
                storage.remove_stale_versions(loc, keep=version_dir)
            except Exception as exc:  # committed already; leftovers only cost space
                log.warning("Could not delete old data versions of %s: %s", loc.url, exc)
    # Every rank learns whether the commit happened, so every rank raises if it did not.
    commit_error = _all_gather_objects(commit_error, group)[0] if mode != "full" else commit_error
    if commit_error:
        raise CheckpointSaveError(f"Saving checkpoint {loc.url!r} failed; the previous checkpoint is intact: {commit_error}")


def _discard(loc: Location, version_dir: str) -> None:
    try:
        loc.fs.rm(version_dir, recursive=True)
    except Exception:  # a partial version directory is harmless: nothing points at it
        pass


def _torch_save_to(loc: Location, path: str, obj: Any) -> None:
    """Stream ``torch.save`` straight to storage (no second in-memory copy of the bytes).

    Local disks: one file, fsynced. Object stores: one multipart upload that completes at
    close; a partial upload left by a failure is never referenced (the marker is written last).
    """
    if loc.is_local:
        import os

        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    else:
        with loc.fs.open(path, "wb") as f:
            torch.save(obj, f)


def _encode_shards(state: Any) -> Any:
    """FlatShard -> a plain dict that ``torch.load(weights_only=True)`` accepts."""
    return map_leaves(state, lambda leaf: {"flat_shard": leaf.local, "shape": list(leaf.shape),
                                           "rank": leaf.rank, "world_size": leaf.world_size}
                      if isinstance(leaf, FlatShard) else leaf)


def _rank_file(version_dir: str, rank: int, world_size: int) -> str:
    return f"{version_dir}/rank{rank:05d}-of-{world_size:05d}.pt"


def _write_local(state: Any, loc: Location, version_dir: str, rank: int, world_size: int) -> None:
    _torch_save_to(loc, _rank_file(version_dir, rank, world_size), _encode_shards(state))


def _write_sharded(state: Any, loc: Location, version_dir: str, group: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    tensors, objects = _split_for_dcp(state)
    if _world()[0] == 0:
        _torch_save_to(loc, f"{version_dir}/objects.pt", objects)
    writer = dcp.FileSystemWriter(version_dir, sync_files=True) if loc.is_local else FsspecWriter(
        loc.fs.unstrip_protocol(version_dir), sync_files=False, **_fs_options(loc)
    )  # fsync fails on s3fs streams: durability there comes from the completed upload
    try:
        # Replicated tensors (buffers, parameters no optimizer holds) are written by the lowest rank
        # holding them, so a checkpoint holds rank 0's buffers, as DDP keeps (DESIGN.md, Lifecycle).
        planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
        dcp.save(tensors, storage_writer=writer, planner=planner, process_group=group)
    except CheckpointException as exc:
        raise _dcp_failure(exc) from exc


def _dcp_failure(exc: CheckpointException) -> Exception:
    """DCP reports the ranks' errors as one CheckpointException, a BaseException that ``except
    Exception`` (ours, Lightning's, the user's) misses: the lowest failing rank's own error instead,
    so a full disk or refused access is classified like any other storage error."""
    rank, (cause, _) = min(exc.failures.items(), key=lambda item: item[0])
    if isinstance(cause, Exception):
        return cause
    return RuntimeError(f"torch.distributed.checkpoint failed on rank {rank}: {cause!r}")


def _read_dcp_keys(loc: Location, reader: Any) -> set[str]:
    """The tensor keys in a committed DCP directory; a clear error when its metadata is damaged."""
    try:
        return set(reader.read_metadata().state_dict_metadata)
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"Checkpoint {loc.url!r} is committed but its DCP metadata is missing.") from exc
    except OSError as exc:
        raise storage.storage_error(loc, "read", exc) from exc
    except Exception as exc:
        raise CheckpointCorruptError(
            f"Could not read the DCP metadata of checkpoint {loc.url!r} ({type(exc).__name__}: {exc}); the"
            " checkpoint is damaged. Resume from another checkpoint."
        ) from exc


def _fs_options(loc: Location) -> dict[str, Any]:
    return dict(getattr(loc.fs, "storage_options", {}) or {})


def _split_for_dcp(state: Any) -> tuple[dict[str, Any], Any]:
    """Tensors (FlatShard as 1-D DTensors) for DCP, keyed by path; the rest for ``objects.pt``."""
    from torch.distributed.tensor import DTensor, Shard

    tensors: dict[str, Any] = {}
    for path, leaf in walk(state):
        key = "/".join(path)
        if isinstance(leaf, FlatShard):
            tensors[key] = DTensor.from_local(leaf.local, _mesh(), [Shard(0)], run_check=False,
                                              shape=torch.Size([leaf.numel]), stride=(1,))
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


_device_mesh: Any = None


def _mesh() -> Any:
    global _device_mesh
    if _device_mesh is None:
        from torch.distributed.device_mesh import DeviceMesh

        _device_mesh = DeviceMesh("cpu", list(range(_world()[1])))
    return _device_mesh


def _write_full(state: Any, loc: Location, rank: int, group: Any) -> None:
    full = gather_tree_to_rank0(state, group)
    if rank == 0:
        if loc.is_local:
            import os
            import uuid

            tmp = f"{loc.path}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                _torch_save_to(loc, tmp, full)
                os.replace(tmp, loc.path)  # the file appears whole or not at all
            except BaseException:
                # A partial file must not stay behind, least of all on a full disk.
                if os.path.exists(tmp):
                    os.remove(tmp)
                raise
        else:
            _torch_save_to(loc, loc.path, full)


def gather_tree_to_rank0(tree: Any, group: Any) -> Any:
    """(collective, every rank) Every FlatShard of ``tree`` as a whole tensor on rank 0 (None elsewhere)."""
    return map_leaves(tree, lambda leaf: _gather_to_rank0(leaf, group) if isinstance(leaf, FlatShard) else leaf)


def _gather_to_rank0(shard: FlatShard, group: Any) -> Tensor | None:
    layout = shard.layout
    if shard.world_size == 1:
        return shard.local.reshape(shard.shape).clone()
    padded = torch.zeros(layout.chunk, dtype=shard.local.dtype)
    padded[: shard.local.numel()] = shard.local
    rank = dist.get_rank()
    gather_list = [torch.empty_like(padded) for _ in range(shard.world_size)] if rank == 0 else None
    dist.gather(padded, gather_list, dst=0, group=group)
    if rank != 0:
        return None
    assert gather_list is not None
    return torch.cat(gather_list)[: layout.numel].reshape(shard.shape)


# ---- loading ------------------------------------------------------------------------------


def load(state_dict: dict[str, Any], checkpoint_id: str, *,
         storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Fill the tensors and :class:`FlatShard` leaves of ``state_dict`` in place from a checkpoint
    of any mode (``sharded`` and ``full`` at any world size, ``local`` at the one it was saved
    with). Returns the checkpoint's non-tensor content (and, for ``full``, everything)."""
    maybe_finalize_async_calls(blocking=True)
    loc = storage.resolve(checkpoint_id, storage_options)
    marker = storage.read_marker(loc)
    if marker is None:
        return _load_full(state_dict, loc)
    mode = marker.get("mode")
    if mode == "local":
        return _load_local(state_dict, loc, marker)
    if mode == "sharded":
        return _load_sharded(state_dict, loc, marker)
    raise CheckpointCorruptError(f"Commit marker {loc.url!r} names unknown mode {mode!r}.")


def saved_tensor_keys(checkpoint_id: str, storage_options: dict[str, Any] | None = None) -> set[str]:
    """Paths of the tensors a ``local`` or ``sharded`` checkpoint holds."""
    loc = storage.resolve(checkpoint_id, storage_options)
    marker = storage.read_marker(loc)
    if marker is None:
        raise ValueError(f"{loc.url!r} is a 'full' checkpoint; read it with load().")
    if marker.get("mode") == "sharded":
        return _read_dcp_keys(loc, _dcp_reader(loc, _version_dir(loc, marker)))
    rank, world_size = _world()
    # This rank's own file when the world size matches (the load that follows then reuses it),
    # rank 0's otherwise (the load will refuse the world size with a clear message).
    reader_rank = rank if world_size == marker["world_size"] else 0
    path = _rank_file(_version_dir(loc, marker), reader_rank, marker["world_size"])
    raw = _torch_load(loc, path)
    _READ_AHEAD.clear()  # at most one file held
    _READ_AHEAD[path] = raw
    content = _walk_encoded(raw)
    return {"/".join(p) for p, leaf in walk(content) if is_tensor_leaf(leaf)}


def read_mode(checkpoint_id: str, storage_options: dict[str, Any] | None = None) -> Mode:
    loc = storage.resolve(checkpoint_id, storage_options)
    marker = storage.read_marker(loc)
    if marker is None:
        return "full"
    return validate_marker_mode(loc, marker)


def validate_marker_mode(loc: Location, marker: dict[str, Any]) -> Mode:
    mode = marker.get("mode")
    if mode not in MODES:
        raise CheckpointCorruptError(f"Commit marker {loc.url!r} names unknown mode {mode!r}; it is damaged.")
    return mode  # type: ignore[return-value]


_READ_AHEAD: dict[str, Any] = {}
"""A rank file read by :func:`saved_tensor_keys`, handed to the load that follows (read once)."""


def _torch_load(loc: Location, path: str) -> Any:
    if path in _READ_AHEAD:
        return _READ_AHEAD.pop(path)
    try:
        with loc.fs.open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(
            f"Checkpoint {loc.url!r} is committed but {path!r} is missing; the checkpoint is damaged, resume"
            " from another one."
        ) from exc
    except Exception as exc:
        raise storage.storage_error(loc, "read", exc) from exc
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointCorruptError(
            f"Could not read {path!r} of checkpoint {loc.url!r} ({type(exc).__name__}: {exc}); the file is"
            " damaged or not a checkpoint. Resume from another checkpoint."
        ) from exc


def _copy_into(target: Any, source: Any, url: str) -> None:
    check_same_keys(
        {"/".join(p) for p, leaf in walk(target) if is_tensor_leaf(leaf)},
        {"/".join(p) for p, leaf in walk(source) if is_tensor_leaf(leaf) or _is_encoded_shard(leaf)},
        url,
    )
    found = {"/".join(p): leaf for p, leaf in walk(source)}
    with torch.no_grad():
        for path, leaf in walk(target):
            if not is_tensor_leaf(leaf):
                continue
            value = found["/".join(path)]
            if isinstance(leaf, FlatShard):
                if isinstance(value, FlatShard):
                    value = value.local
                elif _is_encoded_shard(value):
                    value = value["flat_shard"]
                else:
                    leaf.load_from_full(value)
                    continue
                leaf.local.copy_(value)
            else:
                leaf.copy_(value)


def _is_encoded_shard(leaf: Any) -> bool:
    return isinstance(leaf, dict) and "flat_shard" in leaf


def _walk_encoded(tree: Any) -> Any:
    """Treat encoded shards as leaves again (walk would descend into their dicts)."""
    if _is_encoded_shard(tree):
        return FlatShard(tree["flat_shard"], tuple(tree["shape"]), tree["rank"], tree["world_size"])
    if isinstance(tree, dict):
        return {k: _walk_encoded(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_walk_encoded(v) for v in tree]
    return tree


def _version_dir(loc: Location, marker: dict[str, Any]) -> str:
    data = str(marker["data"])
    if "/" in data:  # relative to the marker's folder
        return loc.join(loc.parent, data)
    return loc.join(loc.data_root(), data)  # markers of version 1


def _load_full(state_dict: dict[str, Any], loc: Location) -> dict[str, Any]:
    content = _torch_load(loc, loc.path)
    _copy_into(state_dict, content, loc.url)
    return content


def read_full(checkpoint_id: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole content of a ``full`` checkpoint file (``weights_only=True``)."""
    loc = storage.resolve(checkpoint_id, storage_options)
    return _torch_load(loc, loc.path)


def _load_local(state_dict: dict[str, Any], loc: Location, marker: dict[str, Any]) -> dict[str, Any]:
    rank, world_size = _world()
    if marker["world_size"] != world_size:
        raise ValueError(
            f"Checkpoint {loc.url!r} was saved in 'local' mode with world size {marker['world_size']}; it can only"
            f" be loaded with that world size, not {world_size}. Resume with {marker['world_size']} processes, or"
            " save with ZeroCheckpointIO(mode='sharded') to change the world size."
        )
    content = _walk_encoded(_torch_load(loc, _rank_file(_version_dir(loc, marker), rank, world_size)))
    _copy_into(state_dict, content, loc.url)
    return content


def _dcp_reader(loc: Location, version_dir: str) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    if loc.is_local:
        return dcp.FileSystemReader(version_dir)
    return FsspecReader(loc.fs.unstrip_protocol(version_dir), **_fs_options(loc))


def _load_sharded(state_dict: dict[str, Any], loc: Location, marker: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    version_dir = _version_dir(loc, marker)
    objects = _torch_load(loc, f"{version_dir}/objects.pt")
    targets, _ = _split_for_dcp(state_dict)
    reader = _dcp_reader(loc, version_dir)
    check_same_keys(set(targets), _read_dcp_keys(loc, reader), loc.url)
    try:
        dcp.load(targets, storage_reader=reader, process_group=coordination_group())
    except CheckpointException as exc:  # raised on every rank: DCP gathers the failures
        cause = _dcp_failure(exc)
        if isinstance(cause, OSError) and not isinstance(cause, FileNotFoundError):
            raise storage.storage_error(loc, "read", cause) from exc
        raise CheckpointCorruptError(
            f"Could not read the data of checkpoint {loc.url!r} ({type(cause).__name__}: {cause}); its files are"
            " damaged or missing. Resume from another checkpoint."
        ) from exc
    with torch.no_grad():
        for path, leaf in walk(state_dict):
            key = "/".join(path)
            if isinstance(leaf, FlatShard):
                leaf.local.copy_(targets[key].to_local())
            elif isinstance(leaf, Tensor) and targets[key] is not leaf:
                leaf.copy_(targets[key])
    return objects
