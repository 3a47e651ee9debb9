"""DCP's storage writers and readers for a checkpoint location: the store's own (``Store.dcp_writer`` and
``Store.dcp_reader``: DCP's file system ones fsynced with early writeback on a local disk, its fsspec ones on
object stores, s3torchconnector's file system over its client), wrapped with this package's checksums and
parallel reads."""

from __future__ import annotations

from typing import Any

from lightning_zero.checkpoint.dcp import integrity as dcp_integrity
from lightning_zero.checkpoint.dcp.adapter import parallel_reads
from lightning_zero.checkpoint.store.storage import Location
from lightning_zero.checkpoint.store.tuning import CheckpointTuning


def writer(loc: Location, version_dir: str, save_id: str, tuning: CheckpointTuning) -> Any:
    """A checksumming DCP writer of ``version_dir`` with ``tuning.write_threads`` files per rank."""
    return loc.store.dcp_writer(lambda base: dcp_integrity.checksumming_writer(base, save_id, loc.store.abort),
                                version_dir, tuning)


def reader(loc: Location, version_dir: str, require_checksums: bool, threads: int) -> Any:
    """A verifying DCP reader of ``version_dir`` reading with ``threads`` threads."""

    def require() -> bool:
        return require_checksums

    return loc.store.dcp_reader(
        lambda base: parallel_reads(dcp_integrity.verifying_reader(base, loc.url, require), threads), version_dir)
