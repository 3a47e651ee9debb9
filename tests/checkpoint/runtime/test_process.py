"""The process-wide checkpoint state ([Note: process-wide checkpoint state] in checkpoint/runtime/process.py):
one accessor, one fork rule, one reset."""

from __future__ import annotations

import gc
import multiprocessing
from pathlib import Path

import pytest
import torch

from lightning_zero.checkpoint import async_save, load, maybe_finalize_async_calls
from lightning_zero.checkpoint.runtime import process
from lightning_zero.checkpoint.runtime.scheduler import checkpointer


def test_the_scheduler_lives_in_the_process_state_and_is_made_once() -> None:
    first = checkpointer()
    assert process.state().checkpointer is first
    assert checkpointer() is first


def test_reset_finishes_the_save_in_flight_and_starts_afresh(tmp_path: Path, one_rank: None) -> None:
    tensor = torch.arange(6.0)
    async_save({"t": tensor}, str(tmp_path / "a.ckpt"), mode="full")
    old_state, old_checkpointer = process.state(), checkpointer()
    process.reset()
    assert process.state() is not old_state
    assert checkpointer() is not old_checkpointer
    assert not any(t.name.startswith(old_checkpointer.executor()._name) for t in __import__("threading").enumerate())
    target = {"t": torch.zeros(6)}
    load(target, str(tmp_path / "a.ckpt"))  # the save was finished, not dropped
    assert torch.equal(target["t"], tensor)


def test_reset_drops_a_failed_saves_error_and_the_next_save_works(tmp_path: Path, one_rank: None) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    async_save({"t": torch.ones(2)}, str(blocker / "x.ckpt"), mode="full")  # fails in the background
    process.reset()
    async_save({"t": torch.ones(2)}, str(tmp_path / "ok.ckpt"), mode="full")
    maybe_finalize_async_calls(blocking=True)
    assert (tmp_path / "ok.ckpt").exists()


def test_without_reset_the_failed_save_is_raised_at_the_next_finalize(tmp_path: Path, one_rank: None) -> None:
    # The control of the test above: the error is there to drop.
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    async_save({"t": torch.ones(2)}, str(blocker / "x.ckpt"), mode="full")
    with pytest.raises(Exception, match="x.ckpt"):
        maybe_finalize_async_calls(blocking=True)


def _child(queue: multiprocessing.Queue) -> None:
    state = process.state()
    queue.put((state.checkpointer is None, state.coordination_group is None, len(state.inherited),
               state.gc_pauses, gc.isenabled()))


def test_a_forked_child_starts_with_a_fresh_state_and_keeps_the_parents_referenced() -> None:
    checkpointer()
    process.state().local_ranks = 3
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    with process.gc_paused():  # forked during a pause: the child's collector is on again
        child = context.Process(target=_child, args=(queue,))
        child.start()
    child.join(60)
    assert child.exitcode == 0
    fresh_scheduler, no_group, inherited, pauses, gc_on = queue.get(timeout=10)
    assert (fresh_scheduler, no_group, inherited, pauses) == (True, True, 1, 0)
    assert gc_on == gc.isenabled()
    assert process.state().local_ranks == 3  # the parent's own state is untouched


def test_release_ends_the_worker_the_staging_buffers_and_the_group_and_keeps_the_figures(
        tmp_path: Path, one_rank: None) -> None:
    """What the front ends call at teardown ([Note: process-wide checkpoint state]): nothing the package started
    keeps running or pinned, and the next save starts it again."""
    import threading

    import torch.distributed as dist

    from lightning_zero.checkpoint import last_save_stats, saver

    async_save({"t": torch.ones(3)}, str(tmp_path / "a.ckpt"), mode="full")
    maybe_finalize_async_calls(blocking=True)
    stats = last_save_stats()
    scheduler = checkpointer()
    # Stand-ins for a GPU run's pinned buffer and a world's coordination group (this world has one rank).
    scheduler.stager._host[("t", (3,), torch.float32)] = torch.empty(3)
    process.state().coordination_group = dist.new_group([0], backend="gloo")
    saver.release()
    assert not any(t.name.startswith(scheduler.executor()._name) for t in threading.enumerate())
    assert checkpointer().stager.host_buffers() == [] and process.state().coordination_group is None
    assert stats is not None and last_save_stats() is stats
    async_save({"t": torch.zeros(3)}, str(tmp_path / "b.ckpt"), mode="full")
    maybe_finalize_async_calls(blocking=True)
    assert last_save_stats() is not stats
