"""When and how checkpoints are written: the async saver, the three modes, and the commit.

Call order (every rank makes each call unless marked):

1. ``async_save(state, id)`` on the training thread: finalizes the previous save (raising its
   error, if any), snapshots non-tensor leaves and hands the tensors to the background thread.
   Returns at once.
2. (background) staging: every tensor is copied off the live state. Only the optimizer step
   mutates saved tensors, so the strategy calls :func:`wait_for_staging` right before it
   (torchtitan's ``maybe_wait_for_staging``); forward and backward overlap the copy.
3. (background) writing, in the mode's way (its :class:`~lightning_zero.checkpoint.modes.CheckpointMode`
   object, whose docstring lists its calls): ``local`` each rank its own file; ``sharded`` DCP (each rank
   its own shard, plus metadata); ``full`` shards gathered to rank 0, which writes one file.
4. (background) every rank reports success or its error over a dedicated gloo group (never
   the training group: a collective there from another thread could interleave with training
   collectives and deadlock), then (coordinator) rank 0 writes the commit marker and runs the
   removals queued behind this save (see [Note: checkpoint layout] in storage.py).
5. ``maybe_finalize_async_calls(blocking=True)``: waits, raising the background error with the
   path and the cause. Called by the next save, by every load and at teardown.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_zero.checkpoint.formats import packed
from lightning_zero.checkpoint.formats.tree import map_leaves, shard_group_size_of
from lightning_zero.checkpoint.modes import MODES, CheckpointMode, Mode, SaveTarget, mode_named
from lightning_zero.checkpoint.runtime import process
from lightning_zero.checkpoint.runtime.scheduler import CheckpointSaveError, checkpointer
from lightning_zero.checkpoint.runtime.staging import ready_event
from lightning_zero.checkpoint.runtime.stats import SaveStats
from lightning_zero.checkpoint.runtime.team import (
    Team,
    all_gather_objects,
    make_team,
)
from lightning_zero.checkpoint.store import cleanup, file_io, storage
from lightning_zero.checkpoint.store.storage import Location
from lightning_zero.checkpoint.store.tuning import DEFAULT_TUNING, CheckpointTuning

if TYPE_CHECKING:  # the local tier's save, built by the plugin (tiered/ sits below the verbs)
    from lightning_zero.checkpoint.tiered.tiers import TierSave

log = logging.getLogger(__name__)


# ---- public functional API ----------------------------------------------------------------


def async_save(state_dict: dict[str, Any], checkpoint_id: str, *, mode: Mode = "sharded",
               storage_options: dict[str, Any] | None = None, marker_fields: dict[str, Any] | None = None,
               process_group: Any = None, coordinator_rank: int | None = None,
               tuning: CheckpointTuning | None = None, tier: TierSave | None = None, plain: bool = False,
               live: bool = False) -> None:
    """Save ``state_dict`` (nested dicts of tensors, :class:`FlatShard` and plain objects) in the
    background. Returns once the work is queued; tensors must not change until
    :func:`wait_for_staging` returns (the strategy calls it before each optimizer update).

    ``marker_fields`` (rank 0's are used): small plain values copied into the commit marker, where
    readers of ordinary Lightning files look for them (see [Note: marker format] in storage.py).

    ``process_group`` (a gloo group; default: every rank) and ``coordinator_rank`` (a global rank in
    it; default: its lowest) as in SageMaker's API: only the group's ranks save, as a unit (e.g. one
    replica group), and the coordinator commits. ``local`` and ``sharded`` only: ``full`` gathers to
    rank 0 of the whole world. ``tuning``: the I/O knobs (:class:`CheckpointTuning`). ``plain`` (``full`` only): the
    file is ``state_dict`` exactly, as ``torch.save`` writes it, without this package's integrity header (a save
    without optimizer state: [Note: model-only saves] in lightning/lightning_tree.py). ``live``: the caller waits
    for this save to finish before it changes any tensor (:func:`save` does): CPU tensors are written as they are,
    not copied first ([Note: synchronous saves write the live state] in runtime/staging.py)."""
    called = time.perf_counter()
    checkpoint_mode = mode_named(mode)
    team = make_team(process_group, coordinator_rank)
    checkpoint_mode.check_save(team, plain)
    loc = storage.resolve(checkpoint_id, storage_options)
    tuning = tuning or DEFAULT_TUNING
    with process.gc_paused(tuning.pause_gc and tier is None):  # [Note: the collector and a save's objects]
        # A local rank file of many small CPU tensors: its layout, built here once ([Note: pack plans] in packed.py).
        layout = checkpointer().stager.plan(state_dict) if checkpoint_mode.plans_layout and tier is None else None
        # New containers, same leaves: the caller may rebuild or mutate its dicts once we return.
        snapshot = layout.skeleton if layout is not None else map_leaves(state_dict, lambda leaf: leaf)
        fields = dict(marker_fields or {})
        # The copy is ordered after the kernels that produced the state (a plan holds CPU tensors only).
        ready = ready_event(snapshot) if layout is None else None
        step = fields.get("global_step", state_dict.get("global_step"))  # a full-mode tree is Lightning's own dict
        stats = SaveStats(loc.url, checkpoint_mode.name, step=step if isinstance(step, int) else None)
        job = _SaveJob(snapshot, loc, checkpoint_mode, team, fields, tuning, ready, stats, called,
                       tier=tier, plain=plain, layout=layout, live=live and tier is None)
        try:
            checkpointer().submit(loc.url, job.run, stats)
        except CheckpointSaveError:
            raise  # the previous save's failure, raised once this job is queued: the job ends its pause
        except BaseException:
            job.resume_gc()  # not queued
            raise
    stats.blocked_s = time.perf_counter() - called


def save(state_dict: dict[str, Any], checkpoint_id: str, *, mode: Mode = "sharded",
         storage_options: dict[str, Any] | None = None, marker_fields: dict[str, Any] | None = None,
         process_group: Any = None, coordinator_rank: int | None = None,
         tuning: CheckpointTuning | None = None, plain: bool = False) -> None:
    """Synchronous save: :func:`async_save` then wait for the commit."""
    async_save(state_dict, checkpoint_id, mode=mode, storage_options=storage_options, marker_fields=marker_fields,
               process_group=process_group, coordinator_rank=coordinator_rank, tuning=tuning, plain=plain, live=True)
    maybe_finalize_async_calls(blocking=True)


def maybe_finalize_async_calls(blocking: bool = True, process_group: Any = None,
                               coordinator_rank: int | None = None) -> bool:
    """Finish the save in flight (``blocking``) or check on it; True when none is left.
    Raises :class:`CheckpointSaveError` if it failed.

    ``process_group``/``coordinator_rank`` are accepted as in SageMaker's API and validated; a rank's
    saves run one at a time in one worker, so this finishes the rank's save whichever group made it."""
    if process_group is not None or coordinator_rank is not None:
        make_team(process_group, coordinator_rank)
    return checkpointer().finalize(blocking)


