"""Saves that fail in the background: the error surfaces on the next finalize/save/teardown with
the path and the cause, the previous checkpoint under the same name still loads its old
values, and nothing of the failed attempt is left behind."""

from __future__ import annotations

import contextlib
import errno
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import run_distributed
from checkpoint_cases import assert_same_state, save_with_failing_rank
from fault_cases import MODES, tree

from lightning_zero.checkpoint import (
    CheckpointSaveError,
    FlatShard,
    ZeroCheckpointIO,
    async_save,
    load,
    maybe_finalize_async_calls,
    remove,
    save,
)
from lightning_zero.checkpoint.store import file_io, writeback
from lightning_zero.checkpoint.trainer_state import TREE_TAG

pytestmark = pytest.mark.usefixtures("one_rank")  # one in-process gloo rank (tests/conftest.py)

DISK_FULL = r"No space left on device"


def disk_full() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


def loaded_value(path: Path) -> float:
    target = tree(0.0)
    load(target, str(path))
    return target["w"].local.unique().item()


def fill_disk(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """The next write fails like a full disk: part of the file is written, then ENOSPC."""

    def partial_write(loc: Any, path: str, obj: Any, *args: Any) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04 partial")
        raise disk_full()

    if mode == "sharded":  # the tensor data goes through DCP's writer
        def write_data(self: Any, plan: Any, planner: Any) -> Any:
            raise disk_full()

        monkeypatch.setattr(dcp.FileSystemWriter, "write_data", write_data)
    else:
        monkeypatch.setattr(file_io, "write_file", partial_write)


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("mode", MODES)
def test_failed_save_raises_on_finalize_and_the_previous_checkpoint_still_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    path = tmp_path / "last.ckpt"
    save(tree(1.0), str(path), mode=mode)
    committed = files(tmp_path)
    with monkeypatch.context() as patch:
        fill_disk(patch, mode)
        async_save(tree(2.0), str(path), mode=mode)  # returns: the failure happens in the background
        with pytest.raises(CheckpointSaveError, match=rf"{re.escape(repr(str(path)))}.*{DISK_FULL}") as error:
            maybe_finalize_async_calls(blocking=True)
    assert "the previous checkpoint is intact" in str(error.value)
    assert loaded_value(path) == 1.0
    # Nothing of the failed attempt is left: no partial data version, no temporary file.
    assert files(tmp_path) == committed


@pytest.mark.parametrize("mode", ["local", "full"])
def test_failed_save_is_raised_by_the_next_save_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     mode: str) -> None:
    with monkeypatch.context() as patch:
        fill_disk(patch, mode)
        async_save(tree(1.0), str(tmp_path / "a.ckpt"), mode=mode)
        with pytest.raises(CheckpointSaveError, match=rf"a\.ckpt.*{DISK_FULL}"):
            async_save(tree(2.0), str(tmp_path / "b.ckpt"), mode=mode)
    save(tree(3.0), str(tmp_path / "b.ckpt"), mode=mode)  # the error was raised once; saving works again
    assert loaded_value(tmp_path / "b.ckpt") == 3.0


def test_a_failure_on_one_rank_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    results = run_distributed(save_with_failing_rank, 2, str(tmp_path), 1, start_method="forkserver")
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} did not see the failure"
        assert re.search(rf"CheckpointSaveError: Saving checkpoint .*last\.ckpt.* failed.*rank 1: .*{DISK_FULL}",
                         result["error"]), result["error"]
        assert_same_state(result["loaded"], result["saved"], f"rank {rank}: previous last.ckpt")
    versions = list((tmp_path / "_zero_data" / "last.ckpt").iterdir())
    assert len(versions) == 1, "the failed attempt's data was not discarded"


