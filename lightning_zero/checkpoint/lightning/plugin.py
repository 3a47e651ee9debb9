"""ZeroCheckpointIO: the Lightning CheckpointIO plugin over the async saver, and its :class:`StrategyLink`, the
part only the front ends call (the staging fence, the coordination group, where this rank is, the names of
saves in flight, the local tier's choice for ``ckpt_path="last"`` and a recovery's timeline).

[Note: the plugin's two faces] The plugin's public methods are what a user calls (Lightning's ``CheckpointIO``
interface, ``finalize``, ``last_save_stats``, ``last_load``), and the API reference lists only those. What
ZeroLowLevelStrategy, its Fabric twin, Lightning's fixes, the resume and the metrics callback ask of the
plugin is on its :class:`StrategyLink` (:func:`link_of`), which also holds the state only they write. One
link per plugin, made with it, so that every front end sees the same placement and claims."""

from __future__ import annotations

import os
import time
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_zero import _compat
from lightning_zero.checkpoint import saver
from lightning_zero.checkpoint.modes import Mode, mode_named
from lightning_zero.checkpoint.runtime import process
from lightning_zero.checkpoint.runtime.scheduler import CheckpointSaveError, checkpointer
from lightning_zero.checkpoint.runtime.stats import SaveStats, TierLoad, process_started_at
from lightning_zero.checkpoint.runtime.team import set_up_coordination
from lightning_zero.checkpoint.store.tuning import DEFAULT_TUNING, CheckpointTuning
from lightning_zero.checkpoint.tiered import recovery as tier_recovery
from lightning_zero.checkpoint.tiered import spares as tier_spares
from lightning_zero.checkpoint.tiered.recovery import TierChoice
from lightning_zero.checkpoint.tiered.tiers import LocalTier, TierRuntime, TierSave
from lightning_zero.checkpoint.trainer_state import MARKER_FIELDS, PLAIN, TREE_TAG