def release() -> None:
    """(every rank, training thread, after the last save was finalized) End the saver's worker thread and
    the coordination group, so that a finished run leaves nothing of this package running and repeated
    fits in one process do not accumulate groups; the next save or load makes them again (collectively:
    every rank saves and loads together). [Note: process-wide checkpoint state]"""
    process.state().close()


def wait_for_staging() -> None:
    """Block until the save in flight has copied its tensors (call before mutating them)."""
    checkpointer().wait_for_staging()


def last_save_stats() -> SaveStats | None:
    """This rank's figures of its newest committed save (None before the first commit)."""
    return checkpointer().last_stats


def take_committed_stats() -> list[SaveStats]:
    """This rank's figures of the saves committed since the last call, oldest first (no collective)."""
    return checkpointer().take_committed()


def note_blocked(seconds: float) -> None:
    """(training thread) Record that the newest save call held the caller for ``seconds`` (a caller
    that does more than :func:`async_save`, as ``ZeroLowLevelStrategy.save_checkpoint`` does)."""
    checkpointer().note_blocked(seconds)


def link(checkpoint_id: str, link_id: str, storage_options: dict[str, Any] | None = None) -> None:
    """(one rank) Make ``link_id`` another name of checkpoint ``checkpoint_id``, after the save in
    flight has committed (``ModelCheckpoint(save_last="link")``)."""
    checkpointer().link_after_pending(storage.resolve(checkpoint_id, storage_options), storage.resolve(link_id, storage_options))


