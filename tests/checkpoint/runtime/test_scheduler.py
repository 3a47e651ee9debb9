"""The async scheduler (checkpoint/runtime/scheduler.py): one worker thread runs saves and removals one at
a time, in the order queued; the training thread queues, waits for staging and finalizes; a save's error
reaches the training thread at the next finalize, once, and costs neither the next save nor the checkpoint
a removal queued behind it would have deleted.

Through the functional API in this process, one rank, with a writer or stager held back on purpose; and
on the scheduler's own objects (``SerialWorker``, ``AsyncCheckpointer``), fresh ones, not the process's.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_cases import small_tree, small_tree_values

from lightning_zero.checkpoint import (
    CheckpointSaveError,
    async_save,
    load,
    maybe_finalize_async_calls,
    remove,
    save,
    wait_for_staging,
)
from lightning_zero.checkpoint.runtime.scheduler import AsyncCheckpointer, SerialWorker
from lightning_zero.checkpoint.runtime.staging import Stager
from lightning_zero.checkpoint.store import file_io, storage

pytestmark = pytest.mark.usefixtures("saves_finalized")  # tests/conftest.py


# ---- through the functional API --------------------------------------------------------------


class Gate:
    """Holds a background step until released (with a deadline, so a bug cannot hang the suite)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()

    def wrap(self, fn: Any) -> Any:
        def gated(*args: Any, **kwargs: Any) -> Any:
            self.entered.set()
            assert self.released.wait(30), "gate never released"
            return fn(*args, **kwargs)

        return gated


@pytest.mark.parametrize("mode", ["local", "full"])
def test_async_save_returns_before_the_data_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       mode: str) -> None:
    gate = Gate()
    monkeypatch.setattr(file_io, "write_file", gate.wrap(file_io.write_file))
    path = tmp_path / "ckpt"
    async_save(small_tree(1.0), str(path), mode=mode)
    assert gate.entered.wait(10)
    assert not path.exists()  # no commit marker / file while the writer is held
    assert maybe_finalize_async_calls(blocking=False) is False
    gate.released.set()
    assert maybe_finalize_async_calls(blocking=True) is True
    loaded = small_tree(0.0)
    load(loaded, str(path))
    assert small_tree_values(loaded) == (1.0, 1.0)


def test_wait_for_staging_blocks_until_the_tensors_are_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate()
    monkeypatch.setattr(Stager, "stage", gate.wrap(Stager.stage))
    async_save(small_tree(1.0), str(tmp_path / "ckpt"), mode="local")
    waiter = threading.Thread(target=wait_for_staging)
    waiter.start()
    assert gate.entered.wait(10)
    time.sleep(0.2)
    assert waiter.is_alive(), "wait_for_staging returned before staging"
    gate.released.set()
    waiter.join(10)
    assert not waiter.is_alive()


@pytest.mark.parametrize("mode", ["local", "full"])
def test_tensors_changed_after_staging_do_not_reach_the_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   mode: str) -> None:
    gate = Gate()
    monkeypatch.setattr(file_io, "write_file", gate.wrap(file_io.write_file))
    tree = small_tree(1.0)
    async_save(tree, str(tmp_path / "ckpt"), mode=mode)
    wait_for_staging()  # returns although the writer is still held
    assert not gate.released.is_set()
    tree["model"]["w"].local.fill_(99.0)  # what an optimizer step does to the live state
    tree["model"]["b"].fill_(99.0)
    gate.released.set()
    maybe_finalize_async_calls(blocking=True)
    loaded = small_tree(0.0)
    load(loaded, str(tmp_path / "ckpt"))
    assert small_tree_values(loaded) == (1.0, 1.0)


@pytest.mark.parametrize("mode", ["local", "sharded", "full"])
def test_a_synchronous_save_writes_the_live_tensors_without_a_host_copy(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       mode: str) -> None:
    """[Note: synchronous saves write the live state] ``save`` holds its caller until the commit, so the tensors
    that are the whole of their storage reach the writer as they are (no clone); a view of a larger buffer is
    still copied (the file would otherwise carry the whole buffer). The checkpoint loads as any other."""
    big = torch.arange(12.0)
    tree = small_tree(3.0)
    tree["model"]["view"] = big[4:8]  # a slice of a larger storage
    seen: dict[str, Any] = {}
    original = Stager.stage

    def stage(self: Stager, state: Any, *args: Any, **kwargs: Any) -> Any:
        staged = original(self, state, *args, **kwargs)
        seen["staged"], seen["live"] = staged, kwargs.get("live")
        return staged

    monkeypatch.setattr(Stager, "stage", stage)
    save(tree, str(tmp_path / "sync"), mode=mode)
    assert seen["live"] is True
    staged = seen["staged"]["model"] if "model" in seen["staged"] else seen["staged"]
    flat = [leaf for leaf in staged.values() if isinstance(leaf, torch.Tensor)]
    pointers = {t.untyped_storage().data_ptr() for t in flat}
    assert tree["model"]["b"].untyped_storage().data_ptr() in pointers  # written as it is
    assert big.untyped_storage().data_ptr() not in pointers  # the view was copied
    loaded = small_tree(0.0)
    loaded["model"]["view"] = torch.zeros(4)
    load(loaded, str(tmp_path / "sync"))
    assert small_tree_values(loaded) == (3.0, 3.0)
    assert loaded["model"]["view"].tolist() == [4.0, 5.0, 6.0, 7.0]

    async_save(tree, str(tmp_path / "async"), mode=mode)  # an async save copies all of them
    maybe_finalize_async_calls(blocking=True)
    assert seen["live"] is False
    staged = seen["staged"]["model"] if "model" in seen["staged"] else seen["staged"]
    assert tree["model"]["b"].untyped_storage().data_ptr() not in {
        t.untyped_storage().data_ptr() for t in staged.values() if isinstance(t, torch.Tensor)}


