"""Integrity inside DCP's files (``sharded`` mode): the per-item checksums written with each item and
checked before DCP deserializes it, the failure handling of DCP's writer threads, and ``.metadata``
read with a restricted unpickler. [Note: why our own checksums] in integrity.py says what is checked.
"""

from __future__ import annotations

import io
import pickle
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch

from lightning_zero import _compat
from lightning_zero.checkpoint.dcp import items
from lightning_zero.checkpoint.dcp.zip_records import directory_digest, item_intact
from lightning_zero.checkpoint.formats import integrity
from lightning_zero.checkpoint.runtime.process import gc_paused
from lightning_zero.checkpoint.store.storage import CheckpointCorruptError


class _ChecksummingStream:
    """A data file's write stream that splits what passes through into segments at every ``tell()``
    (unless ``segments`` is None: ``checksums_disabled()``), records a failed write in ``errors``
    and stops writing once any file of the save has failed ([Note: parallel writes] in dcp/adapter.py).

    DCP's ``_write_item`` calls ``tell()`` right before and right after each item, so the segments
    between consecutive ``tell()`` calls are exactly the items; their CRCs are kept by start offset.

    [Note: coalesced item writes] ``torch.save`` hands an item to its stream in about 40 writes (each zip
    record's header, data and padding), and DCP flushes the stream after every item: for a 16 KB item, 40
    calls through the file's wrappers and a system call or two. Writes smaller than :data:`_LARGE_WRITE` are
    gathered here and reach the file in runs of at least that size; ``flush`` (DCP's, after each item) leaves
    them gathered. Everything gathered reaches the file before ``fileno()`` (the fsync that follows the
    items: DCP calls it before the stream closes) and before the stream is closed (``finish``), and a
    failure to write it is this file's failure as any other write's. ``tell()`` counts what was handed in."""

    def __init__(self, raw: Any, segments: dict[tuple[int, int], Any] | None, errors: list[BaseException],
                 abort: Callable[[Any], None], own_crc: bool = True) -> None:
        self._raw = raw
        self._abort = abort
        self._segments = segments  # (offset, length) -> crc32, or the zip directory's digest
        self._errors = errors
        self._own_crc = own_crc
        self._start = 0
        self._position = 0
        self._crc = 0
        self._tail: list[bytes] = []  # the small writes since the last large one (the zip directory)
        self._gathered: list[bytes] = []  # small writes not yet in the file ([Note: coalesced item writes])
        self._gathered_bytes = 0
        self._closed = False

    def _stop_if_abandoned(self) -> None:
        if self._errors:  # another file of this save failed: the save is lost, give this one up
            self._abort(self._raw)
            raise SaveAbandoned(f"stopped writing: another file of this save failed first ({self._errors[0]})")

    def write(self, data: Any) -> int:
        self._stop_if_abandoned()
        view = memoryview(data).cast("B")
        count = len(view)
        if count < _LARGE_WRITE:
            small = bytes(view)  # the caller may reuse its buffer once this returns
            self._gathered.append(small)
            self._gathered_bytes += count
            if self._gathered_bytes >= _LARGE_WRITE:
                self._write_gathered()
        else:
            self._write_gathered()
            self._write_raw(view)
        if self._segments is not None:  # checksums_disabled(): no segments
            if self._own_crc:
                self._crc = zlib.crc32(view, self._crc)
            elif count >= _LARGE_WRITE:
                self._tail.clear()
            else:
                self._tail.append(small)
        self._position += count
        return count

    def _write_raw(self, data: Any) -> None:
        try:
            written = self._raw.write(data)
            while written is not None and written < len(data):  # a raw stream may take part of it
                if written <= 0:
                    raise OSError(f"the checkpoint file took none of the {len(data)} bytes written to it")
                data = memoryview(data)[written:]
                written = self._raw.write(data)
        except BaseException as exc:
            # torch.save's zip writer swallows this and raises "unexpected pos": keep the real cause.
            self._errors.append(exc)
            raise

    def _write_gathered(self) -> None:
        if self._gathered:
            run = b"".join(self._gathered)
            self._gathered.clear()
            self._gathered_bytes = 0
            self._write_raw(run)

    def tell(self) -> int:
        if self._segments is not None and self._position > self._start:
            self._segments[(self._start, self._position - self._start)] = self._crc if self._own_crc else (
                directory_digest(b"".join(self._tail)))
        self._start, self._crc = self._position, 0
        self._tail.clear()
        return self._position

    def write_item(self, parts: tuple[Any, ...], checksum: Any) -> int:
        """Write one whole item, ``parts`` in turn, and record ``checksum``, computed by the caller from these very
        bytes ([Note: many small items] in dcp/items.py). Parts are gathered uncopied: they stay unchanged until
        the stream is finished (a save's buffers and tensors, which nothing writes meanwhile). Returns the offset."""
        self._stop_if_abandoned()
        start = self.tell()
        for part in parts:
            count = len(part)
            if count < _LARGE_WRITE:
                self._gathered.append(part)  # unchanged until it reaches the file, as said above
                self._gathered_bytes += count
            else:
                self._write_gathered()
                self._write_raw(part)
            self._position += count
        if self._gathered_bytes >= _LARGE_WRITE:
            self._write_gathered()
        if self._segments is not None:
            self._segments[(start, self._position - start)] = checksum
        self._start = self._position
        return start

    def flush(self) -> None:
        """DCP's flush after each item: the gathered writes stay gathered ([Note: coalesced item writes])."""

    def fileno(self) -> int:
        """The file's descriptor, for the fsync: everything written is in the kernel first."""
        self.finish()
        return int(self._raw.fileno())

    def finish(self) -> None:
        """Everything written through this stream into the file and the file's own buffer flushed; the file
        given up instead if another file of the save failed (it must not complete, on S3 an upload)."""
        if not self._closed:
            self._stop_if_abandoned()
            self._write_gathered()
            self._raw.flush()

    def close(self) -> None:
        """(DCP, after the fsync or in its place) The gathered writes into the file, then the file closed."""
        self.finish()  # a failure leaves the file open: create_stream gives it up (Store.abort), not close
        self._closed = True
        self._raw.close()

    def __getattr__(self, name: str) -> Any:  # the real stream's other methods
        return getattr(self._raw, name)


