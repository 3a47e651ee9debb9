"""Early writeback of local checkpoint files ([Note: early writeback] in checkpoint/store/writeback.py): what
the writers hand the kernel while they write, and that nothing about the files changes."""

from __future__ import annotations

import ctypes
import errno
import io
import mmap
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero.checkpoint import CheckpointTuning, FlatShard, load, save
from lightning_zero.checkpoint.store import writeback

MIB = 2**20


class Recorder:
    """Stands in for ``sync_file_range`` and ``posix_fadvise``. ``calls``: each (fd, offset, length)
    whose writeback was started; ``events``: every call in order, as (what, offset, length) with
    what "start", "wait" or "drop". Returns ``result`` (``wait_result`` for waits)."""

    def __init__(self, result: int = 0, wait_result: int = 0, error: int = 0) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.events: list[tuple[str, int, int]] = []
        self.result, self.wait_result, self.error = result, wait_result, error

    def __call__(self, fd: int, offset: int, length: int, flags: int) -> int:
        if flags == writeback._SYNC_FILE_RANGE_WRITE:
            self.calls.append((fd, offset, length))
            self.events.append(("start", offset, length))
            result = self.result
        else:
            assert flags == writeback._SYNC_FILE_RANGE_WAIT  # the only other request: wait for a whole range
            self.events.append(("wait", offset, length))
            result = self.wait_result
        ctypes.set_errno(self.error if result else 0)  # as the real call leaves errno
        return result

    def fadvise(self, fd: int, offset: int, length: int, advice: int) -> None:
        assert advice == os.POSIX_FADV_DONTNEED
        self.events.append(("drop", offset, length))


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    monkeypatch.setattr(writeback, "_sync_file_range", recorder)
    monkeypatch.setattr(os, "posix_fadvise", recorder.fadvise, raising=False)
    return recorder


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_linux_provides_sync_file_range() -> None:
    # Without it the writers silently fall back to fsync-only writes: fail loudly here instead.
    assert writeback._sync_file_range is not None


