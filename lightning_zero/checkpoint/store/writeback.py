"""Page-cache writeback started while a local checkpoint file is written ([Note: early writeback]):
the streams that ``torch.save`` and DCP's local writer write through."""

from __future__ import annotations

import ctypes
import errno
import io
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

from lightning_zero.checkpoint.store.tuning import DEFAULT_TUNING, CheckpointTuning

# <linux/fs.h>
_SYNC_FILE_RANGE_WAIT_BEFORE = 1  # wait for writeback already under way in the range
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages
_SYNC_FILE_RANGE_WAIT_AFTER = 4  # wait for the writeback just started
_SYNC_FILE_RANGE_WAIT = _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER


_REFUSED = (errno.EINVAL, errno.ESPIPE, errno.ENOSYS, errno.EOPNOTSUPP)
"""``sync_file_range`` errors that say the file does not take the request, not that writing failed."""


def _load_sync_file_range() -> Any:
    """glibc's ``sync_file_range``, or None (not Linux, or not found): :class:`WritebackStream` then
    passes writes through and the final fsync does all the writing, as it would without it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_sync_file_range = _load_sync_file_range()

PROGRESS_BYTES = 1 << 20
"""A :class:`WritebackStream`'s ``progress`` is told at most once per this many bytes (a flush each time)."""


class WritebackStream:
    """A local file being written, whose bytes the kernel starts writing to disk every ``every`` bytes
    (``CheckpointTuning.writeback_bytes``) instead of at the final fsync; a file being written keeps
    about twice that in the page cache ([Note: drop behind]). ``drop_behind``: drop the pages once
    written out (``CheckpointTuning.drop_behind``).

    [Note: early writeback] Writes land in the page cache at memory speed and the fsync that makes a
    checkpoint file durable then waits for the disk to take the whole file, while the CPU that
    serialized it idles. ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` on each range as it fills hands
    it to the disk while serialization goes on (it queues the pages and returns), so disk and CPU
    work at once and the fsync finds little left; RocksDB's ``bytes_per_sync`` does the same. In
    ``bench/checkpoint.py`` even raw writes of one file per rank reach 1.06-1.17x the rate with it
    (``bench/write_loop.py``: a ``sharded`` save's write 1.33-1.41x).

    It promises nothing about durability (no metadata, no cache flush of the device): the fsync
    that follows still does that. Offsets count from where the file was when wrapped; a seek
    through the wrapper is not followed (its hints would then only be wasted). ``fileno`` flushes
    Python's buffer first; everything else (``tell``, ``flush``, ...) is the wrapped file's.

    [Note: drop behind] Once a range's writeback is started, the stream waits for the range before
    it (whose writeback has had a whole range's time to finish, and the range just started keeps the
    disk busy meanwhile) and drops its now clean pages (``POSIX_FADV_DONTNEED``). A file being
    written then holds about two ranges of page cache, not the whole checkpoint:
    - a save of tens of GB does not evict what the training job keeps cached (its dataset files),
      and does not count its size against a container's memory limit (cgroup v2 charges page cache
      to the job; its dirty pages throttle every writer of the job once past the dirty limit);
    - the next range is written into the pages just freed, not into memory untouched for a while.
      On a VM that reports free memory to its host (virtio-balloon free page reporting, as on this
      project's benchmark machine) the host takes such memory back, and touching it again costs a
      host page fault per page, several times slower than reusing memory just freed, and
      checkpoint writes that land on fresh memory fall far below the disk's rate (BENCHMARKS.md,
      "Drop behind and two writer threads", has the figures).
    The price: the waits, and a read of the checkpoint right after its save comes from the disk.
    Where every save reuses memory freed a second earlier (``bench/write_loop.py``'s back-to-back
    saves), keeping the pages is faster (``drop_behind=False``; BENCHMARKS.md). The file's last two
    ranges stay cached (clean after the fsync).

    ``progress``: called after a write once ``PROGRESS_BYTES`` more were written, with the offset below
    which the file's bytes are in the kernel (Python's buffer flushed first), for a reader that follows the
    file as it grows; the writer reports the end itself."""

    def __init__(self, raw: Any, every: int | None = None, drop_behind: bool | None = None,
                 progress: Callable[[int], None] | None = None) -> None:
        self._raw = raw
        self._progress = progress  # told the offset up to which the file's bytes are in the kernel
        self._every = DEFAULT_TUNING.writeback_bytes if every is None else every
        try:
            self._fd: int | None = raw.fileno() if _sync_file_range is not None else None
            start = raw.tell() if self._fd is not None else 0
        except (AttributeError, OSError, io.UnsupportedOperation):
            self._fd, start = None, 0
        self._position = start  # file offset after what was written through this wrapper
        self._started = start  # up to here writeback has been started
        self._reported = start  # up to here ``progress`` was told
        self._dropped = start  # up to here the pages were dropped from the page cache
        self._drop = DEFAULT_TUNING.drop_behind if drop_behind is None else drop_behind

    def write(self, data: Any) -> int:
        written = self._raw.write(data)
        self._position += len(memoryview(data).cast("B")) if written is None else written
        if self._fd is not None and self._position - self._started >= self._every:
            self._raw.flush()  # out of Python's buffer, so the range is in the page cache
            # A failure here (EIO, ENOSPC) comes back from the fsync too, which raises it.
            _sync_file_range(self._fd, self._started, self._position - self._started, _SYNC_FILE_RANGE_WRITE)
            self._drop_behind(self._started)
            self._started = self._position
        if self._progress is not None and self._position - self._reported >= PROGRESS_BYTES:
            self._raw.flush()  # [Note: streamed replication] in replication.py
            self._progress(self._position)
            self._reported = self._position
        return written

    def _drop_behind(self, end: int) -> None:
        """Wait for the writeback of [dropped, end) and drop its pages ([Note: drop behind])."""
        start, self._dropped = self._dropped, end
        if end <= start or self._fd is None or not self._drop:
            return
        if _sync_file_range(self._fd, start, end - start, _SYNC_FILE_RANGE_WAIT) != 0:
            code = ctypes.get_errno()
            if code in _REFUSED:  # this file does not take the request: leave it all to the fsync
                self._fd = None
                return
            # The wait has consumed the file's writeback error (the kernel reports one to each open
            # file once, and the fsync would then succeed): it is this save's failure.
            raise OSError(code, f"writing back bytes {start}-{end} of a checkpoint file failed: {os.strerror(code)}")
        # Only clean pages are dropped (dirty ones never are), and only once the wait succeeded.
        with suppress(OSError, AttributeError):  # a hint: no posix_fadvise, no harm
            os.posix_fadvise(self._fd, start, end - start, os.POSIX_FADV_DONTNEED)

    def fileno(self) -> int:
        # Callers take the descriptor to fsync it (DCP does, before it closes the file): Python's
        # buffer goes to the kernel first, or its last bytes (a zip directory, a small .metadata)
        # would reach the disk only after the fsync that was to make them durable.
        self._raw.flush()
        return self._raw.fileno()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class WritebackFileSystem:
    """DCP's local ``FileSystem`` whose write streams are :class:`WritebackStream` s (its other
    methods, reads included, are the wrapped one's)."""

    def __init__(self, inner: Any, tuning: CheckpointTuning = DEFAULT_TUNING) -> None:
        self._inner = inner
        self._tuning = tuning

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with self._inner.create_stream(path, mode) as stream:
            yield (WritebackStream(stream, self._tuning.writeback_bytes, self._tuning.drop_behind) if "w" in mode
                   else stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
