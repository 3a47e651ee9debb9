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
   path and the cause. Called by the next save, by every load and at teardown.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import pickle
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException

from lightning_zero import _compat
from lightning_zero._collectives import group_device, new_group, process_group_timeout
from lightning_zero.checkpoint import dcp_items, integrity, storage
from lightning_zero.checkpoint.dcp_items import (
    FlatChunk,
    FlatChunkLoadPlanner,
    FlatChunkSavePlanner,
    forget_other_plans,
    forget_plans,
    parallel_reads,
    plan_cache_key,
    read_threads,
    tree_signature,
)
from lightning_zero.checkpoint.metrics import SaveStats
from lightning_zero.checkpoint.staging import Stager, ready_event
from lightning_zero.checkpoint.storage import CheckpointCorruptError, Location
from lightning_zero.checkpoint.tree import (
    FlatShard,
    check_same_keys,
    is_tensor_leaf,
    map_leaves,
    map_with_path,
    walk,
)

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


def prepare(local_ranks: int | None = None) -> None:
    """(collective, every rank, training thread) Create what background saves coordinate over:
    the gloo group. The strategy calls this at setup, so that no save (in ``local`` mode: no
    collective at all) has to make a collective on the training thread. ``local_ranks``: the
    ranks on this node, which share its CPUs between their reader threads ([Note: parallel reads])."""
    global _local_ranks
    coordination_group()
    if local_ranks is not None:
        _local_ranks = local_ranks


_local_ranks: int | None = None


def _ranks_on_this_node() -> int:
    """What ``prepare`` was told, else torchrun's ``LOCAL_WORLD_SIZE``, else every rank (the safe
    guess: fewer reader threads)."""
    if _local_ranks is not None:
        return _local_ranks
    if os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return _world()[1]


def coordination_group() -> Any:
    """(collective, training thread, first call) a gloo group for background coordination.

    Its timeout is the training group's (the strategy's ``timeout``): a peer that died or froze in a
    save then fails the save within the time the user chose for training collectives, instead of
    gloo's 30 minutes."""
    global _coordination_group
    if _coordination_group is None and _world()[1] > 1:
        _coordination_group = new_group(backend="gloo")
    return _coordination_group


@dataclass(frozen=True)
class _Team:
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


def _team(process_group: Any = None, coordinator_rank: int | None = None) -> _Team:
    """(training thread) Validate the functional API's group arguments; the same on every rank."""
    rank, world_size = _world()
    if process_group is None:
        coordinator = 0 if coordinator_rank is None else coordinator_rank
        if not 0 <= coordinator < world_size:
            raise ValueError(f"coordinator_rank={coordinator_rank} is not a rank of the world (size {world_size}).")
        return _Team(coordination_group(), rank, world_size, coordinator, coordinator, coordinator == 0)
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
    return _Team(process_group, ranks.index(rank), len(ranks), ranks.index(coordinator_global), coordinator_global,
                 len(ranks) == world_size and coordinator_global == 0)


def _all_gather_objects(value: Any, group: Any) -> list[Any]:
    if _world()[1] == 1:
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
        f"rank {_world()[0]}: lost contact with another rank in a checkpoint collective: a peer process died or"
        f" stopped answering within the process group timeout ({process_group_timeout()}). {outcome}; check the"
        f" other ranks' logs. ({type(exc).__name__}: {exc})"
    )


# ---- the async machinery ------------------------------------------------------------------


@dataclass
class _PendingSave:
    url: str
    future: Future
    staged: threading.Event
    started: float = field(default_factory=time.perf_counter)
    stats: SaveStats | None = None


class _AsyncSaver:
    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._pending: _PendingSave | None = None
        self._removals: list[tuple[Location, Future]] = []
        # Figures of committed saves, appended by the worker thread, drained by the training thread
        # (bounded: the functional API may never drain them).
        self._stats_lock = threading.Lock()
        self._committed: collections.deque[SaveStats] = collections.deque(maxlen=1024)
        self.last_stats: SaveStats | None = None
        self._submitted_stats: SaveStats | None = None

    def shut_down(self) -> None:
        """End the worker thread once what it was given is done (the next save starts another)."""
        self._reap_removals(blocking=True)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def executor(self) -> ThreadPoolExecutor:
        if self._executor is None:
            # One worker: saves and removals run in submission order.
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_zero_ckpt")
        return self._executor

    def submit(self, url: str, job: Callable[[threading.Event], Any], stats: SaveStats | None = None) -> _PendingSave:
        """Queue ``job`` after the save in flight. A failure of that one is raised (once) only after
        the new save is queued: one failed save must not cost the next checkpoint too."""
        previous_error: CheckpointSaveError | None = None
        try:
            self.finalize(blocking=True)
        except CheckpointSaveError as exc:
            previous_error = exc
        staged = threading.Event()
        self._pending = _PendingSave(url, self.executor().submit(job, staged), staged, stats=stats)
        self._submitted_stats = stats
        if stats is not None:
            self._pending.future.add_done_callback(lambda done: self._record(done, stats))
        if previous_error is not None:
            raise previous_error
        return self._pending

    def wait_for_staging(self) -> None:
        pending = self._pending
        if pending is not None and not pending.staged.is_set():
            started = time.perf_counter()
            pending.staged.wait()
            if pending.stats is not None:
                pending.stats.staging_wait_s += time.perf_counter() - started

    def _record(self, done: Future, stats: SaveStats) -> None:
        """Keep the figures of a save that committed, once; a failed one is raised instead. Called by the
        worker thread when the save ends and by :meth:`finalize`: ``future.result()`` can return before
        the worker has run its done-callbacks, and a caller reading ``last_stats`` right after a blocking
        finalize found None."""
        if done.cancelled() or done.exception() is not None:
            return
        with self._stats_lock:
            if self.last_stats is stats:  # one save in flight at a time: the other call recorded it
                return
            self._committed.append(stats)
            self.last_stats = stats

    def take_committed(self) -> list[SaveStats]:
        with self._stats_lock:
            committed = list(self._committed)
            self._committed.clear()
        return committed

    def note_blocked(self, seconds: float) -> None:
        """The caller's own measure of the training thread's time in the latest save call."""
        stats = self._submitted_stats
        if stats is not None:
            stats.blocked_s = max(stats.blocked_s, seconds)

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
        if pending.stats is not None:
            self._record(pending.future, pending.stats)
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
_STAGER = Stager()