def test_removal_queued_behind_a_failed_save_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old, new = tmp_path / "epoch=0.ckpt", tmp_path / "epoch=1.ckpt"
    save(tree(1.0), str(old), mode="local")
    with monkeypatch.context() as patch:
        fill_disk(patch, "local")
        async_save(tree(2.0), str(new), mode="local")
        remove(str(old))  # ModelCheckpoint(save_top_k=1) right after starting the newer save
        with pytest.raises(CheckpointSaveError, match=DISK_FULL):
            maybe_finalize_async_calls(blocking=True)
    save(tree(3.0), str(tmp_path / "later.ckpt"), mode="local")  # one worker: the removal job has run
    assert not new.exists()
    assert loaded_value(old) == 1.0, "the only complete checkpoint was removed"


def test_plugin_teardown_raises_a_background_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = ZeroCheckpointIO(mode="local")
    with monkeypatch.context() as patch:
        fill_disk(patch, "local")
        plugin.save_checkpoint({TREE_TAG: "local", **tree(1.0)}, tmp_path / "last.ckpt")
        with pytest.raises(CheckpointSaveError, match=rf"last\.ckpt.*{DISK_FULL}"):
            plugin.teardown()
    plugin.teardown()  # raised once


# ---- a failure in one of DCP's writer threads ([Note: parallel writes] in dcp/adapter.py) ---------


FAILED = threading.Event()
"""Set once a _FullDiskStream has failed."""


class _FullDiskStream:
    """Takes a few bytes, then fails like a full disk."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._left = 64

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) > self._left:
            self._raw.write(view[:self._left])
            self._left = 0
            FAILED.set()
            raise disk_full()
        self._left -= len(view)
        return self._raw.write(view)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class _SlowStream:
    """Writes, slowly: the other thread's failure comes while this one is still writing."""

    writes_after_failure = 0

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def write(self, data: Any) -> int:
        time.sleep(0.05)
        if FAILED.is_set():
            _SlowStream.writes_after_failure += 1
        return self._raw.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def fail_one_file(monkeypatch: pytest.MonkeyPatch, failing: str, slow: str = "", at_open: bool = False) -> None:
    """The file named ``failing`` meets a full disk (when created, with ``at_open``); ``slow`` is written slowly."""
    original = writeback.WritebackFileSystem.create_stream
    FAILED.clear()
    _SlowStream.writes_after_failure = 0

    @contextmanager
    def create_stream(self: Any, path: Any, mode: str) -> Iterator[Any]:
        name = str(path).rsplit("/", 1)[-1]
        if name == failing and at_open:
            FAILED.set()
            raise disk_full()
        with original(self, path, mode) as stream:
            yield _FullDiskStream(stream) if name == failing else _SlowStream(stream) if name == slow else stream

    monkeypatch.setattr(writeback.WritebackFileSystem, "create_stream", create_stream)


def writer_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if "_write_files_from_queue" in t.name]


@pytest.mark.parametrize("at_open", [False, True], ids=["mid-write", "at-open"])
@pytest.mark.parametrize("failing", ["__0_0.distcp", "__0_1.distcp"])
def test_a_full_disk_under_one_writer_thread_fails_the_save_after_every_thread_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str, at_open: bool) -> None:
    # Whichever thread (DCP's own or the calling one) meets the full disk, the save fails with that
    # error, no writer thread outlives it to write into the version being deleted, and the previous
    # checkpoint still loads.
    path = tmp_path / "last.ckpt"
    save(tree(1.0), str(path), mode="sharded")
    committed = files(tmp_path)
    slow = "__0_1.distcp" if failing == "__0_0.distcp" else "__0_0.distcp"
    with monkeypatch.context() as patch:
        fail_one_file(patch, failing, slow, at_open)
        async_save(tree(2.0), str(path), mode="sharded")
        with pytest.raises(CheckpointSaveError, match=rf"{re.escape(repr(str(path)))}.*{DISK_FULL}"):
            maybe_finalize_async_calls(blocking=True)
    assert writer_threads() == []
    assert loaded_value(path) == 1.0
    assert files(tmp_path) == committed
    # The other file stopped at its next write (the one in flight may finish): nothing more of
    # a lost save is written, or uploaded on S3.
    assert FAILED.is_set() and _SlowStream.writes_after_failure <= 1, _SlowStream.writes_after_failure