def test_a_second_save_finalizes_the_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate()
    monkeypatch.setattr(file_io, "write_file", gate.wrap(file_io.write_file))
    async_save(small_tree(1.0), str(tmp_path / "first"), mode="local")
    second = threading.Thread(target=async_save, args=(small_tree(2.0), str(tmp_path / "second")),
                              kwargs={"mode": "local"})
    second.start()
    time.sleep(0.2)
    assert second.is_alive(), "the second save did not wait for the first"
    gate.released.set()
    second.join(10)
    maybe_finalize_async_calls(blocking=True)
    for name, expected in (("first", 1.0), ("second", 2.0)):
        loaded = small_tree(0.0)
        load(loaded, str(tmp_path / name))
        assert small_tree_values(loaded) == (expected, expected)


def test_remove_queued_during_a_save_runs_after_its_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old, new = tmp_path / "old.ckpt", tmp_path / "new.ckpt"
    save(small_tree(1.0), str(old), mode="local")
    gate = Gate()
    monkeypatch.setattr(file_io, "write_file", gate.wrap(file_io.write_file))
    async_save(small_tree(2.0), str(new), mode="local")
    remove(str(old))  # what ModelCheckpoint does right after starting the newer save
    time.sleep(0.2)
    assert old.exists() and (tmp_path / "_zero_data" / "old.ckpt").exists(), "removed before the newer commit"
    gate.released.set()
    maybe_finalize_async_calls(blocking=True)
    assert new.exists()
    deadline = time.monotonic() + 10  # the removal runs in the background, after the commit
    while (old.exists() or (tmp_path / "_zero_data" / "old.ckpt").exists()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not old.exists() and not (tmp_path / "_zero_data" / "old.ckpt").exists()
    loaded = small_tree(0.0)
    load(loaded, str(new))
    assert small_tree_values(loaded) == (2.0, 2.0)


# ---- the scheduler's own objects ---------------------------------------------------------------


def test_calls_run_one_at_a_time_in_the_order_submitted_and_the_thread_ends_with_them() -> None:
    worker = SerialWorker("test_serial_worker")
    ran: list[int] = []
    busy = threading.Lock()
    overlapped: list[int] = []

    def call(index: int) -> int:
        if not busy.acquire(blocking=False):
            overlapped.append(index)
            return index
        try:
            time.sleep(0.01)
            ran.append(index)
        finally:
            busy.release()
        return index

    futures = [worker.submit(call, index) for index in range(8)]
    assert [future.result(timeout=30) for future in futures] == list(range(8))
    assert ran == list(range(8)) and not overlapped
    worker.join_idle()
    assert not worker.alive()
    assert not [t for t in threading.enumerate() if t.name.startswith("test_serial_worker")]
    # A call submitted after the thread left starts a new one: nothing is stranded in the queue.
    assert worker.submit(lambda: "again").result(timeout=30) == "again"


def _disk_full(staged: threading.Event) -> None:
    staged.set()
    raise OSError(28, "No space left on device")


def test_a_failed_save_is_raised_at_the_next_finalize_once_with_its_path_and_cause() -> None:
    scheduler = AsyncCheckpointer()
    scheduler.submit("/runs/last.ckpt", _disk_full)
    with pytest.raises(CheckpointSaveError,
                       match=r"'/runs/last\.ckpt' failed: \[Errno 28\] No space left on device"):
        scheduler.finalize(blocking=True)
    assert scheduler.finalize(blocking=True) is True  # raised once, then nothing is in flight


def test_a_save_queued_after_a_failed_one_still_runs_then_the_failure_is_raised() -> None:
    scheduler = AsyncCheckpointer()
    scheduler.submit("/runs/a.ckpt", _disk_full)
    second_ran = threading.Event()

    def second(staged: threading.Event) -> None:
        staged.set()
        second_ran.set()

    with pytest.raises(CheckpointSaveError, match=r"'/runs/a\.ckpt' failed"):
        scheduler.submit("/runs/b.ckpt", second)
    assert scheduler.finalize(blocking=True) is True  # b committed: no error of its own
    assert second_ran.is_set()


def test_a_removal_queued_behind_a_save_that_fails_keeps_the_old_checkpoint(tmp_path: Path) -> None:
    old = tmp_path / "old.ckpt"
    old.write_bytes(b"the previous checkpoint")
    scheduler = AsyncCheckpointer()
    release = threading.Event()

    def failing(staged: threading.Event) -> None:
        staged.set()
        assert release.wait(30), "never released"
        raise OSError("the store went away")

    scheduler.submit(str(tmp_path / "new.ckpt"), failing)
    scheduler.remove_after_pending(storage.resolve(str(old)))  # what ModelCheckpoint does after a newer save
    release.set()
    with pytest.raises(CheckpointSaveError, match="the store went away"):
        scheduler.finalize(blocking=True)
    assert scheduler.finalize(blocking=True) is True
    assert old.read_bytes() == b"the previous checkpoint"
