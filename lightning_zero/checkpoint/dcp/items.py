"""A rank's DCP data file of many small items, written by this package instead of DCP's writer threads.

[Note: many small items] DCP writes each tensor as its own item: a ``torch.save`` into the file, whose
pickling, zip records and bookkeeping are Python that holds the GIL, about as long for a 16 KB item as
for a 1 MB one. A rank of thousands of small items (a deep model's masters and moments) is bound by that
Python, not by its bytes. Where a rank's items are many and small (staging's rule,
:func:`~lightning_zero.checkpoint.runtime.staging.many_small`), :func:`write_items` writes them itself:

- into one file, on the calling thread: DCP's second writer thread only contends for the GIL there
  (its gain, [Note: parallel writes] in adapter.py, is overlap of serialization and disk on large items);
- each tensor item as the bytes ``torch.save`` writes for it, from a template: ``torch.save`` of a
  tensor of one dtype and shape gives the same zip every time except for the data record, its CRC32
  (when torch writes record CRCs) and the file's random ``serialization_id`` (which ``torch.load``
  only logs: items of one template share theirs). The template is one ``torch.save`` per dtype and shape,
  kept across saves as the zip before and after the data; an item is the head, the tensor's own bytes and
  the tail, with the CRC32s put in. ``torch.load`` and DCP's own readers read the item as any other; the
  ``.metadata`` records are the ones DCP's writer makes. A tensor no template describes (not a plain
  contiguous CPU tensor, or larger than :data:`TEMPLATE_MAX_BYTES`) is written by ``torch.save`` as DCP
  would, and a plan of many distinct shapes (fewer than :data:`MIN_USES_PER_TEMPLATE` items a template)
  goes to DCP's writer.

Each item is handed to the checksumming stream whole, with the checksum its template computes
(``_ChecksummingStream.write_item`` in dcp/integrity.py). The save runs with the collector paused
([Note: the collector and a save's objects] in saver.py) and through ``_compat.dcp_save_tensors``, DCP's
protocol without its walk for ``Stateful`` values and without the broadcast of ``.metadata`` to every rank. BENCHMARKS.md ("sharded saves of many small tensors") has the figures.
"""

from __future__ import annotations

import functools
import io
import os
import struct
import zipfile
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_zero import _compat
from lightning_zero.checkpoint.dcp.adapter import chunk_bytes
from lightning_zero.checkpoint.dcp.zip_records import directory_checksum, directory_start
from lightning_zero.checkpoint.runtime.staging import many_small

_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # a zip local file header (30 bytes)
_CENTRAL_HEADER = struct.Struct("<4s6H3L5H2L")  # a zip central directory entry (46 bytes)
_CRC = struct.Struct("<L")
TEMPLATE_MAX_BYTES = 1 << 20
"""A tensor item larger than this is written by ``torch.save`` (its template would cost a tensor's worth of
zeros to make, for a pickle whose cost is small beside its bytes)."""
MIN_USES_PER_TEMPLATE = 4
"""A plan is written here only where its items share templates: at least this many items per distinct dtype and
shape (a template costs about two ``torch.save`` calls to make)."""


def writes_items_itself(plan: Any) -> bool:
    """Whether :func:`write_items` writes this rank's ``plan`` (DCP's ``SavePlan``): many small tensor items
    ([Note: many small items]) of few dtypes and shapes; otherwise DCP's writer does."""
    tensors = [item for item in plan.items if item.tensor_data is not None]
    if not many_small(len(tensors), sum(chunk_bytes(item) for item in tensors)):
        return False
    kinds = {(item.tensor_data.properties.dtype, tuple(item.tensor_data.chunk.sizes)) for item in tensors}
    return len(kinds) * MIN_USES_PER_TEMPLATE <= len(tensors)