def stage(tree: Any, ready: Any = None) -> Any:
    """(background thread) Copy every tensor of ``tree`` off the live state (see [Note: staging on GPUs])."""
    return _STAGER.stage(tree, ready)


def _forget_after_fork() -> None:
    """[Note: fork] A forked process inherits the saver's objects but none of its threads: a worker
    thread made in the parent (Lightning's spawn/fork launcher removes its weights file through the
    plugin in the main process) would leave the child's first save queued forever, and the parent's
    process groups are not the child's. The child starts with none of them. The parent's objects are
    kept referenced, never destroyed here: a process group's destructor would wait for threads that
    do not exist in this process."""
    global _SAVER, _STAGER, _coordination_group
    _INHERITED.extend([_SAVER, _STAGER, _coordination_group])
    _SAVER = _AsyncSaver()
    _STAGER = Stager()
    _coordination_group = None
    _READ_AHEAD.clear()


_INHERITED: list[Any] = []
os.register_at_fork(after_in_child=_forget_after_fork)


# ---- public functional API ----------------------------------------------------------------


def async_save(state_dict: dict[str, Any], checkpoint_id: str, *, mode: Mode = "sharded",
               storage_options: dict[str, Any] | None = None, marker_fields: dict[str, Any] | None = None,
               process_group: Any = None, coordinator_rank: int | None = None) -> None:
    """Save ``state_dict`` (nested dicts of tensors, :class:`FlatShard` and plain objects) in the
    background. Returns once the work is queued; tensors must not change until
    :func:`wait_for_staging` returns (the strategy calls it before each optimizer update).

    ``marker_fields`` (rank 0's are used): small plain values copied into the commit marker, where
    readers of ordinary Lightning files look for them (see [Note: marker format] in storage.py).

    ``process_group`` (a gloo group; default: every rank) and ``coordinator_rank`` (a global rank in
    it; default: its lowest) as in SageMaker's API: only the group's ranks save, as a unit (e.g. one
    replica group), and the coordinator commits. ``local`` and ``sharded`` only: ``full`` gathers to
    rank 0 of the whole world."""
    called = time.perf_counter()
    validate_mode(mode)
    team = _team(process_group, coordinator_rank)
    if mode == "full" and not team.default:
        raise ValueError("mode='full' saves over every rank to rank 0: call it without process_group/coordinator_rank,"
                         " or use mode='sharded' for a group of ranks.")
    loc = storage.resolve(checkpoint_id, storage_options)
    # New containers, same leaves: the caller may rebuild or mutate its dicts once we return.
    snapshot = map_leaves(state_dict, lambda leaf: leaf)
    fields = dict(marker_fields or {})
    ready = ready_event(snapshot)  # the copy is ordered after the kernels that produced the state
    step = fields.get("global_step", state_dict.get("global_step"))  # a full-mode tree is Lightning's own dict
    stats = SaveStats(loc.url, mode, step=step if isinstance(step, int) else None)
    _SAVER.submit(loc.url, lambda staged: _save_job(snapshot, loc, mode, team, staged, fields, ready, stats, called),
                  stats)
    stats.blocked_s = time.perf_counter() - called


def save(state_dict: dict[str, Any], checkpoint_id: str, *, mode: Mode = "sharded",
         storage_options: dict[str, Any] | None = None, marker_fields: dict[str, Any] | None = None,
         process_group: Any = None, coordinator_rank: int | None = None) -> None:
    """Synchronous save: :func:`async_save` then wait for the commit."""
    async_save(state_dict, checkpoint_id, mode=mode, storage_options=storage_options, marker_fields=marker_fields,
               process_group=process_group, coordinator_rank=coordinator_rank)
    maybe_finalize_async_calls(blocking=True)


def maybe_finalize_async_calls(blocking: bool = True, process_group: Any = None,
                               coordinator_rank: int | None = None) -> bool:
    """Finish the save in flight (``blocking``) or check on it; True when none is left.
    Raises :class:`CheckpointSaveError` if it failed.

    ``process_group``/``coordinator_rank`` are accepted as in SageMaker's API and validated; a rank's
    saves run one at a time in one worker, so this finishes the rank's save whichever group made it."""
    if process_group is not None or coordinator_rank is not None:
        _team(process_group, coordinator_rank)
    return _SAVER.finalize(blocking)


def release() -> None:
    """(every rank, training thread, after the last save was finalized) End the saver's worker thread and
    the coordination group, so that a finished run leaves nothing of this package running and repeated
    fits in one process do not accumulate groups; the next save or load makes them again (collectively:
    every rank saves and loads together)."""
    global _coordination_group
    _SAVER.shut_down()
    if _coordination_group is not None:
        group, _coordination_group = _coordination_group, None
        if dist.is_initialized():
            dist.destroy_process_group(group)


def wait_for_staging() -> None:
    """Block until the save in flight has copied its tensors (call before mutating them)."""
    _SAVER.wait_for_staging()


def last_save_stats() -> SaveStats | None:
    """This rank's figures of its newest committed save (None before the first commit)."""
    return _SAVER.last_stats


def take_committed_stats() -> list[SaveStats]:
    """This rank's figures of the saves committed since the last call, oldest first (no collective)."""
    return _SAVER.take_committed()


def note_blocked(seconds: float) -> None:
    """(training thread) Record that the newest save call held the caller for ``seconds`` (a caller
    that does more than :func:`async_save`, as ``ZeroLowLevelStrategy.save_checkpoint`` does)."""
    _SAVER.note_blocked(seconds)


def link(checkpoint_id: str, link_id: str, storage_options: dict[str, Any] | None = None) -> None:
    """(one rank) Make ``link_id`` another name of checkpoint ``checkpoint_id``, after the save in
    flight has committed (``ModelCheckpoint(save_last="link")``)."""
    _SAVER.link_after_pending(storage.resolve(checkpoint_id, storage_options), storage.resolve(link_id, storage_options))


