"""The async scheduler: one worker thread per process runs saves, removals and links in the order
they were queued; the training thread queues, waits for staging and finalizes.

A save's error is raised on the training thread at the next finalize (the next save, a load,
teardown), once. Removals and links queued behind a save run only if it committed. The staging
copies are made here too (:class:`~lightning_zero.checkpoint.staging.Stager`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_zero.checkpoint import storage
from lightning_zero.checkpoint.staging import Stager
from lightning_zero.checkpoint.stats import SaveStats
from lightning_zero.checkpoint.storage import Location

log = logging.getLogger(__name__)


class CheckpointSaveError(RuntimeError):
    """A background save failed; the previous checkpoint is untouched."""


@dataclass
class PendingSave:
    url: str
    future: Future
    staged: threading.Event
    started: float = field(default_factory=time.perf_counter)
    stats: SaveStats | None = None


class AsyncCheckpointer:
    """The worker thread, the save in flight, the removals queued behind it, the figures of committed
    saves and the staging buffers of this process."""

    def __init__(self) -> None:
        self.stager = Stager()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: PendingSave | None = None
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

    def submit(self, url: str, job: Callable[[threading.Event], Any], stats: SaveStats | None = None) -> PendingSave:
        """Queue ``job`` after the save in flight. A failure of that one is raised (once) only after
        the new save is queued: one failed save must not cost the next checkpoint too."""
        previous_error: CheckpointSaveError | None = None
        try:
            self.finalize(blocking=True)
        except CheckpointSaveError as exc:
            previous_error = exc
        staged = threading.Event()
        self._pending = PendingSave(url, self.executor().submit(job, staged), staged, stats=stats)
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


_CHECKPOINTER = AsyncCheckpointer()


def checkpointer() -> AsyncCheckpointer:
    """This process's scheduler (one worker thread: saves of every plugin and of the functional API
    run one at a time, in order)."""
    return _CHECKPOINTER


def replace_after_fork() -> AsyncCheckpointer:
    """[Note: fork] A fresh scheduler for a forked child; the parent's is returned (to be kept
    referenced: its thread does not exist in the child)."""
    global _CHECKPOINTER
    inherited, _CHECKPOINTER = _CHECKPOINTER, AsyncCheckpointer()
    return inherited