def second_save_meets_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  tree_of: Callable[[float], dict[str, Any]], failing: str, at_open: bool) -> Path:
    """A `sharded` save of ``tree_of(1.0)``, then one of ``tree_of(2.0)`` whose file ``failing`` meets a full disk:
    the second fails naming the checkpoint and the disk, and leaves the files of the first as they were."""
    path = tmp_path / "last.ckpt"
    save(tree_of(1.0), str(path), mode="sharded")
    committed = files(tmp_path)
    with monkeypatch.context() as patch:
        fail_one_file(patch, failing, at_open=at_open)
        async_save(tree_of(2.0), str(path), mode="sharded")
        with pytest.raises(CheckpointSaveError, match=rf"{re.escape(repr(str(path)))}.*{DISK_FULL}"):
            maybe_finalize_async_calls(blocking=True)
    assert files(tmp_path) == committed
    return path


@pytest.mark.parametrize("at_open", [False, True], ids=["mid-write", "at-open"])
def test_a_full_disk_while_many_small_items_are_written_fails_the_save_and_keeps_the_last_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at_open: bool) -> None:
    # [Note: many small items]: a rank of many small tensors writes its one data file itself, not through
    # DCP's writer threads; its failures are kept and raised as theirs are, and the version is given up.
    def many(value: float) -> dict[str, Any]:
        return {f"w{i}": FlatShard(torch.full((40,), value), (40,), 0, 1) for i in range(80)}

    path = second_save_meets_a_full_disk(tmp_path, monkeypatch, many, "__0_0.distcp", at_open)
    assert FAILED.is_set()
    target = many(0.0)
    load(target, str(path))
    assert all(shard.local.eq(1.0).all() for shard in target.values())


def test_a_writer_thread_that_dies_outside_any_stream_fails_the_save(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # DCP's extra thread ends silently when it raises before it opens its file: the items it held
    # have no result, and the save must fail rather than commit a checkpoint without them.
    from torch.distributed.checkpoint import filesystem

    path = tmp_path / "last.ckpt"
    save(tree(1.0), str(path), mode="sharded")
    committed = files(tmp_path)
    original = filesystem._SerialCpuLoader.start_loading

    def start_loading(self: Any) -> None:
        if "_write_files_from_queue" in threading.current_thread().name:
            raise MemoryError("no memory for this thread's items")
        original(self)

    with monkeypatch.context() as patch:
        patch.setattr(filesystem._SerialCpuLoader, "start_loading", start_loading)
        patch.setattr(threading, "excepthook", lambda args: None)  # the thread's death is expected here
        async_save(tree(2.0), str(path), mode="sharded")
        with pytest.raises(CheckpointSaveError, match=r"no result for 1 of 2 items.*previous checkpoint is untouched"):
            maybe_finalize_async_calls(blocking=True)
    assert loaded_value(path) == 1.0
    assert files(tmp_path) == committed


@pytest.mark.parametrize("at_open", [False, True], ids=["mid-write", "at-open"])
def test_a_full_disk_while_dcp_writes_its_metadata_fails_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   at_open: bool) -> None:
    # .metadata is written after the data files, through the same file system: its failure must
    # fail the save, not be kept like a data file's and committed.
    path = second_save_meets_a_full_disk(tmp_path, monkeypatch, tree, ".metadata.tmp", at_open)
    assert loaded_value(path) == 1.0


class _Upload:
    """An object-store file being written: ``discard`` aborts it (fsspec's buffered files have one)."""

    def __init__(self, fails_with: BaseException | None) -> None:
        self.data = bytearray()
        self.fails_with = fails_with
        self.discarded = False
        self.closed = False

    def write(self, data: Any) -> int:
        if self.fails_with is not None:
            raise self.fails_with
        self.data += bytes(data)
        return len(data)

    def discard(self) -> None:
        self.discarded = True