class SaveAbandoned(RuntimeError):
    """A data file whose writing stopped because another file of the same save had failed (its
    error is the one the save raises): on S3 the other writer thread would otherwise upload the
    rest of its half of the shard for a save that is already lost."""


class _FailedStream:
    """Stands for a data file that could not be created: every use raises its error again."""

    def __init__(self, error: BaseException) -> None:
        self._error = error

    def __getattr__(self, name: str) -> Any:
        raise OSError(f"this checkpoint file could not be created: {self._error}") from self._error


class _ChecksummingFileSystem:
    """Wraps a DCP writer's file system so that every data file it creates is checksummed per item
    (unless ``checksums_disabled()``), and its failures are kept ([Note: parallel writes])."""

    def __init__(self, inner: Any, abort: Callable[[Any], None]) -> None:
        self._inner = inner
        self._abort = abort
        self.segments: dict[str, dict[tuple[int, int], Any]] = {}
        self.errors: list[BaseException] = []
        self.keep_errors = False
        """While set (``write_data`` of the data files), a stream's failure is recorded, not raised."""

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "w" not in mode or not self.keep_errors:  # reads; .metadata (finish()): failures raised as they come
            with self._inner.create_stream(path, mode) as stream:
                yield stream
            return
        # [Note: parallel writes] in dcp/adapter.py: raised here, a failure would end a DCP writer
        # thread silently, or end the calling thread's part while the others still write. It is
        # kept instead, and write_data raises it once every thread is done.
        opened = False
        try:
            with self._inner.create_stream(path, mode) as stream:
                opened = True
                segments: dict[tuple[int, int], Any] | None = None  # checksums_disabled(): none
                if integrity.checksums_enabled():
                    segments = self.segments[str(path).replace("\\", "/").rsplit("/", 1)[-1]] = {}
                try:
                    # torch.save reads the same setting when it writes the item: no record CRCs, then our own.
                    checksumming = _ChecksummingStream(stream, segments, self.errors, self._abort,
                                                       own_crc=not _compat.crc32_in_torch_save())
                    yield checksumming
                    checksumming.finish()  # [Note: coalesced item writes]: before the file closes
                except BaseException:  # the file is lost, whatever failed (a write, the fsync, an item, another
                    self._abort(stream)  # file: SaveAbandoned): its close must not complete an upload
                    raise
                return
        except (Exception, KeyboardInterrupt, SystemExit) as exc:  # noqa: BLE001 - kept, raised by write_data
            if not any(exc is seen for seen in self.errors):
                self.errors.append(exc)
            if not isinstance(exc, Exception):  # an interrupt goes on up; the other files stop at their next write
                raise
        if not opened:  # the file could not be created: the caller still needs a stream to fail on
            with suppress(Exception):  # the failure on it is the one already kept
                yield _FailedStream(self.errors[-1])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def checksumming_writer(base: type, save_id: str, abort: Callable[[Any], None]) -> type:
    """A subclass of DCP writer class ``base`` that records each item's CRC32 in ``.metadata``, and
    our ``save_id`` as DCP's own (``.metadata`` then names the checkpoint it belongs to); a failed file is
    given up with ``abort(stream)`` (the store's ``Store.abort``). A rank of many small items is written by
    :func:`~lightning_zero.checkpoint.dcp.items.write_items`."""

    class ChecksummingWriter(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.save_id = save_id

        def reset(self, checkpoint_id: Any = None) -> None:
            super().reset(checkpoint_id)
            self.save_id = save_id

        def write_data(self, plan: Any, planner: Any) -> Any:
            if not isinstance(self.fs, _ChecksummingFileSystem):
                self.fs = _ChecksummingFileSystem(self.fs, abort)
            self.fs.keep_errors = True
            try:
                threads = not (_compat.dcp_writes_plain_files(self) and items.writes_items_itself(plan))
                if threads:
                    future = super().write_data(plan, planner)
                else:  # [Note: many small items] in dcp/items.py: one result per item by construction
                    future = torch.futures.Future()
                    future.set_result(items.write_items(
                        lambda name: self.fs.create_stream(self.fs.concat_path(self.path, name), "wb"),
                        self.sync_files, plan, planner))
            except Exception as exc:
                if self.fs.errors:  # the storage error torch.save hid behind its own
                    raise self.fs.errors[0] from exc
                raise
            finally:
                self.fs.keep_errors = False
            if self.fs.errors:  # a stream failed: its file is incomplete or not durable
                raise self.fs.errors[0]
            results = future.wait()
            if threads:
                check_every_item_written(plan.items, results)
            for result in results if integrity.checksums_enabled() else ():
                info = result.storage_data
                crc = self.fs.segments.get(info.relative_path, {}).get((info.offset, info.length))
                if crc is None:  # DCP changed how it writes items: fail loudly rather than save unchecked
                    raise RuntimeError(
                        f"lightning_zero could not checksum item {result.index.fqn!r} of {info.relative_path!r}"
                        " (this torch version writes DCP items differently); report it with the torch version."
                    )
                info.crc32 = crc  # pickled with the record (_StorageInfo.__getstate__ keeps set fields)
            return future

    ChecksummingWriter.__name__ = ChecksummingWriter.__qualname__ = f"Checksumming{base.__name__}"
    return ChecksummingWriter


def check_every_item_written(items: list[Any], results: list[Any]) -> None:
    """Raise unless DCP's writer returned a result for every planned item: a writer thread that
    failed outside a stream leaves only a gap in the results ([Note: parallel writes] in dcp/adapter.py)."""
    written = {result.index for result in results}
    missing = [item.index.fqn for item in items if item.index not in written]
    if missing:
        raise RuntimeError(f"DCP's writer returned no result for {len(missing)} of {len(items)} items"
                           f" ({missing[:3]}): one of its writer threads failed without an error reaching"
                           " lightning_zero. The save is incomplete; the previous checkpoint is untouched. Save again.")


_LARGE_WRITE = 1 << 16
"""A write at least this large is record data; the zip directory comes in smaller ones, last."""

_METADATA_CLASSES = {
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("collections", "OrderedDict"),
    ("torch", "Size"), ("torch", "device"), ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # StorageMeta.checkpoint_id may be a path; building one runs no code.
    *((module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "WindowsPath",
                                                                            "PurePosixPath", "PureWindowsPath")),
}
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"  # dataclasses and enums only


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle: only DCP's own record classes, torch sizes/dtypes and plain
    containers may be built from it, so a crafted file cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or module == _METADATA_MODULE or (
            module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format))
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def unpickle_metadata(raw: bytes, url: str, pause_gc: bool = True) -> Any:
    """DCP's ``.metadata`` of checkpoint ``url`` from its bytes, with :class:`_MetadataUnpickler` and
    the collector paused ([Note: no collections while planning] in dcp/adapter.py: 1.2M records at
    1024 ranks); a clear error when the bytes are not DCP metadata."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    try:
        with gc_paused(pause_gc):
            metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except MemoryError:  # this rank's memory, not the file
        raise
    except Exception as exc:
        raise CheckpointCorruptError(
            f"'.metadata' of checkpoint {url!r} is not valid DCP metadata ({type(exc).__name__}: {exc});"
            " the file is damaged or was crafted. Resume from another checkpoint."
        ) from exc
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def verifying_reader(base: type, url: str, require: Callable[[], bool]) -> type:
    """A subclass of DCP reader class ``base`` that reads ``.metadata`` with a restricted unpickler
    and checks each item's CRC32 before DCP deserializes it. ``require()`` says whether an item
    without a CRC is an error (True once the objects file says the save recorded them)."""

    class VerifyingReader(base):  # type: ignore[misc, valid-type]
        _items: dict[tuple[str, int], str]

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._metadata_read: dict[str, Any] = {}  # path -> what read_metadata unpickled there
            self.shared_metadata: Any = None
            """``.metadata`` as the coordinator read it for every rank, unpickled ([Note: shared
            metadata] in opening.py): used instead of reading the file."""

        def metadata_bytes(self, rank: int | None = None) -> bytes:
            """The raw bytes of ``.metadata`` (DCP's per-rank one for ``rank``), read from storage."""
            with self.fs.create_stream(_compat.dcp_metadata_path(self, rank), "rb") as stream:
                return stream.read()

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            path = _compat.dcp_metadata_path(self, rank)
            # Read once per reader: the load checks it (save id, keys) before DCP asks for it again,
            # and at 1024 ranks it is ~110 MB (bench/scale.py).
            metadata = self._metadata_read.get(str(path))
            if metadata is None:
                metadata = self.shared_metadata if rank is None else None
                if metadata is None:
                    metadata = unpickle_metadata(self.metadata_bytes(rank), url)
                self._metadata_read[str(path)] = metadata
            metadata.storage_meta.load_id = self.load_id  # DCP's reset() gives every load its own
            return metadata

        def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            self._items = {(info.relative_path, info.offset): index.fqn for index, info in self.storage_data.items()}

        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            if getattr(sinfo, "crc32", None) is None and not require():
                return super()._slice_file(file, sinfo)  # saved inside checksums_disabled()
            name = f"{sinfo.relative_path!r} (tensor {self._items.get((sinfo.relative_path, sinfo.offset))!r})"
            file.seek(sinfo.offset)
            data = file.read(sinfo.length)
            if len(data) != sinfo.length:
                raise CheckpointCorruptError(
                    f"{name} of checkpoint {url!r} is truncated: {len(data)} of {sinfo.length} bytes. Resume from"
                    " another checkpoint."
                )
            expected = getattr(sinfo, "crc32", None)
            if expected is None and require():
                raise CheckpointCorruptError(f"{name} of checkpoint {url!r} has no checksum in '.metadata'; the"
                                             " metadata was replaced. Resume from another checkpoint.")
            if not item_intact(data, expected):
                raise CheckpointCorruptError(
                    f"Checksum mismatch in {name} of checkpoint {url!r}: its data changed after it was written (a"
                    " damaged disk or transfer). Resume from another checkpoint."
                )
            return io.BytesIO(data)

    VerifyingReader.__name__ = VerifyingReader.__qualname__ = f"Verifying{base.__name__}"
    return VerifyingReader
