"""The checksum of a ``sharded`` item that ``torch.save`` wrote with record CRC32s: a digest of its zip directory
([Note: why our own checksums] in formats/integrity.py), found from the zip's end records."""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from typing import Any

ZIP_RECORDS = "zip-records"
"""First element of a ``sharded`` item's checksum when it is the digest of its zip directory."""


_END = struct.Struct("<4s4H2LH")  # the end of central directory record (22 bytes)
_END64_LOCATOR_SIZE = 20
_END64 = struct.Struct("<4sQ2H2L4Q")  # the zip64 end of central directory record (56 bytes)


def directory_start(tail: bytes) -> int | None:
    """Where the central directory of the zip ending ``tail`` starts in ``tail``, read from its end records
    as ``zipfile`` reads them (``ZipFile.start_dir``), zip64 ones included (``torch.save`` writes them); None
    where they are not the plain ones (a comment, zip64 extensible data, a directory cut off)."""
    end = len(tail) - _END.size
    if end < 0 or tail[end:end + 4] != b"PK\x05\x06":
        return None
    _, _, _, _, _, size, _, comment = _END.unpack_from(tail, end)
    if comment:
        return None
    location = end
    locator = end - _END64_LOCATOR_SIZE
    if locator >= 0 and tail[locator:locator + 4] == b"PK\x06\x07":
        location = locator - _END64.size
        if location < 0 or tail[location:location + 4] != b"PK\x06\x06":
            return None
        size = _END64.unpack_from(tail, location)[8]
    start = location - size
    return start if start >= 0 and tail[start:start + 4] == b"PK\x01\x02" else None


def directory_digest(tail: bytes) -> tuple[str, int] | None:
    """(:data:`ZIP_RECORDS`, CRC32 of the central directory and end records) of the ``torch.save``
    zip whose end is ``tail`` (``zipfile`` accepts a zip whose beginning is cut off); None if
    ``tail`` does not hold the whole directory (the writer then refuses to save unchecked). The end
    records are read directly where they are plain (:func:`directory_start`: a parse of the whole
    directory per item was a tenth of a ``sharded`` save of thousands of small items), else by ``zipfile``."""
    start = directory_start(tail)
    if start is not None:
        return directory_checksum(memoryview(tail)[start:])
    try:
        with zipfile.ZipFile(io.BytesIO(tail)) as archive:
            return directory_checksum(memoryview(tail)[archive.start_dir:])
    except Exception:  # noqa: BLE001 - whatever zipfile raises: not a directory we can digest
        return None


def directory_checksum(directory: Any) -> tuple[str, int]:
    """The checksum ``.metadata`` records for an item whose zip directory and end records are ``directory``."""
    return ZIP_RECORDS, zlib.crc32(directory)


def item_intact(data: bytes, expected: Any) -> bool:
    """Whether a ``sharded`` item's bytes match the checksum ``.metadata`` recorded for it."""
    if isinstance(expected, tuple) and expected[:1] == (ZIP_RECORDS,):
        return _zip_item_intact(data, expected[1])
    return zlib.crc32(data) == expected


def _zip_item_intact(data: bytes, digest: int) -> bool:
    """Whether the directory of the ``torch.save`` zip ``data`` is the one that was written (the
    writer's :func:`directory_digest`: every byte of it, so no field torch reads can change) and
    every record has the CRC32 the directory gives."""
    if directory_digest(data) != (ZIP_RECORDS, digest):
        return False
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return archive.testzip() is None
    except Exception:  # noqa: BLE001 - a damaged record, whatever zipfile makes of it
        return False
