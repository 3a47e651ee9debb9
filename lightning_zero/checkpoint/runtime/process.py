"""[Note: process-wide checkpoint state] What the checkpoint package keeps for the life of a process, in one
object (:class:`CheckpointProcess`) with one accessor (:func:`state`), one end (:meth:`CheckpointProcess.close`),
one fork rule and one :func:`reset`.

Owned here, and nowhere else:

* ``checkpointer``: the scheduler, its worker thread and the save in flight (made at first use by
  :func:`~lightning_zero.checkpoint.runtime.scheduler.checkpointer`);
* ``coordination_group`` and ``local_ranks``: the gloo group background saves and loads exchange over, and
  the ranks on this node (:mod:`~lightning_zero.checkpoint.runtime.team`);
* the garbage-collector pause of DCP's planning (:func:`gc_paused`, [Note: no collections while planning] in
  dcp/adapter.py).

Threads: ``checkpointer``, ``coordination_group`` and ``local_ranks`` are written on the training thread only
(the group is made and destroyed collectively, by every rank together); the worker thread reads them. The gc
pause is counted under its lock from any thread.

Lifetime: each part is made at its first use (a save, a load, the strategy's setup) and ended together by
:meth:`CheckpointProcess.close`, which the front ends call at teardown (``saver.release``), after the last save
was finalized: the worker thread has left, the staging buffers are dropped and the coordination group is
destroyed, so a finished run leaves nothing of the package running or pinned. What was measured stays
(``last_save_stats``), and the next save or load makes the rest again. Threads that live inside one save (the
readers of a load, the replication of a tier save) are started and joined by that save's job.

Not here, on purpose: DCP keeps its save-plan caches in class attributes of its planner
(``_compat.save_planner_caches``): :func:`reset` empties them, the planner owns them. Integrity's
``checksums_disabled`` is a benchmark's context manager, set and restored around a save by its caller.

Fork: a forked child inherits the parent's objects but none of its threads. The child starts with a fresh
state; the parent's is kept referenced (``inherited``), never destroyed there: a process group's destructor
would wait for threads that do not exist in the child, and a worker thread made in the parent (Lightning's
spawn launcher removes its weights file through the plugin) would leave the child's first save queued
forever. A collector paused by a thread of the parent is turned back on in the child. The ranks on this node
are forgotten too: the child's strategy setup says them again. (One handler stays module-level on purpose:
the scheduler's at-exit finish, registered once per process and inherited across a fork.)"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from lightning_zero import _compat


@dataclass(eq=False)
class CheckpointProcess:
    """This process's checkpoint state (see the module's note for who writes what)."""

    checkpointer: Any = None
    """The scheduler (``AsyncCheckpointer``); None until the first save, load or finalize."""
    coordination_group: Any = None
    """The gloo group for background coordination; None in a world of one or before the first use."""
    local_ranks: int | None = None
    """The ranks on this node, as the strategy said at setup (None: ask the launcher's environment)."""
    gc_lock: threading.Lock = field(default_factory=threading.Lock)
    gc_pauses: int = 0
    """How many :func:`gc_paused` blocks are open now, on any thread (under ``gc_lock``)."""
    gc_was_enabled: bool = False
    """Whether the collector was on when the first of them opened."""
    inherited: list[Any] = field(default_factory=list)
    """Objects of the parent process (after a fork): kept referenced, never used or destroyed."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards the first creation of ``checkpointer``."""

    def close(self) -> None:
        """(every rank, training thread, after the last save was finalized) End what this process started: the
        scheduler's worker thread and staging buffers, and the coordination group (when its process group still
        exists). The scheduler object and its figures stay."""
        if self.checkpointer is not None:
            self.checkpointer.close()
        group, self.coordination_group = self.coordination_group, None
        if group is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group(group)


_STATE = CheckpointProcess()


def state() -> CheckpointProcess:
    """The one accessor of this process's checkpoint state."""
    return _STATE


def _after_fork_in_child() -> None:
    """The fork rule (see the module's note)."""
    global _STATE
    parent = _STATE
    _STATE = CheckpointProcess(inherited=[parent])
    if parent.gc_pauses and parent.gc_was_enabled:
        gc.enable()


os.register_at_fork(after_in_child=_after_fork_in_child)


def reset() -> None:
    """(tests, every rank, training thread) Back to a fresh process: the save in flight finished (its error,
    if any, dropped), the worker thread ended, the coordination group destroyed (when its process group
    still exists), DCP's save-plan caches emptied."""
    global _STATE
    old = _STATE
    try:
        if old.checkpointer is not None:
            try:
                old.checkpointer.finalize(blocking=True)
            except Exception:  # noqa: BLE001 - a test's failed save; the test saw it or meant it
                pass
        with suppress(ValueError, RuntimeError):  # a group of a world destroyed and made again since
            old.close()
        for cache in _compat.save_planner_caches():
            cache.clear()
    finally:
        with old.gc_lock:  # a pause still open on the old state ends with it
            if old.gc_pauses and old.gc_was_enabled:
                old.gc_pauses = 0
                gc.enable()
        _STATE = CheckpointProcess()


@contextmanager
def gc_paused(enabled: bool = True) -> Iterator[None]:
    """Python's cyclic garbage collector off while inside (any thread; nested and concurrent uses nest);
    nothing when not ``enabled`` (``CheckpointTuning.pause_gc``). [Note: no collections while planning]"""
    resume = pause_gc(enabled)
    try:
        yield
    finally:
        resume()


def pause_gc(enabled: bool = True) -> Callable[[], None]:
    """The collector paused from now (as :func:`gc_paused`, which nests with it) until the returned function is
    called, from any thread; calling it again does nothing. A save's pause taken on the training thread ends on
    the save's own ([Note: the collector and a save's objects] in saver.py)."""
    if not enabled:
        return _no_pause
    current = _STATE
    with current.gc_lock:
        if current.gc_pauses == 0:
            current.gc_was_enabled = gc.isenabled()
            gc.disable()
        current.gc_pauses += 1
    open_ = [True]

    def resume() -> None:
        with current.gc_lock:
            if not open_[0]:
                return
            open_[0] = False
            current.gc_pauses -= 1
            if current.gc_pauses == 0 and current.gc_was_enabled:
                gc.enable()

    return resume


def _no_pause() -> None:
    pass