class _Uploads:
    def __init__(self, failing: str, fails_with: BaseException) -> None:
        self.files: dict[str, _Upload] = {}
        self._failing, self._fails_with = failing, fails_with

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[_Upload]:
        self.files[str(path)] = upload = _Upload(self._fails_with if str(path) == self._failing else None)
        yield upload


@pytest.mark.parametrize("fails_with", [KeyboardInterrupt(), disk_full()], ids=["interrupt", "disk-full"])
def test_a_failed_data_file_stops_and_aborts_the_others_at_their_next_write(fails_with: BaseException) -> None:
    # A failed write (kept; a KeyboardInterrupt or SystemExit also goes on up) aborts that file's
    # upload, and the file another thread writes stops at its next write and aborts its upload too,
    # instead of writing (or uploading) the rest of a save that is lost.
    from lightning_zero.checkpoint.dcp import integrity as dcp_integrity
    from lightning_zero.checkpoint.store.fsspec_store import FsspecStore

    uploads = _Uploads("failing.distcp", fails_with)
    fs = dcp_integrity._ChecksummingFileSystem(uploads, FsspecStore.abort)
    fs.keep_errors = True
    with fs.create_stream("other.distcp", "wb") as other:
        other.write(b"before")
        with contextlib.suppress(KeyboardInterrupt), fs.create_stream("failing.distcp", "wb") as failing:
            failing.write(b"some")
        with pytest.raises(dcp_integrity.SaveAbandoned, match="another file of this save failed first"):
            other.write(b"after")
    assert fs.errors[0] is fails_with
    assert uploads.files["failing.distcp"].discarded and uploads.files["failing.distcp"].closed
    assert uploads.files["other.distcp"].discarded and uploads.files["other.distcp"].closed
    # Nothing past the failure reached it (what it had gathered before may not have either: [Note: coalesced item
    # writes] in dcp/integrity.py); its upload is discarded in any case.
    assert bytes(uploads.files["other.distcp"].data) in (b"", b"before")


def test_a_data_file_that_fails_outside_its_writes_aborts_its_upload() -> None:
    # An fsync, close or item that fails after the writes went through: the file is lost all the
    # same, and its close must not complete the upload.
    from lightning_zero.checkpoint.dcp import integrity as dcp_integrity
    from lightning_zero.checkpoint.store.fsspec_store import FsspecStore

    uploads = _Uploads("none", disk_full())
    fs = dcp_integrity._ChecksummingFileSystem(uploads, FsspecStore.abort)
    fs.keep_errors = True
    with fs.create_stream("file.distcp", "wb") as stream:
        stream.write(b"all of it")
        raise disk_full()  # as DCP's os.fsync would, inside the stream's block
    assert isinstance(fs.errors[0], OSError)
    assert uploads.files["file.distcp"].discarded and uploads.files["file.distcp"].closed


def test_with_checksums_off_a_full_disk_still_fails_with_its_cause_and_stops_the_other_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # checksums_disabled() (bench/checkpoint.py --integrity) writes no CRCs but keeps the failure
    # handling: the cause, not torch's "unexpected pos", and the other file stops.
    from lightning_zero.checkpoint.formats import integrity

    path = tmp_path / "last.ckpt"
    save(tree(1.0), str(path), mode="sharded")
    with monkeypatch.context() as patch, integrity.checksums_disabled():
        fail_one_file(patch, "__0_0.distcp", "__0_1.distcp")
        async_save(tree(2.0), str(path), mode="sharded")
        with pytest.raises(CheckpointSaveError, match=DISK_FULL):
            maybe_finalize_async_calls(blocking=True)
    assert FAILED.is_set() and _SlowStream.writes_after_failure <= 1, _SlowStream.writes_after_failure
    assert loaded_value(path) == 1.0