def test_writeback_covers_what_was_written_in_order_and_the_bytes_are_unchanged(tmp_path: Path,
                                                                                 recorder: Recorder) -> None:
    payload = torch.randint(0, 256, (10 * MIB + 123,), dtype=torch.uint8).numpy().tobytes()
    path = tmp_path / "file.bin"
    with open(path, "wb") as f:
        stream = writeback.WritebackStream(f, every=3 * MIB)
        for start in range(0, len(payload), MIB // 2):
            stream.write(payload[start:start + MIB // 2])
        fd = f.fileno()
    assert path.read_bytes() == payload
    # Consecutive ranges from 0, each at least `every`, started as soon as each filled; the tail
    # under `every` is left to the fsync.
    assert [c[0] for c in recorder.calls] == [fd] * len(recorder.calls)
    offsets = [offset for _, offset, _ in recorder.calls]
    assert offsets[0] == 0
    assert all(a + length == b for (_, a, length), b in zip(recorder.calls, offsets[1:], strict=False))
    assert all(length >= 3 * MIB for _, _, length in recorder.calls)
    covered = offsets[-1] + recorder.calls[-1][2]
    assert len(payload) - 3 * MIB < covered <= len(payload)


def test_a_stream_without_a_file_descriptor_is_written_through(recorder: Recorder) -> None:
    buffer = io.BytesIO()
    stream = writeback.WritebackStream(buffer, every=1)
    stream.write(b"abc")
    stream.write(memoryview(b"defg"))
    assert buffer.getvalue() == b"abcdefg" and stream.tell() == 7
    assert recorder.calls == []


def big_state(value: float) -> dict[str, Any]:
    numel = 3 * MIB  # 12 MiB of fp32
    return {"w": FlatShard(torch.full((numel,), value), (numel,), 0, 1), "b": torch.full((5,), value)}


@pytest.mark.parametrize("mode", ["local", "sharded", "full"])
def test_every_mode_starts_writeback_while_writing_and_loads_the_same_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recorder: Recorder, single_rank_group: None,
        mode: str) -> None:
    path = tmp_path / "ckpt"
    save(big_state(1.5), str(path), mode=mode, tuning=CheckpointTuning(writeback_bytes=4 * MIB))
    assert sum(length for _, _, length in recorder.calls) >= 8 * MIB  # of the 12 MiB file
    target = big_state(0.0)
    load(target, str(path))
    assert torch.equal(target["w"].local, big_state(1.5)["w"].local)
    assert torch.equal(target["b"], big_state(1.5)["b"])


@pytest.mark.parametrize("mode", ["local", "sharded", "full"])
def test_with_fsync_off_the_data_files_are_neither_synced_nor_written_back_and_load_the_same(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recorder: Recorder, single_rank_group: None,
        mode: str) -> None:
    """``CheckpointTuning(fsync=False)``: the data files go to the page cache as ``torch.save``'s do (no
    writeback request, no fsync); the commit marker is still published whole (one rename), and fsynced."""
    synced: list[int] = []  # the size of each file fsynced
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.fstat(fd).st_size)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    save(big_state(1.5), str(tmp_path / "off"), mode=mode, tuning=CheckpointTuning(writeback_bytes=4 * MIB,
                                                                                   fsync=False))
    assert recorder.calls == []
    assert not [size for size in synced if size > MIB], synced  # a marker (a few hundred bytes) is still fsynced
    target = big_state(0.0)
    load(target, str(tmp_path / "off"))
    assert torch.equal(target["w"].local, big_state(1.5)["w"].local)
    assert torch.equal(target["b"], big_state(1.5)["b"])
    synced.clear()
    save(big_state(2.5), str(tmp_path / "on"), mode=mode, tuning=CheckpointTuning(writeback_bytes=4 * MIB))
    assert recorder.calls and [size for size in synced if size > 12 * MIB], synced  # the default fsyncs the data


def test_a_failed_writeback_request_leaves_the_save_to_the_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   single_rank_group: None) -> None:
    # A file that does not take the requests (EINVAL): the save must not fail or change.
    failing = Recorder(result=-1, wait_result=-1, error=errno.EINVAL)
    monkeypatch.setattr(writeback, "_sync_file_range", failing)
    path = tmp_path / "ckpt"
    save(big_state(2.5), str(path), mode="sharded", tuning=CheckpointTuning(writeback_bytes=4 * MIB))
    assert failing.calls
    target = big_state(0.0)
    load(target, str(path))
    assert torch.equal(target["w"].local, big_state(2.5)["w"].local)


def test_taking_the_descriptor_to_fsync_flushes_python_s_buffer_first(tmp_path: Path) -> None:
    # DCP fsyncs `stream.fileno()` before it closes the file: the tail must be in the kernel by then.
    path = tmp_path / "small.bin"
    with open(path, "wb") as f:
        stream = writeback.WritebackStream(f)
        stream.write(b"x" * 100)
        assert path.stat().st_size == 0  # still in Python's buffer
        stream.fileno()
        assert path.stat().st_size == 100


def test_offsets_count_from_where_the_file_was_when_wrapped(tmp_path: Path, recorder: Recorder) -> None:
    path = tmp_path / "appended.bin"
    with open(path, "wb") as f:
        f.write(b"h" * 1000)
        stream = writeback.WritebackStream(f, every=MIB)
        stream.write(b"d" * (2 * MIB))
    assert recorder.calls[0][1] == 1000 and recorder.calls[0][2] == 2 * MIB


# ---- drop behind ([Note: drop behind]) ----------------------------------------------------------


def test_each_range_is_waited_for_and_dropped_once_the_next_one_is_started(tmp_path: Path,
                                                                            recorder: Recorder) -> None:
    with open(tmp_path / "file.bin", "wb", buffering=0) as f:
        stream = writeback.WritebackStream(f, every=MIB)
        for _ in range(4):
            stream.write(b"x" * MIB)
    # The disk is always handed the next range before the stream waits for the one before it, and
    # a range is dropped only after its wait; the range just started stays cached.
    assert recorder.events == [
        ("start", 0, MIB),
        ("start", MIB, MIB), ("wait", 0, MIB), ("drop", 0, MIB),
        ("start", 2 * MIB, MIB), ("wait", MIB, MIB), ("drop", MIB, MIB),
        ("start", 3 * MIB, MIB), ("wait", 2 * MIB, MIB), ("drop", 2 * MIB, MIB),
    ]


