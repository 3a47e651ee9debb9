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
  only logs). The template is one ``torch.save`` per dtype and shape; an item is the template with its
  data and CRC32s put in. ``torch.load`` and DCP's own readers read the item as any other; the
  ``.metadata`` records are the ones DCP's writer makes. A tensor the template does not describe (not a
  plain contiguous CPU tensor) is written by ``torch.save`` as DCP would.

The save also runs with the collector paused and without DCP's walk for ``Stateful`` values
(``modes/sharded.py``). BENCHMARKS.md ("sharded saves of many small tensors") has the figures.
"""

from __future__ import annotations

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
from lightning_zero.checkpoint.runtime.staging import many_small

_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # a zip local file header (30 bytes)
_CENTRAL_HEADER = struct.Struct("<4s6H3L5H2L")  # a zip central directory entry (46 bytes)
_MAX_TEMPLATES = 256


def writes_items_itself(plan: Any) -> bool:
    """Whether :func:`write_items` writes this rank's ``plan`` (DCP's ``SavePlan``): many small tensor
    items ([Note: many small items]); otherwise DCP's writer does."""
    tensors = [item for item in plan.items if item.tensor_data is not None]
    return many_small(len(tensors), sum(chunk_bytes(item) for item in tensors))


class _Template:
    """``torch.save`` of one dtype and shape, with where its data record and that record's CRC32s are."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        sample = torch.zeros(shape, dtype=dtype)
        buffer = io.BytesIO()
        torch.save(sample, buffer)
        self.bytes = buffer.getvalue()
        self.nbytes = sample.numel() * sample.element_size()
        with zipfile.ZipFile(io.BytesIO(self.bytes)) as archive:
            records = [info for info in archive.infolist() if info.filename.endswith("/data/0")]
            if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED:
                raise ValueError("torch.save wrote a tensor differently from the zip this template expects")
            record = records[0]
            directory = archive.start_dir
        local = _LOCAL_HEADER.unpack_from(self.bytes, record.header_offset)
        self.data_start = record.header_offset + _LOCAL_HEADER.size + local[9] + local[10]
        self.crc_fields = [record.header_offset + 14, self._central_crc_field(directory, record.filename)]
        self.with_crcs = record.CRC != 0  # torch wrote record CRCs (a zero tensor's CRC32 is not 0)

    def _central_crc_field(self, offset: int, name: str) -> int:
        while self.bytes[offset:offset + 4] == b"PK\x01\x02":
            entry = _CENTRAL_HEADER.unpack_from(self.bytes, offset)
            name_length, extra_length, comment_length = entry[10], entry[11], entry[12]
            start = offset + _CENTRAL_HEADER.size
            if self.bytes[start:start + name_length].decode() == name:
                return offset + 16
            offset = start + name_length + extra_length + comment_length
        raise ValueError(f"torch.save's zip has no directory entry for {name!r}")

    def fill(self, tensor: Tensor) -> tuple[memoryview, memoryview]:
        """(the zip up to the end of the data record, the rest) for ``tensor``: two writes, so the
        checksumming stream finds the zip directory in the second ([Note: coalesced item writes])."""
        out = bytearray(self.bytes)
        data_end = self.data_start + self.nbytes
        if self.nbytes:
            target = torch.frombuffer(out, dtype=torch.uint8, count=self.nbytes, offset=self.data_start)
            target.copy_(tensor.reshape(-1).view(torch.uint8))
            if self.with_crcs:
                crc = zlib.crc32(memoryview(out)[self.data_start:data_end])
                for field in self.crc_fields:
                    struct.pack_into("<L", out, field, crc)
        view = memoryview(out)
        return view[:data_end], view[data_end:]


class ItemWriter:
    """The templates of one writer ([Note: many small items]), by dtype, shape and torch's save settings."""

    def __init__(self) -> None:
        self._templates: dict[tuple[Any, ...], _Template] = {}

    def write_tensor(self, stream: Any, tensor: Tensor) -> None:
        tensor = tensor.detach()
        if not _plain(tensor):
            if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                tensor = tensor.clone()  # as DCP's loader does: a view would save its whole storage
            torch.save(tensor, stream)
            return
        key = (tensor.dtype, tuple(tensor.shape), _compat.crc32_in_torch_save(), _compat.storage_alignment())
        template = self._templates.get(key)
        if template is None:
            if len(self._templates) >= _MAX_TEMPLATES:
                self._templates.clear()
            template = self._templates[key] = _Template(tensor.dtype, tuple(tensor.shape))
        head, rest = template.fill(tensor)
        stream.write(head)
        stream.write(rest)


def _plain(tensor: Tensor) -> bool:
    return (type(tensor) is Tensor and tensor.device.type == "cpu" and tensor.layout == torch.strided
            and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()
            and not tensor.is_quantized)


def write_items(create_stream: Callable[[str], Any], sync_files: bool, plan: Any, planner: Any,
                items: ItemWriter) -> list[Any]:
    """(each rank) Write ``plan``'s items into one data file, opened by ``create_stream(name)`` (the
    checksumming file system's, of a DCP file-system writer), in DCP's order (bytes first), and return DCP's
    ``WriteResult`` s; ``sync_files``: fsync it, as DCP's writer does."""
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    file_name = _compat.dcp_data_file_name(plan, 0)
    ordered = sorted(plan.items, key=lambda item: item.type != WriteItemType.BYTE_IO)
    results = []
    with create_stream(file_name) as stream:
        for item in ordered:
            offset = stream.tell()
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                stream.write(data.getbuffer())
            else:
                items.write_tensor(stream, data.cpu() if data.device.type != "cpu" else data)
            length = stream.tell() - offset
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=_compat.dcp_storage_info(file_name, offset, length)))
        if sync_files:
            try:
                os.fsync(stream.fileno())
            except (AttributeError, io.UnsupportedOperation):  # a stream with no descriptor (an object store)
                os.sync()
        stream.close()
    return results
