"""One file written or read whole, on a local disk or an object store: ``torch.save`` streamed to
storage (fsynced locally; one multipart upload remotely), ``torch.load`` with ``weights_only`` from a
memory map or a stream, the probe that finds an unwritable path before a save writes anything, and
the checks that a committed checkpoint's version directory exists.

What differs between stores (fsync or a completed upload, a rename or one PUT, a memory map or a stream) is the
store's own ([Note: storage seam] in backend.py).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch

from lightning_zero import _compat
from lightning_zero.checkpoint.store import storage
from lightning_zero.checkpoint.store.storage import CheckpointCorruptError, Location, version_dir_of
from lightning_zero.checkpoint.store.tuning import DEFAULT_TUNING, CheckpointTuning


def preflight(loc: Location, directory: str | None, rank: int) -> str | None:
    """This rank's reason it cannot write ``loc`` into ``directory`` (a read-only or refused path, a missing bucket),
    found before any checkpoint data is written; None when it can (``Store.preflight``) or writes nothing
    (``directory`` None: the mode's ``write_directory``)."""
    if directory is None:
        return None
    exc = loc.store.preflight(loc.path, directory)
    if exc is None:
        return None
    return f"rank {rank}: cannot write {directory!r}: {storage.storage_error(loc, 'write', exc)}"


def discard(loc: Location, version_dir: str) -> None:
    try:
        loc.store.rm(version_dir, recursive=True)
    except Exception:  # a partial version directory is harmless: nothing points at it
        pass


def torch_save_to(loc: Location, path: str, obj: Any, tuning: CheckpointTuning = DEFAULT_TUNING,
                  whole: bool = False, progress: Callable[[int], None] | None = None,
                  recycle: Callable[[str], bool] | None = None, record_crcs: bool = True) -> None:
    """Stream ``torch.save`` straight to storage (no second in-memory copy of the bytes).

    ``whole``: the file appears whole or not at all (a file that is itself the commit, as a ``full`` checkpoint
    is). Object stores: one multipart upload that completes at close; a partial upload left by a failure is
    never referenced (the marker is written last). ``progress``, ``recycle`` and ``record_crcs``: see
    :func:`write_file`.
    """
    if whole:
        loc.store.write_whole(path, lambda target: write_file(loc, target, obj, tuning, None, None, record_crcs))
        return
    write_file(loc, path, obj, tuning, progress, recycle, record_crcs)


def write_file(loc: Location, path: str, obj: Any, tuning: CheckpointTuning = DEFAULT_TUNING,
               progress: Callable[[int], None] | None = None, recycle: Callable[[str], bool] | None = None,
               record_crcs: bool = True) -> None:
    """``torch.save(obj)`` into ``path`` through the store's ``Store.write_file``: every checkpoint file this
    package writes with ``torch.save`` passes here. Local disks: ``progress`` is told how far the bytes are in
    the kernel (:class:`~lightning_zero.checkpoint.store.writeback.WritebackStream`); ``recycle(path)`` may put an
    old file at ``path`` to write over, cut to length after ([Note: spare tier files] in tiered/spares.py).
    ``record_crcs=False``: the zip records carry no CRC32 of their own, for a file whose tensors the caller's
    integrity header checks already ([Note: one checksum pass] in modes/local.py)."""
    loc.store.write_file(path, lambda stream: _save_keeping_write_errors(obj, stream, record_crcs), tuning,
                         progress=progress, recycle=recycle)


class _WriteErrorKeeper:
    """A file wrapper that remembers the first error of ``write``.

    torch.save's C++ zip writer swallows the Python exception of a failed ``write`` and reports only
    "[enforce fail at inline_container.cc] unexpected pos" (seen on a full tmpfs): the real cause
    (ENOSPC, a refused upload) is re-raised from here instead."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        try:
            return self._raw.write(data)
        except BaseException as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def _save_keeping_write_errors(obj: Any, f: Any, record_crcs: bool = True) -> None:
    keeper = _WriteErrorKeeper(f)
    save = torch.save if record_crcs else _compat.torch_save_without_record_crcs
    try:
        save(obj, keeper)
    except Exception as exc:
        if keeper.error is not None:
            raise keeper.error from exc
        raise



def torch_load(loc: Location, path: str, weights_only: bool = True) -> Any:
    """One ``torch.save`` file, on CPU, without a second copy of its bytes: a local file is memory-mapped
    (tensors are paged in as they are copied into the state), a remote one is deserialized straight from
    the stream (``full`` files are a whole model). ``weights_only=False`` (a caller who trusts the file:
    ``trainer.fit(..., weights_only=False)``) unpickles any object it holds; the default refuses them."""
    try:
        data: Any = loc.store.mappable(path) or loc.store.open_read(path)
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(
            f"Checkpoint {loc.url!r} is committed but {path!r} is missing; the checkpoint is damaged, resume"
            " from another one."
        ) from exc
    except Exception as exc:
        raise storage.storage_error(loc, "read", exc) from exc
    try:
        if isinstance(data, str):
            try:
                return torch.load(data, map_location="cpu", weights_only=weights_only, mmap=True)
            except (RuntimeError, OSError):
                # Not mappable (the legacy format, an empty or truncated file): read it whole, which
                # reports a damaged file as such below.
                return torch.load(data, map_location="cpu", weights_only=weights_only)
        with data:
            return torch.load(data, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        raise CheckpointCorruptError(storage.refused_pickle(loc.url, f"file {path!r}", exc)) from None
    except OSError as exc:
        if not isinstance(data, str):  # a stream: the store, not the file, failed mid-read
            raise storage.storage_error(loc, "read", exc) from exc
        error: Exception = exc
    except Exception as exc:
        error = exc
    raise CheckpointCorruptError(
        f"Could not read {path!r} of checkpoint {loc.url!r} ({type(error).__name__}: {error}); the file is"
        " damaged or not a checkpoint. Resume from another checkpoint."
    ) from error


def existing_version_dir(loc: Location, marker: dict[str, Any]) -> str:
    version_dir = version_dir_of(loc, marker)
    try:
        exists = loc.store.exists(version_dir) or bool(loc.store.ls(version_dir))
    except FileNotFoundError:
        exists = False
    except Exception as exc:
        raise storage.storage_error(loc, "read", exc) from exc
    if not exists:
        raise CheckpointCorruptError(
            f"Checkpoint {loc.url!r} is committed but the data version it points at, {version_dir!r}, is missing;"
            " the checkpoint is damaged. Resume from another checkpoint."
        )
    return version_dir