def remove_incomplete(directory: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """(one process, after the saves of this process finished) Delete the leftovers of saves that
    never committed in ``directory`` (a job killed mid-save), keeping every committed checkpoint; see
    :func:`storage.remove_incomplete`. The next successful save of the same name does this for
    that name by itself; this is for names that are never saved again (``epoch=...`` files)."""
    maybe_finalize_async_calls(blocking=True)
    return storage.remove_incomplete(storage.resolve(directory, storage_options))


def remove(checkpoint_id: str, storage_options: dict[str, Any] | None = None) -> None:
    """(one rank) Delete a checkpoint, after the save in flight has committed."""
    _SAVER.remove_after_pending(storage.resolve(checkpoint_id, storage_options))


# ---- the background job -------------------------------------------------------------------


def _save_job(state: dict[str, Any], loc: Location, mode: Mode, team: _Team, staged: threading.Event,
              marker_fields: dict[str, Any], ready: Any = None, stats: SaveStats | None = None,
              called: float | None = None) -> None:
    """[Note: same collectives on every rank] Whatever fails on one rank (staging out of memory, a
    read-only path, a write error), every rank makes the same collectives in the same order: a
    failure is recorded, not raised, until the next exchange, so the others never wait in a
    collective the failing rank skipped. Exchanges: (1) before any data is written, (2) inside
    DCP / the ``full`` gathers, which fail on every rank together, (3) after writing, (4) the commit.
    """
    group, rank, world_size, coordinator = team.group, team.rank, team.world_size, team.coordinator
    error: str | None = None
    started = time.perf_counter()
    try:
        if mode == "full" and rank != 0:
            # Only rank 0 writes a full file: the others stage their shards (for the gathers) only.
            state = map_leaves(state, lambda leaf: None if isinstance(leaf, Tensor) else leaf)
        state = stage(state, ready)
    except Exception as exc:
        error = f"rank {rank}: staging the state failed ({type(exc).__name__}: {exc})"
    finally:
        staged.set()
    staging_done = time.perf_counter()
    if error is None:
        error = _preflight(loc, mode, rank)
    # (1) Rank 0 names the fresh version directory and the save id; every rank says whether it can go
    # on and, for a sharded save, what its tree is ([Note: cached save plans]).
    proposal = (loc.new_version_dir() if mode != "full" else "", uuid.uuid4().hex) if rank == coordinator else None
    signature = _tree_signature(state) if mode == "sharded" and error is None else None
    gathered = _all_gather_objects((proposal, error, signature), group)
    version_dir, save_id = gathered[coordinator][0]
    errors = [e for _, e, _ in gathered if e]
    if errors:
        raise CheckpointSaveError(f"Saving checkpoint {loc.url!r} failed before any data was written; the previous"
                                  " checkpoint is intact. " + "; ".join(errors))
    write_started = time.perf_counter()
    planned_bytes: int | None = None  # sharded: what DCP's plan gave this rank to write
    try:
        if mode == "local":
            _write_local(state, loc, version_dir, rank, world_size, save_id)
        elif mode == "sharded":
            planned_bytes = _write_sharded(state, loc, version_dir, team, save_id, [sig for _, _, sig in gathered])
        else:
            _write_full(state, loc, rank, group, save_id)
    except Exception as exc:  # reported to every rank below, raised at the next finalize
        error = f"rank {rank}: {storage.storage_error(loc, 'write', exc) if isinstance(exc, OSError) else exc!r}"
    written = time.perf_counter()
    errors = [e for e in _all_gather_objects(error, group) if e]  # (3)
    if errors:
        if rank == coordinator and version_dir and not (not loc.is_local and any(_unreachable(e) for e in errors)):
            # (An unreachable store keeps the partial version: nothing points at it, and the next
            # successful save of this name deletes it with the other stale versions.)
            _discard(loc, version_dir)
        raise CheckpointSaveError(
            f"Saving checkpoint {loc.url!r} failed; the previous checkpoint is intact. " + "; ".join(errors)
        )
    commit_error: str | None = None
    if rank == coordinator and mode != "full":
        try:
            # The data directory relative to the marker's folder: a copy of the marker beside it (a
            # `save_last="link"` on S3) names the same data.
            data = version_dir[len(loc.parent) + 1:] if loc.parent else version_dir
            fields = {"mode": mode, "world_size": world_size, "data": data, "save_id": save_id}
            shard_group_size = shard_group_size_of(state, world_size)
            if shard_group_size != world_size:
                fields["shard_group_size"] = shard_group_size
            storage.write_marker(loc, fields, marker_fields)
        except Exception as exc:
            commit_error = f"writing the commit marker failed: {exc}"
            _discard(loc, version_dir)
        else:
            try:
                storage.remove_stale_versions(loc, keep=version_dir)
            except Exception as exc:  # committed already; leftovers only cost space
                log.warning("Could not delete old data versions of %s: %s", loc.url, exc)
    # (4) Every rank learns whether the commit happened, so every rank raises if it did not.
    commit_error = _all_gather_objects(commit_error, group)[coordinator] if mode != "full" else commit_error
    if commit_error:
        raise CheckpointSaveError(f"Saving checkpoint {loc.url!r} failed; the previous checkpoint is intact: {commit_error}")
    if stats is not None:
        committed = time.perf_counter()
        stats.staging_s = staging_done - started
        stats.write_s = written - write_started
        stats.commit_s = committed - written
        stats.committed_after_s = committed - (called if called is not None else started)
        stats.bytes_written = planned_bytes if planned_bytes is not None else _bytes_written(state, mode, rank)


def _bytes_written(state: Any, mode: Mode, rank: int) -> int:
    """Tensor bytes this rank wrote (see ``SaveStats.bytes_written``)."""
    total = 0
    for _, leaf in _tensor_leaves(state):
        if isinstance(leaf, FlatShard):
            total += leaf.local.element_size() * (leaf.numel if mode == "full" else leaf.local.numel())
        elif mode == "local" or rank == 0:  # replicated: DCP and the full file take rank 0's
            total += leaf.numel() * leaf.element_size()
    return total if mode != "full" or rank == 0 else 0


def _preflight(loc: Location, mode: Mode, rank: int) -> str | None:
    """This rank's reason it cannot write ``loc`` (a read-only or refused path), found before any
    checkpoint data is written; None when it can. Object stores have no directories to probe: their
    refusals come from the first upload, which every rank then reports at exchange (3)."""
    if mode == "full" and rank != 0:
        return None
    if not loc.is_local:
        # DCP's fsspec writer makes its directory with makedirs, which on s3fs creates a missing bucket.
        bucket = loc.path.split("/", 1)[0]
        try:
            loc.fs.info(bucket)
        except FileNotFoundError:
            return (f"rank {rank}: Could not write checkpoint at {loc.url!r}: the bucket or prefix does not exist:"
                    f" create the bucket {bucket!r} or fix the path.")
        except Exception:  # e.g. no s3:ListBucket permission: the uploads themselves will tell
            pass
        return None
    directory = loc.data_root() if mode != "full" else (loc.parent or ".")
    probe = f"{directory}/.lightning_zero-probe-{uuid.uuid4().hex[:8]}"
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as exc:
        return f"rank {rank}: cannot write {directory!r}: {storage.storage_error(loc, 'write', exc)}"
    return None


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
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            _save_keeping_write_errors(obj, storage.WritebackStream(f))  # [Note: early writeback]
            f.flush()
            os.fsync(f.fileno())
    else:
        f = loc.fs.open(path, "wb")
        try:
            _save_keeping_write_errors(obj, f)
        except BaseException:
            storage.abort_upload(f)
            raise
        f.close()


class _WriteErrorKeeper:
    """A file wrapper that remembers the first error of ``write``.

    torch.save's C++ zip writer swallows the Python exception of a failed ``write`` and reports only
    "[enforce fail at inline_container.cc] unexpected pos" (seen on a full tmpfs): the real cause
    (ENOSPC, a refused upload) is re-raised from here instead."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        try:
            return self._raw.write(data)
        except BaseException as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def _save_keeping_write_errors(obj: Any, f: Any) -> None:
    keeper = _WriteErrorKeeper(f)
    try:
        torch.save(obj, keeper)
    except Exception as exc:
        if keeper.error is not None:
            raise keeper.error from exc
        raise


def _encode_shards(state: Any) -> Any:
    """FlatShard -> a plain dict that ``torch.load(weights_only=True)`` accepts."""
    return map_leaves(state, lambda leaf: {"flat_shard": leaf.local, "shape": list(leaf.shape),
                                           "rank": leaf.rank, "world_size": leaf.world_size,
                                           "replicas": leaf.replicas, "replica_rank": leaf.replica_rank}
                      if isinstance(leaf, FlatShard) else leaf)


def _rank_file(version_dir: str, rank: int, world_size: int) -> str:
    return f"{version_dir}/rank{rank:05d}-of-{world_size:05d}.pt"


def _write_local(state: Any, loc: Location, version_dir: str, rank: int, world_size: int, save_id: str) -> None:
    encoded = _encode_shards(state)
    encoded[integrity.HEADER_KEY] = integrity.header(encoded, save_id, rank, world_size)
    _torch_save_to(loc, _rank_file(version_dir, rank, world_size), encoded)


def _tree_signature(state: Any) -> int:
    return tree_signature({"/".join(path): leaf for path, leaf in _tensor_leaves(state)})


def _write_sharded(state: Any, loc: Location, version_dir: str, team: _Team, save_id: str,
                   signatures: list[int]) -> int:
    """DCP first, on every rank (it reports a failure on any rank to all of them), then rank 0's
    objects file, which records the save id (``.metadata`` carries it too) and the full shape of
    every tensor (flat shards hide it from DCP's metadata). ``signatures``: every rank's
    :func:`_tree_signature`, the same list on every rank."""
    import torch.distributed.checkpoint as dcp

    FsspecWriter, _ = _compat.fsspec_storage_classes()
    tensors, objects = _split_for_dcp(state)
    if loc.is_local:
        writer = integrity.checksumming_writer(dcp.FileSystemWriter, save_id)(version_dir, sync_files=True,
                                                                              thread_count=dcp_items.WRITE_THREADS)
        writer.fs = storage.WritebackFileSystem(writer.fs)  # [Note: early writeback]
    else:  # fsync fails on s3fs streams: durability there comes from the completed upload
        writer = integrity.checksumming_writer(FsspecWriter, save_id)(loc.fs.unstrip_protocol(version_dir), sync_files=False,
                                                            thread_count=dcp_items.WRITE_THREADS, **_fs_options(loc))
        _same_retries(writer, loc)
    # Replicated tensors (buffers, parameters no optimizer holds) are written by the lowest rank
    # holding them, so a checkpoint holds rank 0's buffers, as DDP keeps (DESIGN.md, Lifecycle).
    spread = _has_replicas(state)
    cache_key = plan_cache_key(team.global_ranks, spread, signatures)
    forget_other_plans(cache_key)
    planner = FlatChunkSavePlanner(spread_replicas=spread, cache_key=cache_key)
    try:
        # DCP's own coordinator (its plans and ``.metadata``) is the group's first rank; the commit that
        # makes the checkpoint valid (the marker) is ours, written by ``team``'s coordinator.
        dcp.save(tensors, storage_writer=writer, planner=planner, process_group=team.group)
    except BaseException as exc:
        forget_plans(cache_key)  # DCP fails every rank together: all of them plan the next save afresh
        if isinstance(exc, CheckpointException):
            raise _dcp_failure(exc) from exc
        raise
    if team.is_coordinator:
        shapes = {path: list(leaf.shape) for path, leaf in _tensor_leaves(state)}
        objects[integrity.HEADER_KEY] = integrity.header(objects, save_id, world_size=team.world_size, shapes=shapes)
        _torch_save_to(loc, f"{version_dir}/objects.pt", objects)
    return planner.bytes_planned


def _has_replicas(state: Any) -> bool:
    return any(isinstance(leaf, FlatShard) and leaf.replicas > 1 for _, leaf in walk(state))


def shard_group_size_of(state: Any, world_size: int) -> int:
    """The shard group size the flat shards of ``state`` were split over (the world without any)."""
    return next((leaf.world_size for _, leaf in walk(state) if isinstance(leaf, FlatShard)), world_size)


def _tensor_leaves(tree: Any) -> Iterator[tuple[str, Tensor | FlatShard]]:
    for path, leaf in walk(tree):
        if is_tensor_leaf(leaf):
            yield "/".join(path), leaf


def _dcp_failure(exc: CheckpointException) -> Exception:
    """DCP reports the ranks' errors as one CheckpointException, a BaseException that ``except
    Exception`` (ours, Lightning's, the user's) misses: the lowest failing rank's own error instead,
    so a full disk or refused access is classified like any other storage error."""
    rank, (cause, _) = min(exc.failures.items(), key=lambda item: item[0])
    if isinstance(cause, Exception):
        return cause
    return RuntimeError(f"torch.distributed.checkpoint failed on rank {rank}: {cause!r}")


def _fs_options(loc: Location) -> dict[str, Any]:
    return dict(getattr(loc.fs, "storage_options", {}) or {})


def _same_retries(dcp_storage: Any, loc: Location) -> None:
    """DCP's fsspec reader/writer build their own filesystem from the options (a new instance when the
    cache is skipped): it gets the bounded retries of ``loc.fs`` (see [Note: bounded S3 failures])."""
    inner = getattr(getattr(dcp_storage, "fs", None), "fs", None)
    if inner is not None and hasattr(loc.fs, "retries"):
        inner.retries = loc.fs.retries


def _unreachable(error: str) -> bool:
    """Whether a save failed because the store stopped answering (every further call would wait out
    its timeouts and retries too)."""
    return any(sign in error for sign in ("ConnectTimeout", "ReadTimeout", "EndpointConnectionError", "timed out",
                                          "ClientConnectorError", "ServerDisconnected", "Connection reset",
                                          "ConnectionClosed", "Cannot connect"))


def _split_for_dcp(state: Any) -> tuple[dict[str, Any], Any]:
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


def _write_full(state: Any, loc: Location, rank: int, group: Any, save_id: str) -> None:
    full = gather_tree_to_rank0(state, group)
    if rank != 0:
        return
    full[integrity.HEADER_KEY] = integrity.header(full, save_id)
    if not loc.is_local:
        _torch_save_to(loc, loc.path, full)
        return
    import glob

    tmp = f"{loc.path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        _torch_save_to(loc, tmp, full)
        os.replace(tmp, loc.path)  # the file appears whole or not at all
    except BaseException:
        # A partial file must not stay behind, least of all on a full disk.
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    # Temporary files of saves of this name that died (SIGKILL) before their rename: one worker
    # writes a name at a time, so none of them is in progress.
    for leftover in glob.glob(f"{glob.escape(loc.path)}.tmp-*"):
        with contextlib.suppress(OSError):
            os.remove(leftover)


GATHER_BUCKET_BYTES = 64 * 2**20
"""Shards gathered to rank 0 together (``full`` mode, plain CheckpointIO plugins): two collectives a
bucket instead of two a tensor, and never more than one bucket's gather buffers beyond the result."""


def gather_tree_to_rank0(tree: Any, group: Any) -> Any:
    """(collective, every rank) Every FlatShard of ``tree`` as a whole tensor on rank 0 (None elsewhere).

    Shards go in buckets of up to :data:`GATHER_BUCKET_BYTES` (consecutive, one dtype). Before each
    bucket's gather every rank says whether it could prepare its buffers (one tiny all-reduce), so a
    rank that runs out of memory half-way makes all of them stop at the same bucket and raise,
    instead of leaving the others in a gather it never joins (see [Note: same collectives on every rank]).
    """
    shards = [("/".join(path), leaf) for path, leaf in walk(tree) if isinstance(leaf, FlatShard)]
    failure: list[BaseException] = []
    whole: dict[str, Tensor | None] = {}
    for bucket in _gather_buckets(shards):
        whole.update(_gather_bucket_to_rank0(bucket, group, failure))
        if failure:
            raise failure[0]
    return map_with_path(tree, lambda path, leaf: whole[path] if isinstance(leaf, FlatShard) else leaf)


def _gather_buckets(shards: list[tuple[str, FlatShard]]) -> Iterator[list[tuple[str, FlatShard]]]:
    bucket: list[tuple[str, FlatShard]] = []
    filled = 0
    for key, shard in shards:
        size = shard.layout.padded_numel * shard.local.element_size()
        if bucket and (filled + size > GATHER_BUCKET_BYTES or shard.local.dtype != bucket[0][1].local.dtype):
            yield bucket
            bucket, filled = [], 0
        bucket.append((key, shard))
        filled += size
    if bucket:
        yield bucket


def _gather_bucket_to_rank0(bucket: list[tuple[str, FlatShard]], group: Any,
                            failure: list[BaseException]) -> dict[str, Tensor | None]:
    world_size = bucket[0][1].world_size  # the shard group's
    if world_size == 1:
        return {key: shard.local.reshape(shard.shape).clone() for key, shard in bucket}
    # Hybrid: every rank of the group takes part; rank 0 keeps the rows of its own shard group, the
    # first ``world_size`` ranks ([Note: hybrid layout]). (R copies travel to rank 0; ``full`` is for export.)
    group_size = dist.get_world_size(group)
    rank = dist.get_rank()
    # The group's own device: the strategy gathers a plain CheckpointIO's file on the training group,
    # which on GPUs is NCCL and takes CUDA tensors only; the coordination group is gloo (CPU).
    device = group_device(group)
    chunks = [shard.layout.chunk for _, shard in bucket]
    padded = gather_list = None
    try:
        padded = torch.zeros(sum(chunks), dtype=bucket[0][1].local.dtype, device=device)
        offset = 0
        for (_, shard), chunk in zip(bucket, chunks):
            padded[offset: offset + shard.local.numel()] = shard.local
            offset += chunk
        gather_list = [torch.empty_like(padded) for _ in range(group_size)] if rank == 0 else None
    except Exception as exc:
        padded = gather_list = None
        largest = max((shard for _, shard in bucket), key=lambda s: s.numel)
        failure.append(RuntimeError(f"rank {rank}: gathering a tensor of shape {largest.shape} to rank 0 failed"
                                    f" ({type(exc).__name__}: {exc})"))
    ready = torch.tensor([0 if failure else 1], dtype=torch.int32, device=device)
    try:
        dist.all_reduce(ready, op=dist.ReduceOp.MIN, group=group)
        if not ready.item():
            if not failure:
                failure.append(RuntimeError(f"rank {rank}: stopped the gather to rank 0 because another rank failed"
                                            " (its error names it)"))
            return {}
        dist.gather(padded, gather_list, dst=0, group=group)
    except Exception as exc:
        raise peer_lost(exc) from exc
    if rank != 0:
        return {key: None for key, _ in bucket}
    assert gather_list is not None
    rows = torch.stack(gather_list[:world_size]).cpu()  # [world_size, sum(chunks)]
    out: dict[str, Tensor | None] = {}
    offset = 0
    for (key, shard), chunk in zip(bucket, chunks):
        # Contiguous strides: a one-element tensor cut from a column keeps the row stride otherwise,
        # which ``view(torch.uint8)`` (the checksum) refuses.
        out[key] = rows[:, offset: offset + chunk].reshape(-1)[: shard.numel].reshape(shard.shape).clone(
            memory_format=torch.contiguous_format)
        offset += chunk
    return out


# ---- loading ------------------------------------------------------------------------------


def load(state_dict: dict[str, Any], checkpoint_id: str, *,
         storage_options: dict[str, Any] | None = None, process_group: Any = None,
         coordinator_rank: int | None = None, strict: bool = True) -> dict[str, Any]:
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
    team = _team(process_group, coordinator_rank)
    loc = storage.resolve(checkpoint_id, storage_options)
    with shared_metadata(loc, team):  # finalizes the save in flight first
        error: BaseException | None = None
        finish: Callable[[], dict[str, Any]] | None = None
        try:
            finish = _prepare_load(state_dict, loc, team, strict)
        except Exception as exc:
            error = exc
        agree(error, loc, team)
        assert finish is not None
        return finish()


# [Note: shared metadata]
# A ``sharded`` checkpoint's ``.metadata`` lists every item of every rank: ~110 MB at 1024 ranks
# (bench/scale.py). Were every rank to read it, a resume would read it 1024 times from the shared
# file system or bucket (twice over in the Trainer's resume, whose key check reads it too). One
# rank (the team's coordinator) reads it and broadcasts the bytes over the coordination group;
# every rank unpickles them once (restricted, as the file would be) and its DCP readers use that
# ``Metadata`` for the rest of the load. The broadcast comes first, where every rank is, before
# anything that may fail on one rank only, so no rank waits in it for a rank that has left: a
# failed read there (no marker, no .metadata, an unreachable bucket) is raised on every rank, with
# a note naming the rank that read. A save still in flight is finalized first: its background
# collectives run over the same group. The other files (marker, objects file, data) are read by
# each rank as before.
_SHARED_METADATA: dict[tuple[str, tuple[int, ...]], tuple[str, Any] | None] = {}
"""(url, the team's ranks) -> (version directory, its unpickled ``.metadata``), or None where the
checkpoint is not ``sharded``; held for the duration of :func:`shared_metadata`."""


@contextlib.contextmanager
def shared_metadata(loc: Location, team: _Team | None = None) -> Iterator[None]:
    """(collective over the team when it has more than one rank) Within it, the DCP readers of
    ``loc`` use ``.metadata`` as the team's coordinator read it ([Note: shared metadata]). Nested
    uses for the same checkpoint and team share once."""
    maybe_finalize_async_calls(blocking=True)
    team = team if team is not None else _team()
    key = (loc.url, team.global_ranks)
    if team.world_size == 1 or key in _SHARED_METADATA:
        yield
        return
    read: tuple[str, bytes] | None = None
    error: BaseException | None = None
    if team.is_coordinator:
        try:
            read = _read_metadata_bytes(loc)
        except Exception as exc:
            error = _sendable(exc)
    payload = [(read, error)]
    try:
        dist.broadcast_object_list(payload, src=team.coordinator_global, group=team.group)
    except Exception as exc:  # gloo: a peer died or froze
        if error is not None:  # the cause, which the others may have timed out waiting for
            _add_note(error, f"Sending it to the other ranks failed too: {type(exc).__name__}: {exc}")
            raise error  # noqa: B904 - its own cause (the storage error) stays; exc is its context
        raise peer_lost(exc, loading=True) from exc
    if error is not None:
        raise error
    read, received = payload[0]
    del payload
    if received is not None:
        _add_note(received, f"rank {team.coordinator_global} read this checkpoint's .metadata for every rank"
                            " ([Note: shared metadata]).")
        raise received
    # Unpickled here, once, on every rank (the same bytes fail the same way everywhere); the bytes go.
    _SHARED_METADATA[key] = None if read is None else (read[0], integrity.unpickle_metadata(read[1], loc.url))
    del read
    try:
        yield
    finally:
        _SHARED_METADATA.pop(key, None)


def _read_metadata_bytes(loc: Location) -> tuple[str, bytes] | None:
    """(coordinator) The version directory of a ``sharded`` checkpoint and its ``.metadata`` bytes."""
    marker = storage.read_marker(loc)
    if marker is None or validate_marker_mode(loc, marker) != "sharded":
        return None
    version_dir = _check_version_dir(loc, marker)
    reader = _dcp_reader(loc, version_dir)
    with _reading_dcp_metadata(loc):
        return version_dir, reader.metadata_bytes()


def _shared_metadata_of(loc: Location, version_dir: str) -> Any:
    """The ``Metadata`` :func:`shared_metadata` holds for ``version_dir`` of ``loc``, or None."""
    for (url, _), shared in _SHARED_METADATA.items():
        if shared is not None and url == loc.url and shared[0] == version_dir:
            return shared[1]
    return None


def _add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` where Python has it (3.11+)."""
    if hasattr(error, "add_note"):
        error.add_note(note)


def _sendable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling (to other ranks), else a RuntimeError with its text (raised
    on the coordinator too, so every rank raises the same type)."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - an exception class that does not pickle
        converted = RuntimeError(f"{type(error).__name__}: {error}")
        converted.__cause__ = error
        return converted
    return error


def _prepare_load(state_dict: dict[str, Any], loc: Location, team: _Team,
                  strict: bool = True) -> Callable[[], dict[str, Any]]:
    """Read and check without touching ``state_dict``; returns what completes the load."""
    marker = storage.read_marker(loc)
    if marker is None:
        content = _read_full_checked(loc)
        _check_into(state_dict, content, loc.url, loc.path, strict)
        return lambda: _copy_into(state_dict, content, loc.url)
    mode = marker.get("mode")
    if mode == "local":
        content = _read_local(loc, marker, shard_group_size=shard_group_size_of(state_dict, team.world_size),
                              team=team)
        _check_into(state_dict, content, loc.url, _rank_file(_version_dir(loc, marker), team.rank, team.world_size),
                    strict)
        return lambda: _copy_into(state_dict, content, loc.url)
    if mode == "sharded":
        return _prepare_sharded(state_dict, loc, marker, team, strict)
    raise CheckpointCorruptError(f"Commit marker {loc.url!r} names unknown mode {mode!r}.")


def agree(error: BaseException | None, loc: Location, team: _Team | None = None) -> None:
    """(collective over the coordination group, or the team's, when there is more than one rank) Raise
    on every rank if any rank failed: this rank's own error, or one that names the failing ranks."""
    team = team if team is not None else _team()
    reports: list[str | None] = [None]
    if team.world_size > 1:
        report = None if error is None else f"rank {_world()[0]}: {type(error).__name__}: {error}"
        reports = _all_gather_objects(report, team.group)
    if error is not None:
        raise error
    failed = [r for r in reports if r]
    if failed:
        raise CheckpointCorruptError(f"Loading checkpoint {loc.url!r} failed on another rank, so no rank loads it: "
                                     + "; ".join(failed))


def saved_tensor_keys(checkpoint_id: str, storage_options: dict[str, Any] | None = None) -> set[str]:
    """Paths of the tensors a ``local`` or ``sharded`` checkpoint holds."""
    loc = storage.resolve(checkpoint_id, storage_options)
    marker = storage.read_marker(loc)
    if marker is None:
        raise ValueError(f"{loc.url!r} is a 'full' checkpoint; read it with load().")
    if marker.get("mode") == "sharded":
        return set(_read_dcp_metadata(loc, _dcp_reader(loc, _version_dir(loc, marker))).state_dict_metadata)
    rank, world_size = _world()
    # This rank's own file when the world size matches (the load that follows then reuses it),
    # rank 0's otherwise (the load will refuse the world size with a clear message).
    hybrid = int(marker.get("shard_group_size", marker["world_size"])) < marker["world_size"]
    reader_rank = rank if world_size == marker["world_size"] or (hybrid and rank < marker["world_size"]) else 0
    content = _read_local(loc, marker, reader_rank)
    _READ_AHEAD.clear()  # at most one file held
    _READ_AHEAD[_rank_file(_version_dir(loc, marker), reader_rank, marker["world_size"])] = content
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
"""A rank file read (and verified) by :func:`saved_tensor_keys`, handed to the load that follows (read once)."""


def _torch_load(loc: Location, path: str) -> Any:
    """One ``torch.save`` file, ``weights_only``, on CPU, without a second copy of its bytes: a local
    file is memory-mapped (tensors are paged in as they are copied into the state), a remote one is
    deserialized straight from the stream (``full`` files are a whole model: issue 8, item 7)."""
    try:
        if loc.is_local:
            if not os.path.isfile(path):
                raise FileNotFoundError(path)
            data: Any = path
        else:
            data = loc.fs.open(path, "rb")
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(
            f"Checkpoint {loc.url!r} is committed but {path!r} is missing; the checkpoint is damaged, resume"
            " from another one."
        ) from exc
    except Exception as exc:
        raise storage.storage_error(loc, "read", exc) from exc
    try:
        if isinstance(data, str):
            try:
                return torch.load(data, map_location="cpu", weights_only=True, mmap=True)
            except (RuntimeError, OSError):
                # Not mappable (the legacy format, an empty or truncated file): read it whole, which
                # reports a damaged file as such below.
                return torch.load(data, map_location="cpu", weights_only=True)
        with data:
            return torch.load(data, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointCorruptError(storage.refused_pickle(loc.url, f"file {path!r}", exc)) from None
    except OSError as exc:
        if not loc.is_local:  # the store, not the file, failed mid-read
            raise storage.storage_error(loc, "read", exc) from exc
        error: Exception = exc
    except Exception as exc:
        error = exc
    raise CheckpointCorruptError(
        f"Could not read {path!r} of checkpoint {loc.url!r} ({type(error).__name__}: {error}); the file is"
        " damaged or not a checkpoint. Resume from another checkpoint."
    ) from error


def _check_version_dir(loc: Location, marker: dict[str, Any]) -> str:
    version_dir = _version_dir(loc, marker)
    try:
        exists = loc.fs.exists(version_dir) or bool(loc.fs.ls(version_dir, detail=False))
    except FileNotFoundError:
        exists = False
    except Exception as exc:
        raise storage.storage_error(loc, "read", exc) from exc
    if not exists:
        raise CheckpointCorruptError(
            f"Checkpoint {loc.url!r} is committed but the data version it points at, {version_dir!r}, is missing;"
            " the checkpoint is damaged. Resume from another checkpoint."
        )
    return version_dir


def _read_local(loc: Location, marker: dict[str, Any], rank: int | None = None,
                shard_group_size: int | None = None, team: _Team | None = None) -> Any:
    """This rank's file of a ``local`` checkpoint (refused at another world size, except with fewer
    replica groups of the same ``shard_group_size``: see :func:`_check_local_world`), checked."""
    own_rank, world_size = (team.rank, team.world_size) if team is not None else _world()
    if rank is None or rank == own_rank:
        _check_local_world(loc, marker, world_size, shard_group_size)
    return read_rank_file(loc, marker, own_rank if rank is None else rank)


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


def read_rank_file(loc: Location, marker: dict[str, Any], rank: int) -> Any:
    """Rank ``rank``'s file of a ``local`` checkpoint, checked to belong to this checkpoint and this
    rank and to be intact (see integrity.py), with its shards as :class:`FlatShard` leaves."""
    path = _rank_file(_version_dir(loc, marker), rank, marker["world_size"])
    if path in _READ_AHEAD:
        return _READ_AHEAD.pop(path)
    _check_version_dir(loc, marker)
    content, found = integrity.split(_torch_load(loc, path), path, loc.url, required="save_id" in marker)
    if found is not None:
        integrity.check_identity(found, path, loc.url, marker.get("save_id"), rank, marker["world_size"])
        integrity.verify(content, found, path, loc.url)
    return _walk_encoded(content)


def _read_full_checked(loc: Location) -> Any:
    content, found = integrity.split(_torch_load(loc, loc.path), loc.path, loc.url, required=False)
    if found is not None:  # files written by other tools (plain Lightning, convert) carry no header
        integrity.verify(content, found, loc.path, loc.url)
    return content


def _check_into(target: Any, source: Any, url: str, file: str, strict: bool = True) -> None:
    """Same tensor keys and the same shapes (a flat shard of another shape has the same element count)."""
    check_same_keys(
        {"/".join(p) for p, leaf in walk(target) if is_tensor_leaf(leaf)},
        {"/".join(p) for p, leaf in walk(source) if is_tensor_leaf(leaf)},
        url,
        strict,
    )
    found = {"/".join(p): leaf for p, leaf in walk(source)}
    for path, leaf in walk(target):
        if not is_tensor_leaf(leaf):
            continue
        key = "/".join(path)
        value = found[key]
        saved_shape = tuple(value.shape)
        if isinstance(leaf, FlatShard) and isinstance(value, FlatShard):
            ok = value.shape == leaf.shape and value.local.numel() == leaf.local.numel()
        else:
            ok = saved_shape == tuple(leaf.shape)
        if not ok:
            raise ValueError(
                f"Checkpoint {url!r} ({file!r}) holds {key!r} with shape {saved_shape}, this model has"
                f" {tuple(leaf.shape)}: it was saved from another model. Load it into the model it was saved from."
            )


def _copy_into(target: Any, source: Any, url: str) -> dict[str, Any]:
    found = {"/".join(p): leaf for p, leaf in walk(source)}
    with torch.no_grad():
        for path, leaf in walk(target):
            if not is_tensor_leaf(leaf):
                continue
            value = found["/".join(path)]
            if isinstance(leaf, FlatShard):
                if isinstance(value, FlatShard):
                    leaf.local.copy_(value.local)
                else:
                    leaf.load_from_full(value)
            else:
                leaf.copy_(value)
    return source


def _is_encoded_shard(leaf: Any) -> bool:
    return isinstance(leaf, dict) and "flat_shard" in leaf


def _walk_encoded(tree: Any) -> Any:
    """Treat encoded shards as leaves again (walk would descend into their dicts)."""
    if _is_encoded_shard(tree):
        return FlatShard(tree["flat_shard"], tuple(tree["shape"]), tree["rank"], tree["world_size"],
                         tree.get("replicas", 1), tree.get("replica_rank", 0))
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


def read_full(checkpoint_id: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole content of a ``full`` checkpoint file (``weights_only=True``, checksums verified)."""
    return _read_full_checked(storage.resolve(checkpoint_id, storage_options))


def _dcp_reader(loc: Location, version_dir: str, require_checksums: bool = False) -> Any:
    import torch.distributed.checkpoint as dcp

    _, FsspecReader = _compat.fsspec_storage_classes()

    def require() -> bool:
        return require_checksums

    threads = read_threads(_ranks_on_this_node())
    if loc.is_local:
        reader = parallel_reads(integrity.verifying_reader(dcp.FileSystemReader, loc.url, require), threads)(
            version_dir)
    else:
        reader = parallel_reads(integrity.verifying_reader(FsspecReader, loc.url, require), threads)(
            loc.fs.unstrip_protocol(version_dir), **_fs_options(loc))
        _same_retries(reader, loc)
    reader.shared_metadata = _shared_metadata_of(loc, version_dir)  # [Note: shared metadata]
    return reader


def _read_dcp_metadata(loc: Location, reader: Any) -> Any:
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


def open_sharded(loc: Location, marker: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any] | None, Any, Any]:
    """A ``sharded`` checkpoint's version directory, objects (checked), integrity header, a verifying
    DCP reader and its metadata, refused when the metadata belongs to another save."""
    version_dir = _check_version_dir(loc, marker)
    objects_file = f"{version_dir}/objects.pt"
    objects, found = integrity.split(_torch_load(loc, objects_file), objects_file, loc.url,
                                     required="save_id" in marker)
    if found is not None:
        integrity.check_identity(found, objects_file, loc.url, marker.get("save_id"), world_size=marker["world_size"])
        integrity.verify(objects, found, objects_file, loc.url)
    reader = _dcp_reader(loc, version_dir, require_checksums=found is not None and found.get("tensors") is not None)
    metadata = _read_dcp_metadata(loc, reader)
    save_id = marker.get("save_id")
    if save_id is not None and getattr(metadata.storage_meta, "save_id", None) != save_id:
        raise CheckpointCorruptError(
            f"'{version_dir}/.metadata' belongs to another save than checkpoint {loc.url!r} (save id"
            f" {metadata.storage_meta.save_id!r}, the commit marker says {save_id!r}): it was replaced."
            " Resume from another checkpoint."
        )
    return version_dir, objects, found, reader, metadata


def _prepare_sharded(state_dict: dict[str, Any], loc: Location, marker: dict[str, Any],
                     team: _Team, strict: bool = True) -> Callable[[], dict[str, Any]]:
    _, objects, found, reader, metadata = open_sharded(loc, marker)
    # DCP copies each item into its target as it reads it: fresh buffers keep the state untouched
    # when an item further on turns out damaged (one more copy of this rank's shards, at load only).
    targets, _ = _split_for_dcp(map_leaves(state_dict, _empty_like))
    check_same_keys(set(targets), set(metadata.state_dict_metadata), loc.url, strict)
    _read_whole_where_saved_whole(state_dict, targets, metadata)
    if found is not None:
        integrity.check_shapes({key: leaf.shape for key, leaf in _tensor_leaves(state_dict)}, found["shapes"], loc.url)
    return lambda: _load_sharded(state_dict, targets, reader, loc, objects, team)


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
                  objects: dict[str, Any], team: _Team) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(targets, storage_reader=reader, planner=FlatChunkLoadPlanner(), process_group=team.group)
    except CheckpointException as exc:  # raised on every rank: DCP gathers the failures
        cause = _dcp_failure(exc)
        if isinstance(cause, CheckpointCorruptError):
            raise cause from exc
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
                target = targets[key]
                if isinstance(target, Tensor):  # [Note: saved whole]
                    leaf.load_from_full(target)
                else:
                    leaf.local.copy_(target.local)
            elif isinstance(leaf, Tensor):
                leaf.copy_(targets[key])
    return objects