def test_an_error_the_wait_reports_fails_the_write_and_nothing_is_dropped(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # The wait consumes the file's writeback error (the fsync after it would succeed): it must
    # fail the write itself, naming the cause.
    failing = Recorder(wait_result=-1, error=errno.EIO)
    monkeypatch.setattr(writeback, "_sync_file_range", failing)
    monkeypatch.setattr(os, "posix_fadvise", failing.fadvise, raising=False)
    with open(tmp_path / "file.bin", "wb", buffering=0) as f:
        stream = writeback.WritebackStream(f, every=MIB)
        stream.write(b"x" * MIB)
        with pytest.raises(OSError, match=r"writing back bytes 0-1048576 of a checkpoint file failed") as error:
            stream.write(b"x" * MIB)
    assert error.value.errno == errno.EIO
    assert [what for what, _, _ in failing.events] == ["start", "start", "wait"]


def test_a_file_that_refuses_the_wait_is_left_to_the_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    refusing = Recorder(wait_result=-1, error=errno.EINVAL)
    monkeypatch.setattr(writeback, "_sync_file_range", refusing)
    monkeypatch.setattr(os, "posix_fadvise", refusing.fadvise, raising=False)
    with open(tmp_path / "file.bin", "wb", buffering=0) as f:
        stream = writeback.WritebackStream(f, every=MIB)
        for _ in range(4):
            stream.write(b"x" * MIB)
    # No further request after the refusal, and the bytes are all there.
    assert [what for what, _, _ in refusing.events] == ["start", "start", "wait"]
    assert (tmp_path / "file.bin").stat().st_size == 4 * MIB


def test_with_drop_behind_off_nothing_is_waited_for_or_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                recorder: Recorder) -> None:
    with open(tmp_path / "file.bin", "wb", buffering=0) as f:
        stream = writeback.WritebackStream(f, every=MIB, drop_behind=False)
        for _ in range(3):
            stream.write(b"x" * MIB)
    assert [what for what, _, _ in recorder.events] == ["start"] * 3


def _mount_type(path: Path) -> str:
    """The file system type of the mount holding ``path`` (its longest mount point above it)."""
    best, kind = "", ""
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            _, point, fs_type = line.split()[:3]
            inside = point == "/" or str(path) == point or str(path).startswith(point.rstrip("/") + "/")
            if inside and len(point) > len(best):
                best, kind = point, fs_type
    return kind


PAGE_CACHE_FILE_SYSTEMS = ("ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs")
"""Local disk file systems whose written pages stay in the page cache until dropped."""


def _resident_bytes(path: Path) -> int:
    """How many of ``path``'s bytes are in the page cache (``mincore`` over a shared mapping)."""
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), size) as mapped:
        vector = (ctypes.c_ubyte * pages)()
        first_byte = ctypes.c_char.from_buffer(mapped)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        status = libc.mincore(ctypes.addressof(first_byte), size, vector)
        del first_byte  # it exports the mapping's buffer: released before the mapping closes
        assert status == 0, os.strerror(ctypes.get_errno())
    return sum(byte & 1 for byte in vector) * mmap.PAGESIZE


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range and mincore are Linux's")
@pytest.mark.parametrize("drop_behind", [True, False])
def test_a_file_being_written_keeps_about_one_range_in_the_page_cache(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      drop_behind: bool) -> None:
    fs_type = _mount_type(tmp_path)
    if fs_type not in PAGE_CACHE_FILE_SYSTEMS:
        pytest.skip(f"{tmp_path} is on {fs_type}, which may keep its pages elsewhere (memory, its own cache)")
    path = tmp_path / "file.bin"
    with open(path, "wb", buffering=0) as f:
        stream = writeback.WritebackStream(f, every=MIB, drop_behind=drop_behind)
        for _ in range(16):
            stream.write(os.urandom(MIB))
        resident = _resident_bytes(path)  # before the fsync: what a save holds while it writes
    if drop_behind:
        assert resident <= 2 * MIB  # the last range started, and at most one page of a boundary
    else:  # the control: without it the whole file stays cached (this machine is far from full)
        assert resident >= 15 * MIB
