"""Tiered checkpoints: every save goes to node-local storage in ``local`` form and is replicated to other
nodes; every ``persist_every``-th save (and the last one of a fit) also goes to the durable path in the
plugin's mode, from the same staged copy.

[Note: tier layout] The local tier of a node is a directory (``LocalTier.path`` with ``{node_rank}`` and
``{local_rank}`` filled in) laid out as any ``local`` checkpoint's folder: a commit marker per checkpoint,
named after the ModelCheckpoint file (``<root>/last.ckpt``), and the data in ``<root>/_zero_data/<name>/
<version>/rank*-of-*.pt`` (storage.py's [Note: checkpoint layout]). A node's version directory holds the
files of the ranks on that node and the replicas it received from other nodes. The marker has one more
field, ``tier``: the ranks whose files that node holds (``ranks``), the global step, a save sequence and
whether the replicas are in. It is written twice per save, by one rank per directory: after the node's own
files are complete ("locally committed") and again, listing the replicas too, once every replica has
arrived ("replicated"). A file a marker does not list is never read, so a save killed midway leaves the
previous checkpoint of the tier as it was, and a partial replica unused.

Call order of one tiered save (every rank, the save's worker thread, before the durable phases of
``saver._SaveJob``): :meth:`TierSave.run_local` (exchange: version and places; replication starts on its
own threads ([Note: replication ring], [Note: streamed replication] in replication.py); write; exchange:
errors; marker), :meth:`TierSave.replicate` (wait for the replication; exchange: errors and what arrived;
marker; retention).
"""

from __future__ import annotations

import os
import socket
import string
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_zero.checkpoint.formats.tree import shard_group_size_of
from lightning_zero.checkpoint.modes import local
from lightning_zero.checkpoint.runtime.scheduler import CheckpointSaveError
from lightning_zero.checkpoint.runtime.team import all_gather_objects
from lightning_zero.checkpoint.store import cleanup, file_io, storage
from lightning_zero.checkpoint.store.storage import Location
from lightning_zero.checkpoint.tiered import replication
from lightning_zero.checkpoint.tiered import spares as tier_spares

TIER_KEY = "tier"
"""The marker field of a local-tier checkpoint (see [Note: tier layout])."""

_FIELDS = {"node_rank", "local_rank"}


@dataclass(frozen=True)
class LocalTier:
    """Node-local storage for every save of a :class:`~lightning_zero.ZeroCheckpointIO`.

    Args:
        path: a directory on the node's own disk or in host memory (``/dev/shm/...``, which outlives the
            process but not the node); ``{node_rank}`` and ``{local_rank}`` are filled in, so one path
            serves every node (and separate directories for nodes sharing a machine).
        replicas: how many other nodes receive a copy of each rank's files (a ring over nodes); 1 keeps
            every committed checkpoint through the loss of any one node's local storage. Capped at the
            number of other nodes.
        keep: local checkpoints kept per node (the newest complete one is never removed before a newer
            one commits).
    """

    path: str
    replicas: int = 1
    keep: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"LocalTier(path={self.path!r}): give a directory on node-local storage.")
        if not storage.resolve(self.path).store.machine_files:
            raise ValueError(f"LocalTier(path={self.path!r}) must be a node-local directory, not a URL: the durable"
                             " tier is the ModelCheckpoint path (which may be s3://).")
        names = {name for _, name, _, _ in string.Formatter().parse(self.path) if name is not None}
        if not names <= _FIELDS:
            raise ValueError(f"LocalTier(path={self.path!r}) names {sorted(names - _FIELDS)}; only {{node_rank}} and"
                             " {local_rank} are filled in.")
        if not isinstance(self.replicas, int) or self.replicas < 0:
            raise ValueError(f"LocalTier(replicas={self.replicas!r}) must be an int >= 0 (0: no copies on other nodes).")
        if not isinstance(self.keep, int) or self.keep < 1:
            raise ValueError(f"LocalTier(keep={self.keep!r}) must be an int >= 1.")

    def root(self, node_rank: int, local_rank: int) -> str:
        """This node's (and rank's) directory of the tier."""
        return os.path.abspath(self.path.format(node_rank=node_rank, local_rank=local_rank))