class ZeroCheckpointIO(CheckpointIO):
    """Writes ZeroLowLevelStrategy checkpoints asynchronously to local paths, shared file systems or ``s3://``.

    Args:
        mode: ``"local"`` (each rank its own shard, no collectives on the training thread, loads
            at the same world size only), ``"sharded"`` (reshardable: loads at any world size) or
            ``"full"`` (one file on rank 0 that plain ``torch.load`` and
            ``LightningModule.load_from_checkpoint`` read).
        async_save: return from ``save_checkpoint`` once the save is queued; tensors are copied
            off the live state in the background, before the next optimizer step.
        storage_options: passed to the store's client (S3 endpoint, profile, credentials): fsspec/s3fs
            by default; ``{"client": "s3torchconnector", ...}`` writes ``s3://`` through AWS's s3torchconnector
            (``pip install "lightning-zero[s3torchconnector]"``; endpoint and region from ``endpoint_url`` and
            ``region`` or the ``AWS_*`` environment, credentials from the environment or ``profile``). Never
            written into a checkpoint or a log.
        tuning: the I/O knobs (writer and reader threads, page-cache writeback, fsync, the collector pause);
            the defaults of :class:`~lightning_zero.checkpoint.CheckpointTuning` when not given.
        local_tier: a :class:`~lightning_zero.checkpoint.LocalTier`: every save is written to node-local
            storage in ``local`` form and replicated to other nodes; only every ``persist_every``-th save
            (and the newest one at the end of fit) goes on to the ModelCheckpoint path in ``mode``, from
            the same staged copy. ``ckpt_path="last"`` then loads the newest complete checkpoint of either
            tier ([Note: tier layout] in checkpoint/tiered/tiers.py).
        persist_every: with ``local_tier``: how often a save also goes to the durable path (1: every save).
    """

    def __init__(self, mode: Mode = "sharded", async_save: bool = True,
                 storage_options: dict[str, Any] | None = None, tuning: CheckpointTuning | None = None,
                 local_tier: LocalTier | None = None, persist_every: int = 1) -> None:
        if local_tier is not None and not isinstance(local_tier, LocalTier):
            raise TypeError(f"local_tier must be a lightning_zero.checkpoint.LocalTier, got {type(local_tier).__name__}.")
        if not isinstance(persist_every, int) or persist_every < 1:
            raise ValueError(f"persist_every={persist_every!r} must be an int >= 1 (1: every save is persisted).")
        if persist_every != 1 and local_tier is None:
            raise ValueError(f"persist_every={persist_every} needs a local_tier: without one every save goes to the"
                             " checkpoint path. Pass local_tier=LocalTier(path=...) or drop persist_every.")
        checkpoint_mode = mode_named(mode)  # a ValueError naming the modes for any other
        self.mode: Mode = mode
        if local_tier is not None and checkpoint_mode.gathers_to_rank0:
            raise ValueError("local_tier works with mode='sharded' or 'local' (the durable tier's mode): a 'full' save"
                             " gathers the state to rank 0, and the local tier keeps each rank's own shards. Use"
                             " mode='sharded' and `lightning-zero convert` for a full file.")
        self.local_tier = local_tier
        self.persist_every = persist_every
        self._tiers = TierRuntime(persist_every) if local_tier is not None else None
        self.last_load: TierLoad | None = None
        """How the newest resume through the local tier's choice (``ckpt_path="last"``) went: the tier read, the
        path, the seconds of each part; None without one."""
        self.async_save = async_save
        self.storage_options = dict(storage_options or {})
        self.tuning = tuning or DEFAULT_TUNING
        self._plain = TorchCheckpointIO()
        self._link = StrategyLink(self)  # [Note: the plugin's two faces]

    def __repr__(self) -> str:  # storage_options may hold credentials: not shown
        tier = f", local_tier={self.local_tier!r}, persist_every={self.persist_every}" if self.local_tier else ""
        return f"ZeroCheckpointIO(mode={self.mode!r}, async_save={self.async_save}{tier})"

    @property
    def last_save_stats(self) -> SaveStats | None:
        """This rank's figures (time blocked, staging, write, commit, bytes) of its newest committed save,
        None before the first commit. The same as :func:`lightning_zero.checkpoint.last_save_stats`."""
        return saver.last_save_stats()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """(every rank) ``checkpoint`` is the tree ZeroLowLevelStrategy built for this plugin's mode, or, for a
        save without optimizer state, the plain file DDP writes ([Note: model-only saves] in lightning_tree.py)."""
        options = {**self.storage_options, **(storage_options or {})}
        if checkpoint.get(TREE_TAG) == PLAIN:
            # Every rank takes part (the save's agreement runs on the coordination group); rank 0 writes. With a
            # local tier too the file goes to the path given: it is small, and any tool must find it there.
            self._link.claim(path)
            saver.async_save({k: v for k, v in checkpoint.items() if k != TREE_TAG}, os.fspath(path), mode="full",
                             storage_options=options, tuning=self.tuning, plain=True, live=not self.async_save)
            if not self.async_save:
                self.finalize()
            return
        if checkpoint.get(TREE_TAG) != self.mode:
            # Not a tree from ZeroLowLevelStrategy (e.g. the spawn launcher handing weights to the
            # main process): an ordinary synchronous single-file save by this rank.
            self._plain.save_checkpoint(checkpoint, path, storage_options=storage_options)
            self._link.claim(path)
            return
        self._link.claim(path)
        tree = {k: v for k, v in checkpoint.items() if k != MARKER_FIELDS}
        fields = checkpoint.get(MARKER_FIELDS) or {}
        tier = None
        if self.local_tier is not None and self._tiers is not None:
            url = os.fspath(path)
            self._tiers.cancel_removal(url)
            step = fields.get("global_step") if isinstance(fields.get("global_step"), int) else None
            link = self._link
            tier = TierSave(tier=self.local_tier, root=self.local_tier.root(link.node_rank, link.local_rank),
                            name=os.path.basename(url.rstrip("/")), durable_url=url,
                            persist=self._tiers.next_persists(step), node_rank=link.node_rank,
                            local_rank=link.local_rank, step=step, marker_fields=dict(fields),
                            runtime=self._tiers, storage_options=options)
            self._tiers.newest_submitted = (url, tier.persist)
        saver.async_save(tree, os.fspath(path), mode=self.mode, storage_options=options,
                         marker_fields=fields, tuning=self.tuning, tier=tier, live=not self.async_save)
        if not self.async_save:
            self.finalize()

    @override
    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """A single-file checkpoint (``full`` mode, or any ordinary one). Sharded checkpoints are loaded
        by ZeroLowLevelStrategy itself (``trainer.fit(ckpt_path=...)``) or ``checkpoint.load``."""
        return _compat.plain_checkpoint_load(self._plain, path, map_location, weights_only)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """(one rank) Removal waits until the save in flight has committed, and is dropped if it fails. With a
        local tier, until a newer save has committed on the durable path (most saves never reach it)."""
        if self._tiers is not None:
            self._tiers.defer_removal(os.fspath(path))
            self._link.unclaim(path)
            return
        saver.remove(os.fspath(path), self.storage_options)
        self._link.unclaim(path)

    def finalize(self, blocking: bool = True) -> bool:
        """Finish the save in flight (``blocking``) or check on it; True when none is left. Raises
        :class:`~lightning_zero.checkpoint.CheckpointSaveError` if it failed."""
        return checkpointer().finalize(blocking)

    @override
    def teardown(self) -> None:
        """(every rank) Finish the save in flight; with a local tier, write the newest save that reached only
        the local tier to its durable path (so the durable tier ends with the run's last state) and delete
        the tier's spare files."""
        self._link.timeline_open = False  # a run that took no step after its resume (validate, max_steps reached)
        self.finalize()
        self._persist_newest()
        root = self._link.tier_root()
        if root is not None:  # [Note: spare tier files]
            tier_spares.clear(root)

    def _persist_newest(self) -> bool:
        """(every rank) The newest save that reached only the local tier, to its durable path. True if one was."""
        kept = self._tiers.take_unpersisted() if self._tiers is not None else None
        if kept is None:
            return False
        saver.async_save(kept.state, kept.url, mode=self.mode, storage_options=self.storage_options,
                         marker_fields=kept.marker_fields, tuning=self.tuning)
        try:
            self.finalize()
        except CheckpointSaveError as exc:
            rank_zero_warn(f"Persisting the newest checkpoint {kept.url!r} to the durable tier at the end of fit"
                           f" failed; it is committed on the local tier. Cause: {exc}")
            return False
        if self._tiers is not None:
            self._tiers.durable_committed(kept.url, lambda url: saver.remove(url, self.storage_options))
            self.finalize()
        return True


