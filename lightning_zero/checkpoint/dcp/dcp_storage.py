"""DCP's storage writers and readers for a checkpoint location: DCP's file system ones on a local disk
(fsynced, with early writeback), its fsspec ones on object stores, both wrapped with this package's
checksums and parallel reads. With :mod:`~lightning_zero.checkpoint.store.storage`, a place that tells
local from remote paths, so that the modes never do."""

from __future__ import annotations

from typing import Any

from lightning_zero import _compat
from lightning_zero.checkpoint.dcp import dcp_integrity
from lightning_zero.checkpoint.dcp.dcp_adapter import parallel_reads
from lightning_zero.checkpoint.store import writeback
from lightning_zero.checkpoint.store.storage import Location
from lightning_zero.checkpoint.store.tuning import CheckpointTuning


def writer(loc: Location, version_dir: str, save_id: str, tuning: CheckpointTuning) -> Any:
    """A checksumming DCP writer of ``version_dir`` with ``tuning.write_threads`` files per rank."""
    import torch.distributed.checkpoint as dcp

    if loc.is_local:
        written = dcp_integrity.checksumming_writer(dcp.FileSystemWriter, save_id)(
            version_dir, sync_files=True, thread_count=tuning.write_threads)
        written.fs = writeback.WritebackFileSystem(written.fs, tuning)  # [Note: early writeback]
        return written
    # fsync fails on s3fs streams: durability there comes from the completed upload.
    fsspec_writer, _ = _compat.fsspec_storage_classes()
    written = dcp_integrity.checksumming_writer(fsspec_writer, save_id)(
        loc.fs.unstrip_protocol(version_dir), sync_files=False, thread_count=tuning.write_threads,
        **_fs_options(loc))
    _same_retries(written, loc)
    return written


def reader(loc: Location, version_dir: str, require_checksums: bool, threads: int) -> Any:
    """A verifying DCP reader of ``version_dir`` reading with ``threads`` threads."""
    import torch.distributed.checkpoint as dcp

    def require() -> bool:
        return require_checksums

    if loc.is_local:
        return parallel_reads(dcp_integrity.verifying_reader(dcp.FileSystemReader, loc.url, require), threads)(
            version_dir)
    _, fsspec_reader = _compat.fsspec_storage_classes()
    read = parallel_reads(dcp_integrity.verifying_reader(fsspec_reader, loc.url, require), threads)(
        loc.fs.unstrip_protocol(version_dir), **_fs_options(loc))
    _same_retries(read, loc)
    return read


def _fs_options(loc: Location) -> dict[str, Any]:
    return dict(getattr(loc.fs, "storage_options", {}) or {})


def _same_retries(dcp_storage: Any, loc: Location) -> None:
    """DCP's fsspec reader/writer build their own filesystem from the options (a new instance when the
    cache is skipped): it gets the bounded retries of ``loc.fs`` (see [Note: bounded S3 failures])."""
    inner = getattr(getattr(dcp_storage, "fs", None), "fs", None)
    if inner is not None and hasattr(loc.fs, "retries"):
        inner.retries = loc.fs.retries
