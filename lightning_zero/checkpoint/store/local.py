"""Local disks and shared file systems (FSx/Lustre/NFS): :class:`LocalStore`. Files are fsynced (data files unless
``CheckpointTuning.fsync`` is off), a whole file or
a marker appears through one rename (:func:`replace_whole`), links are relative symlinks, large writes are
written back early ([Note: early writeback] in writeback.py) and reads are memory-mapped."""

from __future__ import annotations

import glob
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import IO, Any

from fsspec.implementations.local import LocalFileSystem

from lightning_zero.checkpoint.store import writeback
from lightning_zero.checkpoint.store.backend import Failure, Store
from lightning_zero.checkpoint.store.tuning import DEFAULT_TUNING, CheckpointTuning

NEVER = 1 << 62
"""A writeback interval no file reaches."""


def replace_whole(path: str, write: Callable[[str], None]) -> None:
    """(local disks) Create ``path`` whole or not at all: ``write(tmp)`` makes a temporary name beside it
    (``<path>.tmp-<id>``, which readers skip), which then replaces ``path`` in one rename; a failed
    write leaves no temporary behind (least of all on a full disk). Object stores need none of this:
    an upload is complete or absent."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.remove(tmp)
        raise


class LocalStore(Store):
    """Plain paths and ``file://`` URLs."""

    name = "local"
    machine_files = True

    def __init__(self) -> None:
        self._fs = LocalFileSystem()

    @classmethod
    def open(cls, url: str, options: dict[str, Any]) -> tuple[Store, str]:
        return _LOCAL, os.path.abspath(url.removeprefix("file://"))

    def url(self, path: str) -> str:
        return path

    @property
    def fs(self) -> Any:
        return self._fs

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def ls(self, path: str, detail: bool = False) -> list[Any]:
        return self._fs.ls(path, detail=detail)

    def rm(self, path: str, recursive: bool = False) -> None:
        self._fs.rm(path, recursive=recursive)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def open_read(self, path: str) -> IO[bytes]:
        return open(path, "rb")

    def open_write(self, path: str) -> IO[bytes]:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        return open(path, "wb")

    def mappable(self, path: str) -> str | None:
        if not os.path.isfile(path):
            raise FileNotFoundError(path)
        return path

    def write_file(self, path: str, write: Callable[[IO[bytes]], None], tuning: CheckpointTuning = DEFAULT_TUNING,
                   *, progress: Callable[[int], None] | None = None,
                   recycle: Callable[[str], bool] | None = None) -> None:
        """One file, fsynced (unless ``tuning.fsync`` is off: then a plain write into the page cache, as
        ``torch.save``'s). ``progress`` is told how far the bytes are in the kernel
        (:class:`~lightning_zero.checkpoint.store.writeback.WritebackStream`); ``recycle(path)`` may put an old
        file at ``path`` to write over, cut to length after ([Note: spare tier files] in tiered/spares.py)."""
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        over = recycle is not None and recycle(path)
        with open(path, "r+b" if over else "wb") as f:
            # [Note: early writeback]; without the fsync, no writeback is asked for (progress is still told).
            stream = writeback.WritebackStream(f, tuning.writeback_bytes if tuning.fsync else NEVER,
                                               tuning.drop_behind and tuning.fsync, progress)
            write(stream)  # type: ignore[arg-type]
            if over:
                f.truncate()
            f.flush()
            if tuning.fsync:
                os.fsync(f.fileno())

    def write_whole(self, path: str, write_at: Callable[[str], None]) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        replace_whole(path, write_at)

    def publish(self, path: str, payload: bytes) -> None:
        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())

        replace_whole(path, write)

    def link(self, target: str, link: str) -> None:
        relative = os.path.relpath(target, os.path.dirname(link))
        replace_whole(link, lambda tmp: os.symlink(relative, tmp))

    def remove_leftover_temporaries(self, path: str) -> None:
        for leftover in glob.glob(f"{glob.escape(path)}.tmp-*"):
            with suppress(OSError):
                os.remove(leftover)

    @contextmanager
    def local_directory(self, path: str) -> Iterator[str]:
        yield path

    def preflight(self, path: str, directory: str) -> BaseException | None:
        probe = f"{directory}/.lightning_zero-probe-{uuid.uuid4().hex[:8]}"
        try:
            os.makedirs(directory, exist_ok=True)
            with open(probe, "wb"):
                pass
            os.remove(probe)
        except OSError as exc:
            return exc
        return None

    def hint(self, failure: Failure) -> str:
        if failure is Failure.PERMISSION:
            return "permission denied: give this user write access to the directory or point the checkpoint elsewhere"
        if failure is Failure.MISSING:  # a file of a damaged checkpoint, said by the caller
            return super().hint(Failure.OTHER)
        return super().hint(failure)

    def dcp_writer(self, wrap: Callable[[type], type], directory: str, tuning: CheckpointTuning) -> Any:
        import torch.distributed.checkpoint as dcp

        written = wrap(dcp.FileSystemWriter)(directory, sync_files=tuning.fsync, thread_count=tuning.write_threads)
        if tuning.fsync:
            written.fs = writeback.WritebackFileSystem(written.fs, tuning)  # [Note: early writeback]
        return written

    def dcp_reader(self, wrap: Callable[[type], type], directory: str) -> Any:
        import torch.distributed.checkpoint as dcp

        return wrap(dcp.FileSystemReader)(directory)


_LOCAL = LocalStore()