class StrategyLink:
    """What the front ends ask of one :class:`ZeroCheckpointIO`, and the state only they write ([Note: the
    plugin's two faces]). Callers: ZeroLowLevelStrategy and its Fabric twin (:meth:`set_up`,
    :meth:`building_a_save`, :meth:`wait_for_staging`, :meth:`note_blocked`, :meth:`count_claims_as_taken`, :meth:`release`), Lightning's fixes
    (:meth:`place`, :meth:`tier_root`, :meth:`offer_last`, :meth:`link`), the resume (:meth:`resolve_last`,
    :meth:`record_load`) and ``CheckpointMetrics`` (:meth:`record_first_step`)."""

    def __init__(self, io: ZeroCheckpointIO) -> None:
        self._io = io
        self.node_rank = 0
        self.local_rank = 0
        """Where this rank is: the local tier's directory and replication ring."""
        self._claimed: set[str] = set()
        """Paths the plugin has saved to (queued, in flight or committed) and not removed since."""
        self._last_candidates: list[str] | None = None
        """The durable ``last`` candidates Lightning's lookup found (:meth:`offer_last`), for :meth:`resolve_last`."""
        self.timeline_open = False
        """Training thread only: :meth:`record_load` opens it, the first step or teardown closes it."""

    def set_up(self, local_ranks: int | None = None, node_rank: int | None = None,
               local_rank: int | None = None) -> None:
        """(collective, every rank, training thread) Create the group background saves coordinate over,
        so that no save has to make a collective on the training thread. ``local_ranks``: the ranks on
        this node, which share its CPUs between their reader threads; ``node_rank``/``local_rank``: where
        this rank is (the local tier's directory and replication ring)."""
        set_up_coordination(local_ranks)
        self.place(node_rank, local_rank)

    def place(self, node_rank: int | None, local_rank: int | None) -> None:
        """This rank's node and local rank (the local tier's directory and ring); no collective."""
        if node_rank is not None:
            self.node_rank = node_rank
        if local_rank is not None:
            self.local_rank = local_rank

    def release(self) -> None:
        """(every rank, after the last save was finalized) End the worker thread, the staging buffers and the
        coordination group (the next save or load makes them again)."""
        saver.release()

    def building_a_save(self) -> AbstractContextManager[None]:
        """(training thread) While a front end's save hook builds the tree and queues it: the collector paused
        ([Note: the collector and a save's objects] in checkpoint/saver.py)."""
        return process.gc_paused(self._io.tuning.pause_gc)

    def wait_for_staging(self) -> None:
        """Block until the save in flight has copied its tensors: the optimizer's pre-update fence."""
        checkpointer().wait_for_staging()

    def note_blocked(self, seconds: float) -> None:
        """The caller's measure of the training thread's time in the newest save (tree building included)."""
        checkpointer().note_blocked(seconds)

    def claim(self, path: Any) -> None:
        self._claimed.add(_claim_key(path))

    def unclaim(self, path: Any) -> None:
        self._claimed.discard(_claim_key(path))

    def is_claimed(self, path: Any) -> bool:
        """Whether this process saved to ``path`` and has not removed it: a name that is taken although
        an async save has not committed there yet (Lightning's ``ModelCheckpoint`` asks whether a
        file exists to pick its ``-vN`` name; :meth:`count_claims_as_taken` makes it ask this too)."""
        return _claim_key(path) in self._claimed

    def count_claims_as_taken(self, callbacks: list[Any], own_names_only: bool = False) -> None:
        """(every rank, at setup) Make each ``ModelCheckpoint`` among ``callbacks`` count the names of saves not yet
        committed as taken (:class:`_ClaimAwareExists`; idempotent). ``own_names_only`` (rank 0 of a replica group
        of a fault-tolerant job, which answers for its group): files other groups write from now on do not count
        ([Note: names under fault tolerance])."""
        for callback in callbacks:
            if not isinstance(callback, ModelCheckpoint):
                continue
            exists = callback.__dict__.get("file_exists")
            if not isinstance(exists, _ClaimAwareExists):
                # Instance attribute: Lightning's method stays, the user's class is untouched.
                exists = callback.file_exists = _ClaimAwareExists(callback, self)  # type: ignore[method-assign]
            exists.existing = _names_in(callback) if own_names_only else None

    def link(self, path: Any, link_path: Any) -> None:
        """(one rank) Make ``link_path`` another name of the checkpoint at ``path`` once it has committed. With
        a local tier, only for a save that goes to the durable path (the link names a durable checkpoint)."""
        tiers = self._io._tiers
        if tiers is not None and not tiers.persisted(os.fspath(path)):
            return
        saver.link(os.fspath(path), os.fspath(link_path), self._io.storage_options)

    def tier_root(self) -> str | None:
        """This rank's directory of the local tier (None without one)."""
        tier = self._io.local_tier
        return tier.root(self.node_rank, self.local_rank) if tier is not None else None

    def offer_last(self, durable: set[str]) -> None:
        """(every rank) The durable checkpoints Lightning's ``ckpt_path="last"`` lookup found, kept for
        :meth:`resolve_last` (added to those of an earlier lookup)."""
        self._last_candidates = sorted(set(self._last_candidates or []) | durable)

    def resolve_last(self, shard_group_size: int | None = None) -> TierChoice | None:
        """(collective, every rank, when ``ckpt_path="last"`` was asked with a local tier) Which tier the
        resume reads: see :func:`~lightning_zero.checkpoint.tiered.recovery.resolve_last`. None otherwise.
        ``shard_group_size``: the resuming strategy's (None: the whole world)."""
        durable, self._last_candidates = self._last_candidates, None
        tier = self._io.local_tier
        if durable is None or tier is None:
            return None
        return tier_recovery.resolve_last(tier, self.tier_root() or "", durable, self._io.storage_options,
                                          shard_group_size)

    def record_load(self, choice: TierChoice, seconds: float) -> None:
        """(every rank) The figures of a resume through :meth:`resolve_last` (the plugin's ``last_load``),
        logged on rank 0; its timeline is completed by :meth:`record_first_step` ([Note: a recovery's
        timeline])."""
        load_s = max(seconds - choice.choose_s - choice.reshard_s, 0.0)
        now = time.time()
        began = now - seconds
        started = process_started_at()
        restart_s = startup_s = None
        if started is not None:
            # A process already running at the newest save (a resume in the same process) has no restart:
            # its startup is then counted from that save, so the parts still add up to the time since it.
            since = started if choice.last_saved_at is None else max(started, choice.last_saved_at)
            startup_s = max(began - since, 0.0)
            if choice.last_saved_at is not None:
                restart_s = max(started - choice.last_saved_at, 0.0)
        count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
        self.timeline_open = True
        self._io.last_load = TierLoad(choice.tier, choice.path, seconds, choice.reason, step=choice.step,
                                      choose_s=choice.choose_s, reshard_s=choice.reshard_s, load_s=load_s,
                                      steps_lost=choice.steps_lost, resharded_from=choice.resharded_from,
                                      moved=dict(choice.moved), restart_s=restart_s, startup_s=startup_s,
                                      restarts=int(count) if count.isdigit() else None, ended_at=now)
        making = ("" if choice.tier != "local" else
                  f"resharding from {choice.resharded_from} ranks {choice.reshard_s:.3f} s, " if choice.resharded_from
                  else f"fetching lost files {choice.reshard_s:.3f} s, ")
        rank_zero_info(f"Resumed from the {choice.tier} tier ({choice.path!r}) at step {choice.step} in"
                       f" {seconds:.3f} s (choosing {choice.choose_s:.3f} s, {making}loading {load_s:.3f} s;"
                       f" {choice.steps_lost} checkpointed step(s) lost); the whole recovery is logged after the"
                       " first step.")

    def record_first_step(self) -> TierLoad | None:
        """(every rank, after the first optimizer step that follows a resume through :meth:`resolve_last`)
        Complete ``last_load``'s timeline; returns it the first time, None after (or without a resume)."""
        load = self._io.last_load
        if load is None or not self.timeline_open:
            return None
        self.timeline_open = False
        self._io.last_load = replace(load, first_step_s=max(time.time() - load.ended_at, 0.0))
        return self._io.last_load