class _Template:
    """``torch.save`` of one dtype and shape, cut around its data record: the zip before the data (``head``)
    and after it (``tail``), and where the data record's CRC32 sits in each."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], with_crcs: bool) -> None:
        self.with_crcs = with_crcs  # the thread's torch.save setting, which the torch.save below follows too
        sample = torch.zeros(shape, dtype=dtype)
        buffer = io.BytesIO()
        torch.save(sample, buffer)
        blob = buffer.getvalue()
        nbytes = sample.numel() * sample.element_size()
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            records = [info for info in archive.infolist() if info.filename.endswith("/data/0")]
            if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED:
                raise ValueError("torch.save wrote a tensor differently from the zip this template expects")
            record = records[0]
            directory = archive.start_dir
        local = _LOCAL_HEADER.unpack_from(blob, record.header_offset)
        data_start = record.header_offset + _LOCAL_HEADER.size + local[9] + local[10]
        self.head = blob[:data_start]
        self.tail = blob[data_start + nbytes:]
        self.head_crc = record.header_offset + 14
        self.tail_crc = _central_crc_field(blob, directory, record.filename) - data_start - nbytes
        self.directory = directory - data_start - nbytes  # where the zip directory starts in ``tail``
        if self.directory < 0 or directory_start(self.tail) != self.directory:
            raise ValueError("torch.save wrote a zip directory this template cannot find")

    def parts(self, data: memoryview) -> tuple[bytes | bytearray, bytes | bytearray]:
        """(head, tail) of the zip for ``data``: with its CRC32 put in where torch writes record CRCs."""
        if not self.with_crcs or not len(data):
            return self.head, self.tail
        crc = zlib.crc32(data)
        head, tail = bytearray(self.head), bytearray(self.tail)
        _CRC.pack_into(head, self.head_crc, crc)
        _CRC.pack_into(tail, self.tail_crc, crc)
        return head, tail

    def checksum(self, head: Any, data: memoryview, tail: Any) -> Any:
        """The item's checksum in ``.metadata`` (what the checksumming stream would find for these bytes): the
        digest of the zip directory where the records carry CRC32s, else the CRC32 of the whole item."""
        if self.with_crcs:
            return directory_checksum(memoryview(tail)[self.directory:])
        return zlib.crc32(tail, zlib.crc32(data, zlib.crc32(head)))


def _central_crc_field(blob: bytes, offset: int, name: str) -> int:
    """Offset in ``blob`` of the CRC32 field of the central directory entry of record ``name``."""
    while blob[offset:offset + 4] == b"PK\x01\x02":
        entry = _CENTRAL_HEADER.unpack_from(blob, offset)
        name_length, extra_length, comment_length = entry[10], entry[11], entry[12]
        start = offset + _CENTRAL_HEADER.size
        if blob[start:start + name_length].decode() == name:
            return offset + 16
        offset = start + name_length + extra_length + comment_length
    raise ValueError(f"torch.save's zip has no directory entry for {name!r}")


@functools.lru_cache(maxsize=1024)
def _template(dtype: torch.dtype, shape: tuple[int, ...], with_crcs: bool, alignment: int) -> _Template:
    """The template of ``dtype`` and ``shape`` under torch's save settings (``with_crcs``, ``alignment``: the
    calling thread's, which the ``torch.save`` here reads too); kept across saves (a head and tail each, about
    1 KB)."""
    return _Template(dtype, shape, with_crcs)


def write_tensor(stream: Any, tensor: Tensor, with_crcs: bool, alignment: int) -> None:
    """Write ``tensor`` as ``torch.save`` would into ``stream``: the template's head, the tensor's own bytes, the
    tail; by ``torch.save`` itself where no template describes it ([Note: many small items]). A stream with
    ``write_item`` (the checksumming stream of dcp/integrity.py) takes the item whole, with its checksum."""
    tensor = tensor.detach()
    if not _plain(tensor):
        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()  # as DCP's loader does: a view would save its whole storage
        torch.save(tensor, stream)
        return
    data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
    template = _template(tensor.dtype, tuple(tensor.shape), with_crcs, alignment)
    head, tail = template.parts(data)
    write_item = getattr(stream, "write_item", None)
    if write_item is not None:
        write_item((head, data, tail), template.checksum(head, data, tail))
        return
    stream.write(head)
    stream.write(data)
    stream.write(tail)


def _plain(tensor: Tensor) -> bool:
    return (type(tensor) is Tensor and tensor.device.type == "cpu" and tensor.layout == torch.strided
            and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()
            and not tensor.is_quantized and tensor.numel() * tensor.element_size() <= TEMPLATE_MAX_BYTES)


def write_items(create_stream: Callable[[str], Any], sync_files: bool, plan: Any, planner: Any) -> list[Any]:
    """(each rank) Write ``plan``'s items into one data file, opened by ``create_stream(name)`` (the
    checksumming file system's, of a DCP file-system writer), in DCP's order (bytes first), and return DCP's
    ``WriteResult`` s; ``sync_files``: fsync it, as DCP's writer does."""
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    with_crcs, alignment = _compat.crc32_in_torch_save(), _compat.storage_alignment()
    file_name = _compat.dcp_data_file_name(plan, 0)
    ordered = sorted(plan.items, key=lambda item: item.type != WriteItemType.BYTE_IO)
    results = []
    storage_info = _compat.dcp_storage_info_type()
    with create_stream(file_name) as stream:
        for item in ordered:
            offset = stream.tell()
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                stream.write(data.getbuffer())
            else:
                write_tensor(stream, data.cpu(), with_crcs, alignment)
            length = stream.tell() - offset
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=storage_info(file_name, offset, length)))
        if sync_files:
            try:
                os.fsync(stream.fileno())
            except (AttributeError, io.UnsupportedOperation):  # a stream with no descriptor (an object store)
                os.sync()
        stream.close()
    return results