def remove_incomplete(directory: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """(one process, after the saves of this process finished) Delete the leftovers of saves that
    never committed in ``directory`` (a job killed mid-save): data versions no commit marker names and
    temporary files of interrupted writes; every committed checkpoint is kept. The next successful save
    of the same name does this for that name by itself; this is for names that are never saved again
    (``epoch=...`` files)."""
    maybe_finalize_async_calls(blocking=True)
    return cleanup.remove_incomplete(storage.resolve(directory, storage_options))


def remove(checkpoint_id: str, storage_options: dict[str, Any] | None = None) -> None:
    """(one rank) Delete a checkpoint, after the save in flight has committed."""
    checkpointer().remove_after_pending(storage.resolve(checkpoint_id, storage_options))


# ---- the background job -------------------------------------------------------------------


@dataclass
class _SaveJob:
    """One save on the background thread, in the phases every rank runs in the same order.

    [Note: same collectives on every rank] Whatever fails on one rank (staging out of memory, a
    read-only path, a write error), every rank makes the same collectives in the same order: a
    failure is recorded, not raised, until the next exchange, so the others never wait in a
    collective the failing rank skipped. Exchanges: (1) before any data is written (:meth:`agree`),
    (2) inside DCP / the ``full`` gathers, which fail on every rank together (:meth:`write`), (3) after
    writing (:meth:`write`), (4) the commit (:meth:`commit`)."""

    state: Any
    loc: Location
    mode: CheckpointMode
    team: Team
    marker_fields: dict[str, Any]
    tuning: CheckpointTuning
    ready: Any = None
    stats: SaveStats | None = None
    called: float | None = None
    error: str | None = None
    version_dir: str = ""
    save_id: str = ""
    signatures: list[Any] = field(default_factory=list)
    planned_bytes: int | None = None  # what the mode's write plan gave this rank (sharded: DCP's)
    tier: TierSave | None = None  # the local tier's phases run first ([Note: tier layout] in tiers.py)
    plain: bool = False  # full only: the file without the integrity header ([Note: model-only saves])
    layout: packed.PackPlan | None = None  # local only: staging fills it ([Note: pack plans] in packed.py)
    live: bool = False  # the caller waits for the save: no host copy of what it can write as it is
    resume_gc: Callable[[], None] = field(init=False)  # ends this job's collector pause, taken when it is made

    def __post_init__(self) -> None:
        # On the caller's thread, inside the pause of the hook that built the state: [Note: the collector and a
        # save's objects] below.
        self.resume_gc = process.pause_gc(self.tuning.pause_gc and self.tier is None)

    def run(self, staged: threading.Event) -> None:
        # [Note: the collector and a save's objects] A save makes thousands of objects for a tree of many small
        # tensors (the tree the front end builds, its layout or staged copy, DCP's plans, write results and
        # .metadata), alive until it ends. A collection set off while they live walks them and moves them into
        # the older generations, whose growth sets off full collections of the process's whole heap (hundreds of
        # ms under torch and Lightning) every few saves, on whichever thread allocates next: the training thread.
        # So the collector is paused, process-wide, from the save hook's first object to the job's end, once the
        # staged copy is dropped: the front end's hook (the strategy's ``save_checkpoint``, Fabric's ``save``)
        # pauses it while it builds the tree, the job takes its own pause when :func:`async_save` makes it on the
        # training thread, before the hook's ends, and ends it on its own thread. A tiered save pauses its durable phase only (the local tier keeps its staged copy between
        # saves, and its replication may wait long on peers). Meanwhile the training thread's cyclic garbage
        # waits for the next collection, which the gaps between saves give it; a job that hangs in a collective
        # holds the pause until the process group's timeout. ``CheckpointTuning.pause_gc`` turns it off.
        # [Note: no collections while planning] in dcp/adapter.py; [Note: no closure cycles on a save's path].
        try:
            self._run(staged)
        finally:
            self.resume_gc()

    def _run(self, staged: threading.Event) -> None:
        try:
            started = time.perf_counter()
            if self.tier is not None:
                self.tier.before_staging()
            self.stage(staged)
            staging_done = time.perf_counter()
            if self.tier is not None:
                self._run_tier(started, staging_done)
                return
            self.agree()
            write_started = time.perf_counter()
            self.write()
            written = time.perf_counter()
            self.commit()
            if self.stats is not None:
                committed = time.perf_counter()
                self.stats.staging_s = staging_done - started
                self.stats.write_s = written - write_started
                self.stats.commit_s = committed - written
                self.stats.committed_after_s = committed - (self.called if self.called is not None else started)
                self.stats.bytes_written = (self.planned_bytes if self.planned_bytes is not None
                                            else self.mode.bytes_written(self.state, self.team.rank))
        finally:
            # The staged copy goes before the caller learns the outcome: the worker keeps the job
            # referenced until after the future is resolved, and a save's host copy is a model's size.
            self.state = None

    def _run_tier(self, started: float, staging_done: float) -> None:
        """The local tier's phases, then (``tier.persist``) the durable ones, on the same staged copy. A
        durable write that fails is reported (once, by rank 0) and the save stays committed on the local tier."""
        tier, stats = self.tier, self.stats
        origin = self.called if self.called is not None else started
        if stats is not None:
            stats.staging_s = staging_done - started
        tier.run_local(self.state, self.team, self.error, self.tuning)
        if stats is not None:
            stats.local_committed_after_s = tier.committed_at - origin
            stats.tier = "local"
        tier.replicate(self.team)
        if stats is not None:
            stats.replicated_after_s = tier.committed_at - origin
            stats.committed_after_s = stats.replicated_after_s
            stats.bytes_written = MODES["local"].bytes_written(self.state, self.team.rank)  # the tier's files
        if not tier.persist:
            tier.keep_unpersisted(self.state)
            return
        try:
            with process.gc_paused(self.tuning.pause_gc):  # [Note: the collector and a save's objects]
                self.agree()
                self.write()
                self.commit()
        except CheckpointSaveError as exc:
            if stats is not None:
                stats.durable_error = str(exc)
            tier.durable_failed(exc, self.team.rank, self.state)
            return
        if stats is not None:
            stats.durable_after_s = time.perf_counter() - origin
            stats.tier = "durable"
        tier.durable_committed()

    def stage(self, staged: threading.Event) -> None:
        """Copy the tensors off the live state (a ``live`` save: only those it cannot write as they are);
        ``staged`` lets the training thread's next update go."""
        try:
            if self.layout is not None:
                self.state, self.layout = checkpointer().stager.stage(self.layout), None  # it held the live tensors
                return
            state = self.mode.to_stage(self.state, self.team.rank)
            # Flat buffers where a local rank file packs them ([Note: packed rank files]); DCP (sharded) would
            # clone each view back into a storage of its own, and a full file is read by other tools.
            self.state = checkpointer().stager.stage(state, self.ready, flat=self.mode.stages_flat or self.tier is not None,
                                                     live=self.live)
        except Exception as exc:
            self.error = f"rank {self.team.rank}: staging the state failed ({type(exc).__name__}: {exc})"
        finally:
            staged.set()

    def agree(self) -> None:
        """(1) Rank 0 names the fresh version directory and the save id; every rank says whether it can
        go on (staged, and the destination writable) and, for a sharded save, what its tree is
        ([Note: cached save plans]). Raises on every rank before any data is written."""
        team = self.team
        if self.error is None:
            self.error = file_io.preflight(self.loc, self.mode.write_directory(self.loc, team.rank), team.rank)
        proposal = ((self.loc.new_version_dir() if self.mode.commits_with_marker else "", uuid.uuid4().hex)
                    if team.is_coordinator else None)
        signature = self.mode.plan_signature(self.state) if self.error is None else None
        gathered = all_gather_objects((proposal, self.error, signature), team.group)
        self.version_dir, self.save_id = gathered[team.coordinator][0]
        self.signatures = [sig for _, _, sig in gathered]
        errors = [e for _, e, _ in gathered if e]
        if errors:
            raise CheckpointSaveError(f"Saving checkpoint {self.loc.url!r} failed before any data was written; the"
                                      " previous checkpoint is intact. " + "; ".join(errors))

    def write(self) -> None:
        """(2) This rank's files in the mode's way, then (3) every rank learns whether all succeeded; a
        failed save's partial version is removed (not where the store stopped answering: nothing
        points at it, and the next successful save of this name deletes it with the stale versions)."""
        loc, team = self.loc, self.team
        try:
            self.planned_bytes = self.mode.write(self.state, SaveTarget(
                loc, self.version_dir, team, self.save_id, self.signatures, self.tuning, header=not self.plain))
        except Exception as exc:  # reported to every rank below, raised at the next finalize
            self.error = f"rank {team.rank}: {storage.storage_error(loc, 'write', exc) if isinstance(exc, OSError) else exc!r}"
        errors = [e for e in all_gather_objects(self.error, team.group) if e]
        if errors:
            if team.is_coordinator and self.version_dir and not storage.keeps_partial_writes(loc, errors):
                file_io.discard(loc, self.version_dir)
            raise CheckpointSaveError(
                f"Saving checkpoint {loc.url!r} failed; the previous checkpoint is intact. " + "; ".join(errors)
            )

    def commit(self) -> None:
        """(4) The coordinator writes the commit marker (``local``/``sharded``; a ``full`` file is its own
        commit) and deletes older data versions; every rank learns whether the commit happened."""
        if not self.mode.commits_with_marker:
            return
        loc, team = self.loc, self.team
        commit_error: str | None = None
        if team.is_coordinator:
            try:
                # The data directory relative to the marker's folder: a copy of the marker beside it (a
                # `save_last="link"` on S3) names the same data.
                data = self.version_dir[len(loc.parent) + 1:] if loc.parent else self.version_dir
                fields = {"mode": self.mode.name, "world_size": team.world_size, "data": data, "save_id": self.save_id}
                shard_group_size = (self.state.shard_group_size or team.world_size
                                    if isinstance(self.state, packed.FilledPlan)
                                    else shard_group_size_of(self.state, team.world_size))
                if shard_group_size != team.world_size:
                    fields["shard_group_size"] = shard_group_size
                storage.write_marker(loc, fields, self.marker_fields)
            except Exception as exc:
                commit_error = f"writing the commit marker failed: {exc}"
                file_io.discard(loc, self.version_dir)
            else:
                try:
                    cleanup.remove_stale_versions(loc, keep=self.version_dir)
                except Exception as exc:  # committed already; leftovers only cost space
                    log.warning("Could not delete old data versions of %s: %s", loc.url, exc)
        commit_error = all_gather_objects(commit_error, team.group)[team.coordinator]
        if commit_error:
            raise CheckpointSaveError(
                f"Saving checkpoint {loc.url!r} failed; the previous checkpoint is intact: {commit_error}")

