"""Checkpoint integrity: every file says which checkpoint (and rank) it belongs to, and every tensor
carries a CRC32 computed while writing and checked while reading.

[Note: why our own checksums] ``torch.load`` does not check the CRCs of the zip it reads, and
DCP's reader does not either, so a flipped byte inside tensor data loads as a wrong number with no
error. ``zlib.crc32`` (no extra dependency; its cost is in BENCHMARKS.md) is computed once per tensor:

* ``local`` rank files and the ``full`` file: a header entry (:data:`HEADER_KEY`) inside the same
  ``torch.save``, holding the save id, the rank and world size (``local``) and, per tensor or bytes
  leaf, its CRC32, shape and dtype. The reader pops it before the state is used.
* ``sharded``: DCP's own save id in ``.metadata`` is set to ours. DCP writes each item (one rank's shard of one tensor) as a byte range of a
  ``.distcp`` file and records ``(file, offset, length)`` in ``.metadata``. Each item is a small
  ``torch.save`` zip, and torch's zip writer already computes a CRC32 of every record it stores
  (``torch.serialization.set_crc32_options``, on by default). A stream wrapper keeps the zip's
  central directory as DCP writes it (the last few small writes of the item) and stores the CRC32
  of the directory's bytes as an extra attribute of that storage record, so ``.metadata`` stays
  readable by plain DCP tools. The reader checks, before DCP deserializes an item, that the
  directory is byte for byte the one written and that every record has the CRC it gives
  (``zipfile``'s ``testzip``): a flipped byte of data fails the second, one of the directory (a
  field torch reads but ``testzip`` does not) the first, and so does a data file of another
  checkpoint. Only where torch was told not to compute record CRCs does the wrapper compute a
  CRC32 of the item's bytes itself (the first format, which readers still accept): doing so always
  checksummed every byte twice, a quarter of a background save's CPU. This works at any world
  size, because a reshard still reads whole saved items (and narrows them afterwards).

The save id ties the parts together: the commit marker names it, every ``local`` rank file and the
``sharded`` objects file repeat it, and the objects file also records DCP's own save id, which
``.metadata`` carries. So a file of another checkpoint, of another rank, or ``.metadata`` copied from
another save is refused, naming the file.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from lightning_zero.checkpoint.formats.tree import refuse_other_shape, walk
from lightning_zero.checkpoint.store.storage import CheckpointCorruptError

_CHECKSUMS = True
"""Off only in ``bench/checkpoint.py --integrity``, to measure what the checksums cost."""


def checksums_enabled() -> bool:
    """Whether saves compute checksums now (off only inside :func:`checksums_disabled`)."""
    return _CHECKSUMS


@contextmanager
def checksums_disabled() -> Iterator[None]:
    """(benchmark only) Saves inside write no CRCs; files saved so are loaded without checking them."""
    global _CHECKSUMS
    _CHECKSUMS = False
    try:
        yield
    finally:
        _CHECKSUMS = True


HEADER_KEY = "lightning_zero_integrity"
"""Top-level key of a ``local`` rank file, the ``sharded`` objects file and a ``full`` file."""

FORMAT = 1


CHUNK_BYTES = 64 * 2**10
"""A packed buffer larger than this is checksummed in chunks (a list of CRC32s): it holds thousands of tensors
([Note: packed rank files] in packed.py), and a mismatch then names the ones in the damaged chunk. Every other
tensor has one CRC32, as in every earlier file."""
MAX_CHUNKS = 32
"""At most this many chunks a tensor (the chunk a multiple of :data:`CHUNK_BYTES`): every ``zlib.crc32`` call
gives up the GIL and then waits to take it back from the training thread, so many small calls cost the
training thread more than a few long ones (a 50 MB buffer in 64 KiB chunks made 800 hand-overs a save, and
chunking every large tensor slowed a model of a few large ones, BENCHMARKS.md)."""


def _chunk_bytes(nbytes: int) -> int:
    wanted = -(-nbytes // MAX_CHUNKS)
    return max(CHUNK_BYTES, -(-wanted // CHUNK_BYTES) * CHUNK_BYTES)


def _bytes_of(value: Tensor) -> Any:
    flat = value.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    # A uint8 view reads the element bytes without a copy (bf16 included, which numpy lacks).
    return flat.contiguous().view(torch.uint8).numpy()


def crc32_of(value: Tensor | bytes) -> int:
    """CRC32 of a tensor's raw bytes (any dtype, shape or layout) or of a bytes object."""
    if isinstance(value, (bytes, bytearray)):
        return zlib.crc32(value)
    return zlib.crc32(_bytes_of(value))