def link_of(io: ZeroCheckpointIO) -> StrategyLink:
    """The front ends' side of ``io`` ([Note: the plugin's two faces])."""
    return io._link


class _ClaimAwareExists:
    """``ModelCheckpoint.file_exists`` that also counts the names of async saves not yet committed.

    ModelCheckpoint picks a free ``-vN`` name by asking whether the file exists (rank 0, then an any-
    reduction). An async save's path exists only once it has committed, so the next save chose the same
    name again and replaced it: with ``save_top_k=-1`` ("keep all") checkpoints were lost
    (Lightning's ``test_ckpt_version_after_rerun_same_trainer``). A name counts as taken from the
    moment its save is queued. A class, not a closure: the Trainer pickles."""

    def __init__(self, callback: ModelCheckpoint, link: StrategyLink) -> None:
        self.callback = callback
        self.link = link
        self.existing: frozenset[str] | None = None  # with fault tolerance: the directory's names at setup

    def __call__(self, filepath: Any, trainer: Any) -> bool:
        taken = trainer.is_global_zero and (self.link.is_claimed(filepath) or self._on_disk(filepath))
        return trainer.strategy.reduce_boolean_decision(bool(taken), all=False)

    def _on_disk(self, filepath: Any) -> bool:  # fault tolerance: [Note: names under fault tolerance]
        key, existing = _claim_key(filepath), self.existing
        return (existing is not None and key in _state_names(self.callback)) or bool(
            (existing is None or os.path.basename(key) in existing) and self.callback._fs.exists(filepath))


