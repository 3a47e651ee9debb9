"""The async scheduler: one worker thread per process runs saves, removals and links in the order
they were queued; the training thread queues, waits for staging and finalizes. The thread lives only
while there is work queued ([Note: a worker that ends with its work]).

A save's error is raised on the training thread at the next finalize (the next save, a load,
teardown), once. Removals and links queued behind a save run only if it committed. The staging
copies are made here too (:class:`~lightning_zero.checkpoint.runtime.staging.Stager`).
"""

from __future__ import annotations

import atexit
import collections
import logging
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_zero.checkpoint.runtime import process
from lightning_zero.checkpoint.runtime.staging import Stager
from lightning_zero.checkpoint.runtime.stats import SaveStats
from lightning_zero.checkpoint.store import cleanup
from lightning_zero.checkpoint.store.storage import Location

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


class SerialWorker:
    """Runs submitted calls one at a time, in submission order, on a thread that exists only while
    calls are queued.

    [Note: a worker that ends with its work]
    A thread kept for the life of the process outlives the work that needed it: Lightning's spawn
    launcher removes the workers' weights file from the launching process through the checkpoint IO
    (a removal, queued here), and ``trainer.save_checkpoint`` after ``fit`` saves with no teardown
    to follow; a pool's idle thread stayed alive in both, which Lightning's own test suite fails as
    a zombie. Here the thread leaves once the queue is empty (it clears ``_thread`` under the lock,
    so a call submitted after that starts a new one: none is stranded), and :meth:`join_idle` waits
    for a leaving thread, so that a blocking finalize returns with no thread of ours left. One
    thread per burst of work costs one thread start per save (tens of microseconds)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple[Future, Callable[..., Any], tuple[Any, ...]]] = collections.deque()
        self._thread: threading.Thread | None = None
        self._leaving: threading.Thread | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            self._queue.append((future, fn, args))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{self._name}_0", daemon=True)
                self._thread.start()
        return future

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._leaving, self._thread = self._thread, None
                    return
                future, fn, args = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # delivered to whoever waits on the future
                future.set_exception(exc)
            else:
                future.set_result(result)
            del future, fn, args  # nothing of a finished call stays referenced by an idle loop

    def join_idle(self) -> None:
        """(the submitting thread) If nothing is queued, wait until the thread that ran the last call has left."""
        with self._lock:
            if self._queue:
                return
            leaving = self._thread or self._leaving
        if leaving is not None and leaving is not threading.current_thread():
            leaving.join()

    def alive(self) -> bool:
        with self._lock:
            return self._thread is not None


class AsyncCheckpointer:
    """The worker thread, the save in flight, the removals queued behind it, the figures of committed
    saves and the staging buffers of this process."""

    def __init__(self) -> None:
        self.stager = Stager()
        self._worker = SerialWorker("lightning_zero_ckpt")
        self._pending: PendingSave | None = None
        self._removals: list[tuple[Location, Future]] = []
        # Figures of committed saves, appended by the worker thread, drained by the training thread
        # (bounded: the functional API may never drain them).
        self._stats_lock = threading.Lock()
        self._committed: collections.deque[SaveStats] = collections.deque(maxlen=1024)
        self.last_stats: SaveStats | None = None
        self._submitted_stats: SaveStats | None = None

    def close(self) -> None:
        """(training thread, after the last save was finalized) End what this scheduler started: wait for what
        the worker was given and for its thread to end, and drop the staging buffers (pinned host memory on
        GPUs) and streams. The figures of committed saves stay; the next save starts a thread again."""
        self._reap_removals(blocking=True)
        self._worker.join_idle()
        self.stager = Stager()

    def executor(self) -> SerialWorker:
        """The one worker: saves and removals run in submission order."""
        return self._worker

    def submit(self, url: str, job: Callable[[threading.Event], Any], stats: SaveStats | None = None) -> PendingSave:
        """Queue ``job`` after the save in flight. A failure of that one is raised (once) only after
        the new save is queued: one failed save must not cost the next checkpoint too."""
        previous_error: CheckpointSaveError | None = None
        try:
            self.finalize(blocking=True)
        except CheckpointSaveError as exc:
            previous_error = exc
        staged = threading.Event()
        _finish_at_exit.register()
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
        if pending is not None:
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
        if self._removals:
            return False
        if blocking:
            self._worker.join_idle()  # nothing is queued: the thread is leaving ([Note: a worker that ends with its work])
        return True

    def remove_after_pending(self, loc: Location) -> None:
        """Remove ``loc`` once the save in flight has committed (never before; not if it fails). With no save in
        flight and nothing queued, now, on the caller's thread: no thread is started for a removal alone
        ([Note: a worker that ends with its work])."""
        pending = self._pending
        after = pending.future if pending is not None else None
        if after is None and not self._removals and not self._worker.alive():
            try:
                cleanup.remove(loc)
            except Exception as exc:  # the checkpoint it meant to delete is still a valid one
                rank_zero_warn(f"Could not remove old checkpoint {loc.url!r}: {exc}. Delete it by hand.")
            return

        def job() -> None:
            if after is not None and after.exception() is not None:
                log.warning("Keeping %s: the newer checkpoint failed to save.", loc.url)
                return
            cleanup.remove(loc)

        self._removals.append((loc, self.executor().submit(job)))

    def link_after_pending(self, target: Location, link: Location) -> None:
        """Make ``link`` name the checkpoint ``target`` once the save in flight has committed."""
        pending = self._pending
        after = pending.future if pending is not None else None

        def job() -> None:
            if after is not None and after.exception() is not None:
                log.warning("Not linking %s: %s failed to save.", link.url, target.url)
                return
            cleanup.link(target, link)

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


class _FinishAtExit:
    """[Note: a save in flight at exit] A program may end right after its last save: litgpt's pre-training
    script calls ``fabric.save(".../final/lit_model.pth", state)`` and returns, and Fabric has no teardown
    of its own. The worker is a daemon thread (a hung store must not keep a crashed job alive), so the
    interpreter would stop it mid-write, or abort inside a collective, and the last checkpoint would be
    lost. At exit the save in flight, and the removals queued behind it, are finished first, on every rank
    (each finishes its own part, so a save whose job exchanges over the coordination group completes). The
    handler is registered at the first save, after the handlers of torch and Lightning that their imports
    registered: ``atexit`` runs the newest first, so it runs while the process group is still there. A
    save that fails here is reported on stderr; the previous checkpoint is untouched, as after any failed
    save. The Trainer's teardown, and Fabric's ``strategy.teardown()``, have already finished the save, so
    it finds nothing to do."""

    def __init__(self) -> None:
        self._registered = False

    def register(self) -> None:
        if not self._registered:
            self._registered = True
            atexit.register(self)

    def __call__(self) -> None:
        try:
            checkpointer().finalize(blocking=True)
        except Exception as exc:
            sys.stderr.write(f"lightning_zero: the checkpoint save in flight at exit failed: {exc}\n")


_finish_at_exit = _FinishAtExit()


def checkpointer() -> AsyncCheckpointer:
    """This process's scheduler (one worker thread: saves of every plugin and of the functional API
    run one at a time, in order), kept in :func:`~lightning_zero.checkpoint.runtime.process.state`."""
    current = process.state()
    if current.checkpointer is None:
        with current.lock:
            if current.checkpointer is None:
                current.checkpointer = AsyncCheckpointer()
    return current.checkpointer