@dataclass
class Unpersisted:
    """The newest save that reached only the local tier: its staged copy, kept until the next save stages
    (then dropped: the durable tier gets that one or a later one), so that the end of a fit can persist it."""

    state: Any
    url: str
    marker_fields: dict[str, Any]


class TierRuntime:
    """What a plugin's tiered saves share across saves: the save count, the newest durable checkpoint, the
    durable removals deferred until a newer one commits, and the newest save not yet persisted.

    Threads: ``saves``, the step counted and ``newest_submitted`` are the training thread's alone (written
    and read there). ``deferred`` and ``unpersisted`` are written on both threads (the plugin on the
    training thread; ``TierSave`` on the worker, as a save stages, fails to persist or commits), so they are
    read and written only through the methods below, under ``_lock``; a removal itself runs outside it."""

    def __init__(self, persist_every: int) -> None:
        self.persist_every = persist_every
        self.saves = 0
        self._counted_step: int | None = None
        self._persists = False
        self.newest_submitted: tuple[str, bool] | None = None  # (durable path, persisted) of the newest save
        self._lock = threading.Lock()
        self._deferred: list[str] = []  # rank 0: durable paths to remove once a newer one commits
        self._unpersisted: Unpersisted | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with the plugin for spawned ranks: the lock is made anew there."""
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def persisted(self, url: str) -> bool:
        """Whether the newest save was to ``url`` and goes to the durable path (``save_last="link"``)."""
        return self.newest_submitted is not None and self.newest_submitted == (url, True)

    def next_persists(self, step: int | None = None) -> bool:
        """(training thread, every rank alike) Count a save; whether it goes to the durable tier too. The saves
        of one global step (``ModelCheckpoint``'s file and ``last.ckpt`` with ``save_last=True``) count once
        and share the answer, so ``persist_every`` counts checkpointed steps."""
        if step is not None and step == self._counted_step:
            return self._persists
        self._counted_step = step
        self.saves += 1
        self._persists = self.saves % self.persist_every == 0
        return self._persists

    def defer_removal(self, url: str) -> None:
        """(training thread) Remove durable ``url`` once a newer checkpoint commits on the durable path."""
        with self._lock:
            self._deferred.append(url)

    def cancel_removal(self, url: str) -> None:
        """(training thread) ``url`` is saved again: its deferred removal would delete the new one."""
        with self._lock:
            if url in self._deferred:
                self._deferred.remove(url)

    def deferred(self) -> list[str]:
        """The removals waiting (a copy)."""
        with self._lock:
            return list(self._deferred)

    def set_unpersisted(self, kept: Unpersisted | None) -> None:
        """(worker thread) The newest save reached the local tier only (None: it superseded the one kept)."""
        with self._lock:
            self._unpersisted = kept

    def take_unpersisted(self) -> Unpersisted | None:
        """(training thread) The kept save, now the caller's to persist; none is kept after."""
        with self._lock:
            kept, self._unpersisted = self._unpersisted, None
        return kept

    def durable_committed(self, url: str, remove: Callable[[str], None]) -> None:
        """A checkpoint committed on the durable path: nothing older waits to be persisted, and the durable
        removals deferred until then go now (``remove``; only rank 0 has any: Lightning removes on rank 0)."""
        with self._lock:
            self._unpersisted = None
            pending, self._deferred = self._deferred, []
        for old in pending:
            if old.rstrip("/") != url.rstrip("/"):  # one saved again since is the newest now
                remove(old)


@dataclass
class TierSave:
    """The local-tier part of one save, run by ``saver._SaveJob`` on the worker thread."""

    tier: LocalTier
    root: str
    name: str  # the ModelCheckpoint file's base name
    durable_url: str
    persist: bool
    node_rank: int
    local_rank: int
    step: int | None = None
    marker_fields: dict[str, Any] = field(default_factory=dict)
    loc: Location | None = None
    version_dir: str = ""
    save_id: str = ""
    seq: float = 0.0
    places: list[tuple[str, str, int, int]] = field(default_factory=list)
    shard_group_size: int = 0
    runtime: TierRuntime | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    _replicating: replication.Replicating | None = None
    committed_at: float = 0.0  # perf_counter when the newest phase committed (its marker written)

    def before_staging(self) -> None:
        """(worker thread, before this save stages) The previous save's kept copy is superseded."""
        if self.runtime is not None:
            self.runtime.set_unpersisted(None)

    def keep_unpersisted(self, state: Any) -> None:
        if self.runtime is not None:
            self.runtime.set_unpersisted(Unpersisted(state, self.durable_url, self.marker_fields))

    def durable_failed(self, error: BaseException, rank: int, state: Any) -> None:
        """The durable write failed (every rank alike): the save stays committed on the local tier; reported
        once, by rank 0; the next persistence (or the end of the fit) writes a newer one."""
        self.keep_unpersisted(state)
        if rank == 0:
            rank_zero_warn(f"Persisting checkpoint {self.durable_url!r} to the durable tier failed; it is committed on"
                           " the local tier (and replicated), and training goes on. The next persisted save (every"
                           f" {self.runtime.persist_every if self.runtime else 1} saves, and the last one of fit)"
                           f" tries again. Cause: {error}")

    def durable_committed(self) -> None:
        """The durable write committed: see :meth:`TierRuntime.durable_committed`."""
        if self.runtime is not None:
            self.runtime.durable_committed(self.durable_url, self._remove_durable)

    def _remove_durable(self, url: str) -> None:
        try:
            cleanup.remove(storage.resolve(url, self.storage_options))
        except Exception as exc:  # a leftover costs space only
            rank_zero_warn(f"Could not remove old checkpoint {url!r}: {exc}. Delete it by hand.")

    def run_local(self, state: Any, team: Any, error: str | None, tuning: Any) -> None:
        """(every rank) Write this rank's ``local`` file into its node's tier and commit the node's own
        files. Raises :class:`CheckpointSaveError` on every rank if any rank failed."""
        self.loc = storage.resolve(os.path.join(self.root, self.name))
        place = (socket.gethostname(), self.root, self.node_rank, self.local_rank)
        proposal = (uuid.uuid4().hex[:12], uuid.uuid4().hex, time.time()) if team.is_coordinator else None
        gathered = all_gather_objects((proposal, place, error), team.group)
        version, self.save_id, self.seq = gathered[team.coordinator][0]
        self.places = [g[1] for g in gathered]
        errors = [g[2] for g in gathered if g[2]]
        if errors:
            raise CheckpointSaveError(f"Saving checkpoint {self.durable_url!r} to the local tier failed before any"
                                      " data was written; the previous checkpoints are intact. " + "; ".join(errors))
        self.version_dir = self.loc.join(self.loc.data_root(), version)
        self.shard_group_size = shard_group_size_of(state, team.world_size) if state is not None else team.world_size
        own = local.rank_file(self.version_dir, team.rank, team.world_size)
        tail = replication.Tail(own)
        self._replicating = self._start_replication(team, tail)  # on every rank that got here, whatever follows
        failure = None
        try:
            os.makedirs(self.version_dir, exist_ok=True)
            local.write_local(state, self.loc, self.version_dir, team.rank, team.world_size, self.save_id, tuning,
                              progress=tail.advance if self._replicating is not None else None,
                              recycle=self._claim_spare)
            tail.finish(os.path.getsize(own))
        except Exception as exc:
            tail.fail()
            failure = f"rank {team.rank}: {storage.storage_error(self.loc, 'write', exc) if isinstance(exc, OSError) else exc!r}"
        try:
            self._commit_or_raise(team, failure, replicated=False)
        except BaseException:
            with suppress(Exception):  # its threads end: every sender sent its file or said it failed
                self._finish_replication()
            raise

    def _start_replication(self, team: Any, tail: replication.Tail) -> replication.Replicating | None:
        """Start sending this rank's file to its ring peers, and receiving theirs, while it is written
        ([Note: streamed replication] in replication.py); None when there is no other node."""
        replicas = min(self.tier.replicas, len({p[2] for p in self.places}) - 1)
        if replicas <= 0:
            return None
        sends, receives = replication.ring_peers(self.places, team.rank, replicas)
        return replication.Replicating(tail, sends, receives, team.group,
                                       lambda source: local.rank_file(self.version_dir, source, team.world_size),
                                       recycle=self._claim_spare)

    def _claim_spare(self, path: str) -> bool:
        return tier_spares.claim(self.root, path)

    def _finish_replication(self) -> list[int]:
        replicating, self._replicating = self._replicating, None
        return replicating.join() if replicating is not None else []

    def replicate(self, team: Any) -> list[int]:
        """(every rank) Wait for this rank's replication (started with the write) and commit the replicas
        each node received; then apply the node's retention. Returns the ranks whose files this rank received."""
        assert self.loc is not None
        received: list[int] = []
        failure = None
        try:
            received = self._finish_replication()
        except Exception as exc:
            failure = f"rank {team.rank}: replicating to the other nodes failed ({type(exc).__name__}: {exc})"
        self._commit_or_raise(team, failure, replicated=True, received=received)
        return received

    def _commit_or_raise(self, team: Any, failure: str | None, replicated: bool,
                         received: list[int] | None = None) -> None:
        """Every rank learns whether every rank succeeded; then one rank per tier directory writes its marker."""
        assert self.loc is not None
        gathered = all_gather_objects((failure, received or []), team.group)
        errors = [g[0] for g in gathered if g[0]]
        stage = "replicating to other nodes" if replicated else "writing to the local tier"
        if errors:
            if not replicated:
                with suppress(Exception):  # no replica is still being written into what is discarded
                    self._finish_replication()
                if self._writes_marker(team.rank):
                    file_io.discard(self.loc, self.version_dir)
            raise CheckpointSaveError(f"Saving checkpoint {self.durable_url!r}: {stage} failed; the previous"
                                      " checkpoints of the tier are intact. " + "; ".join(errors))
        if not self._writes_marker(team.rank):
            self.committed_at = time.perf_counter()
            return
        here = [r for r, p in enumerate(self.places) if p[:2] == self.places[team.rank][:2]]
        ranks = sorted(set(here) | {src for r in here for src in gathered[r][1]})
        fields = {"mode": "local", "world_size": team.world_size, "data": self.version_dir[len(self.loc.parent) + 1:],
                  "save_id": self.save_id,
                  TIER_KEY: {"ranks": ranks, "step": self.step, "seq": self.seq, "replicated": replicated,
                             "durable": self.durable_url}}
        if self.shard_group_size != team.world_size:  # hybrid: as a durable `local` marker says it
            fields["shard_group_size"] = self.shard_group_size
        storage.write_marker(self.loc, fields, self.marker_fields)
        self.committed_at = time.perf_counter()  # retention is no part of committing
        if replicated:
            limit = len(ranks)  # what one save writes into this directory ([Note: spare tier files])
            cleanup.remove_stale_versions(self.loc, keep=self.version_dir,
                                          discard=lambda tree: tier_spares.retire(tree, self.root, limit))
            apply_retention(self.root, self.tier.keep, limit)

    def _writes_marker(self, rank: int) -> bool:
        """The lowest rank of those sharing this rank's tier directory (same machine, same path)."""
        mine = self.places[rank][:2]
        return min(r for r, p in enumerate(self.places) if p[:2] == mine) == rank


def tier_markers(root: str) -> list[tuple[str, dict[str, Any]]]:
    """The committed local-tier checkpoints of a directory: (marker path, marker), newest first."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        path = os.path.join(root, name)
        if ".tmp-" in name or not os.path.isfile(path):
            continue
        try:
            marker = storage.read_marker(storage.resolve(path))
        except Exception:  # damaged or not ours: never a candidate, never removed here
            continue
        if marker is not None and isinstance(marker.get(TIER_KEY), dict):
            found.append((path, marker))
    found.sort(key=lambda item: order_key(item[1]), reverse=True)
    return found


def order_key(marker: dict[str, Any]) -> tuple[int, float]:
    """Newer first: the global step, then the save sequence (the coordinator's clock at the save)."""
    tier = marker[TIER_KEY]
    return (tier.get("step") if isinstance(tier.get("step"), int) else -1, float(tier.get("seq", 0.0)))


def apply_retention(root: str, keep: int, spares: int = 0) -> list[str]:
    """Remove all but the ``keep`` newest committed checkpoints of a tier directory (called right after a
    newer one committed, so the newest complete one is always among those kept), the marker first; up to
    ``spares`` of their files stay as the tier's spares ([Note: spare tier files]). Returns what was removed."""
    removed = []
    for path, _ in tier_markers(root)[keep:]:
        cleanup.remove(storage.resolve(path), discard=lambda tree: tier_spares.retire(tree, root, spares))
        removed.append(path)
    return removed