# [Note: names under fault tolerance]
# ModelCheckpoint runs in every replica group and names each save (``last-v1.ckpt`` for a ``last.ckpt`` in use) by
# asking whether the file exists; one group writes, the others skip the save, and any group may become the writer,
# so each must name as the writer does. The disk is no shared answer: a group that joined by heal in the step the
# writer saved in got the callback's state from before that save, found the new ``last.ckpt`` on disk and named its
# own ``last-v1.ckpt``, which it wrote once it became the writer (``last.ckpt`` went stale). So a name is taken when
# this group claimed it (the saves it skipped too), when the callback's state names it (what a heal carries), or
# when it was in the directory at this group's setup and still is: every group names from the job's history.


def _names_in(callback: ModelCheckpoint) -> frozenset[str]:
    """The names of the files in ``callback``'s directory now (none where it does not exist yet)."""
    dirpath = callback.dirpath
    if not dirpath or not callback._fs.isdir(dirpath):
        return frozenset()
    return frozenset(os.path.basename(_claim_key(name)) for name in callback._fs.ls(dirpath, detail=False))


def _state_names(callback: ModelCheckpoint) -> set[str]:
    """The checkpoint names ``callback``'s state holds (kept across a heal, as is all of its state)."""
    return {_claim_key(name) for name in (callback.last_model_path, callback.best_model_path, *callback.best_k_models)
            if name}


def _claim_key(path: Any) -> str:
    return os.fspath(path).rstrip("/")