def checksum_of(value: Tensor | bytes) -> int | list[int]:
    """:func:`crc32_of`, or for a tensor of more than :data:`CHUNK_BYTES` the CRC32 of each chunk."""
    if isinstance(value, (bytes, bytearray)) or value.numel() * value.element_size() <= CHUNK_BYTES:
        return crc32_of(value)
    data = _bytes_of(value)
    chunk = _chunk_bytes(len(data))
    return [zlib.crc32(data[start: start + chunk]) for start in range(0, len(data), chunk)]


def damaged_bytes(value: Tensor | bytes, expected: int | list[int]) -> tuple[int, int] | None:
    """The byte range of ``value`` whose checksum differs from ``expected`` (the first damaged chunk, or the
    whole value), None when it matches."""
    if isinstance(expected, int):
        return None if crc32_of(value) == expected else (0, len(value) if isinstance(value, (bytes, bytearray))
                                                          else value.numel() * value.element_size())
    data = _bytes_of(value)  # type: ignore[arg-type]
    chunk = _chunk_bytes(len(data))
    if len(expected) != -(-len(data) // chunk):
        return (0, len(data))
    for index, crc in enumerate(expected):
        start = index * chunk
        if zlib.crc32(data[start: start + chunk]) != crc:
            return (start, min(start + chunk, len(data)))
    return None


def _checked_leaves(tree: Any) -> Iterator[tuple[str, Tensor | bytes]]:
    for path, leaf in walk(tree):
        if isinstance(leaf, (Tensor, bytes, bytearray)):
            yield "/".join(path), leaf


def describe(tree: Any, chunked: tuple[str, ...] = (),
             leaves: Iterable[tuple[str, Tensor | bytes]] | None = None) -> dict[str, tuple[int | list[int], list[int], str]]:
    """``{path: (crc32, shape, dtype)}`` for every tensor and bytes leaf of ``tree`` (or of ``leaves``, the same
    listed by the caller: [Note: pack plans] in packed.py); tensors under a path starting with one of ``chunked``
    (packed buffers) with the CRC32 of each chunk (:func:`checksum_of`)."""
    out: dict[str, tuple[int | list[int], list[int], str]] = {}
    for key, leaf in (_checked_leaves(tree) if leaves is None else leaves):
        if isinstance(leaf, Tensor):
            crc = checksum_of(leaf) if chunked and key.startswith(chunked) else crc32_of(leaf)
            out[key] = (crc, list(leaf.shape), str(leaf.dtype).removeprefix("torch."))
        else:
            out[key] = (crc32_of(leaf), [len(leaf)], "bytes")
    return out


def header(tree: Any, save_id: str, rank: int | None = None, world_size: int | None = None,
           shapes: dict[str, list[int]] | None = None, chunked: tuple[str, ...] = (),
           leaves: Iterable[tuple[str, Tensor | bytes]] | None = None, **extra: Any) -> dict[str, Any]:
    """The integrity header for a file holding ``tree`` (computed on the staged copy, off the training thread);
    ``chunked`` and ``leaves``: see :func:`describe`."""
    return {"format": FORMAT, "save_id": save_id, "rank": rank, "world_size": world_size,
            "tensors": describe(tree, chunked, leaves) if _CHECKSUMS else None, "shapes": shapes or {}, **extra}


def split(content: Any, file: str, url: str, required: bool) -> tuple[Any, dict[str, Any] | None]:
    """``content`` without its header, and the header (None when absent and not ``required``)."""
    if isinstance(content, dict) and HEADER_KEY in content:
        content = dict(content)
        found = content.pop(HEADER_KEY)
        if not isinstance(found, dict) or found.get("format") != FORMAT:
            raise CheckpointCorruptError(
                f"{file!r} of checkpoint {url!r} has an integrity header this version cannot read; the file is"
                " damaged or from a newer lightning_zero."
            )
        return content, found
    if required:
        raise CheckpointCorruptError(
            f"{file!r} of checkpoint {url!r} has no lightning_zero integrity header: it was not written as part of"
            " this checkpoint (or is damaged). Resume from another checkpoint."
        )
    return content, None


def check_identity(found: dict[str, Any], file: str, url: str, save_id: str | None,
                   rank: int | None = None, world_size: int | None = None) -> None:
    """Refuse a file that belongs to another save, rank or world size than the marker says."""
    if save_id is not None and found.get("save_id") != save_id:
        raise CheckpointCorruptError(
            f"{file!r} belongs to another checkpoint than {url!r} (save id {found.get('save_id')!r}, the commit"
            f" marker says {save_id!r}): a file was replaced or copied from another save. Resume from another"
            " checkpoint."
        )
    for name, expected in (("rank", rank), ("world_size", world_size)):
        if expected is not None and found.get(name) != expected:
            raise CheckpointCorruptError(
                f"{file!r} of checkpoint {url!r} was written by {name} {found.get(name)!r}, expected {expected}:"
                " rank files were swapped or renamed. Resume from another checkpoint."
            )


def verify(content: Any, found: dict[str, Any], file: str, url: str,
           locate: Callable[[str, tuple[int, int]], str | None] | None = None) -> None:
    """Every checksummed leaf is present with its shape, dtype and CRC32. ``locate(key, byte range)``: the
    names of the tensors stored in that range of leaf ``key`` (a packed buffer), for the error."""
    expected: dict[str, Any] | None = found.get("tensors")
    if expected is None:  # saved inside checksums_disabled()
        return
    present = dict(_checked_leaves(content))
    for key, (crc, shape, dtype) in expected.items():
        leaf = present.get(key)
        name = key.removesuffix("/flat_shard")  # a shard is named like its tensor
        if leaf is None:
            raise CheckpointCorruptError(f"Tensor {name!r} is missing from {file!r} of checkpoint {url!r}; the file is"
                                         " damaged. Resume from another checkpoint.")
        if isinstance(leaf, Tensor):
            actual_shape, actual_dtype = list(leaf.shape), str(leaf.dtype).removeprefix("torch.")
        else:
            actual_shape, actual_dtype = [len(leaf)], "bytes"
        if actual_shape != list(shape) or actual_dtype != dtype:
            raise CheckpointCorruptError(
                f"Tensor {name!r} in {file!r} of checkpoint {url!r} is {actual_dtype}{actual_shape}, written as"
                f" {dtype}{list(shape)}; the file is damaged. Resume from another checkpoint."
            )
        damage = damaged_bytes(leaf, crc)
        if damage is not None:
            named = locate(key, damage) if locate is not None else None
            raise CheckpointCorruptError(
                f"Checksum mismatch in {named or f'tensor {name!r}'} of {file!r} (checkpoint {url!r}): its data"
                " changed after it was written (a damaged disk or transfer). Resume from another checkpoint."
            )
    unexpected = sorted(set(present) - set(expected))
    if unexpected:
        raise CheckpointCorruptError(f"{file!r} of checkpoint {url!r} holds tensors it was not written with:"
                                     f" {unexpected[:10]}. Resume from another checkpoint.")


def check_shapes(targets: dict[str, Tensor | tuple[int, ...]], saved: dict[str, list[int]], url: str) -> None:
    """Tensors of other shapes with the same element count load silently in flat form: refuse them."""
    for key, target in targets.items():
        shape = tuple(target.shape) if isinstance(target, Tensor) else tuple(target)
        if key in saved and tuple(saved[key]) != shape:
            refuse_other_shape(key, tuple(saved[key]), shape, url)
