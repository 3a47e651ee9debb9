"""Few large records instead of thousands: a rank file's tensors written as the flat buffers they live in.

[Note: packed rank files] ``torch.save`` pays Python for every tensor it writes (its reduce, the pickler's
``persistent_id``, one zip record), all of it holding the GIL, and so did the CRC32 per tensor: with a few
thousand small tensors (masters, two moments and a step per parameter of a deep model) a background save held
the training thread's GIL for longer than the training step took (BENCHMARKS.md, "What a save costs the loop").
The stager copies a save's tensors into one flat buffer per dtype (``staging.Stager``), so they are views of a
few storages. :func:`pack` writes each storage once, as one 1-D tensor, takes every tensor and
:class:`FlatShard` leaf out of the tree (``None`` in its place) and lists them in one JSON index (bytes):
``[path keys, buffer, offset, numel, shape, shard fields or null]`` per leaf. The integrity header then checks a few
buffers and the index, not every leaf, and ``torch.save`` writes a few records. :func:`unpack` puts the
leaves back as views of the loaded buffers. A tree whose tensors are not exactly the few storages they fill
(not staged so, or a tensor inside a tuple) is written as before; files without :data:`PACKED_KEY` (every
earlier version) read as they are.

[Note: pack plans] A background thread's Python costs the training thread more than its own CPU time: each torch
op of the training step releases the GIL and must win it back, and while the save's thread runs Python that
takes up to the interpreter's switch interval (5 ms) per op (BENCHMARKS.md, "What a save costs the loop"). So
a ``local`` save of a many-tensor tree walks the tree once, on the training thread, when it is queued
(:func:`plan`): the skeleton the file will hold, the tensors grouped by dtype in buffer order, the JSON index
(the same bytes as the previous save's when the rows are equal: a save reuses them), the bytes leaves the
integrity header checks. The background thread then only copies (:func:`fill`: one
``flatten_dense_tensors`` per dtype, which releases the GIL), checksums the buffers and pickles a skeleton
with no tensor in it: no per-leaf Python. The file is the one :func:`pack` writes from a staged tree.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_zero.checkpoint.formats.tree import FlatShard, StableDict

PACKED_KEY = "lightning_zero_packed"


Keys = tuple[Any, ...]
"""A leaf's keys from the root: str dict keys and int list indexes."""


class _NotPackable(Exception):
    pass


Stable = Callable[[StableDict, Keys], Any]
"""What a walk does with a :class:`StableDict` it meets outside tuples instead of walking it ([Note: stable
subtrees] in formats/tree.py)."""


def _skeleton(tree: Any, place: Callable[[Tensor, Keys, tuple[Any, ...] | None], None],
              other: Callable[[Any, Keys], None] | None = None, stable: Stable | None = None) -> Any:
    """``tree`` with each tensor and :class:`FlatShard` leaf handed to ``place(tensor, path, shard)`` (``shard``:
    the FlatShard's shape, rank, world_size, replicas, replica_rank; ``path`` and ``shard`` tuples of plain values,
    which the collector stops tracking, so that rows made of them may be kept) and left out as None, every other leaf to
    ``other``. Raises ``_NotPackable`` for what the packed index cannot name: a tensor inside a tuple, a dict key
    that is not exactly a str or an int.

    [Note: no closure cycles on a save's path] A recursive function nested in another refers to itself through
    its closure, a reference cycle that keeps it, and whatever its closure holds (here ``place``, and through it
    the index rows of every tensor of the tree), alive after the call until the cyclic collector finds it: at
    every save, thousands of objects that then move into the collector's oldest generation and set off a full
    collection of the process's heap every few saves (hundreds of ms, on the training thread). The walk is a
    module function, handed what it needs."""
    return _visit(tree, (), False, place, other, stable)


def _visit(node: Any, path: Keys, in_tuple: bool, place: Callable[[Tensor, Keys, tuple[Any, ...] | None], None],
           other: Callable[[Any, Keys], None] | None, stable: Stable | None = None) -> Any:
    if isinstance(node, FlatShard):
        if in_tuple:
            raise _NotPackable
        place(node.local, path, (tuple(node.shape), node.rank, node.world_size, node.replicas, node.replica_rank))
        return None
    if isinstance(node, Tensor):
        if in_tuple:
            raise _NotPackable
        place(node, path, None)
        return None
    if isinstance(node, dict):
        if stable is not None and not in_tuple and isinstance(node, StableDict):
            return stable(node, path)
        if not _JSON_KEYS.issuperset(map(type, node)):  # one C call, not a generator per dict
            raise _NotPackable
        return {key: _visit(value, (*path, key), in_tuple, place, other, stable) for key, value in node.items()}
    if isinstance(node, list):
        return [_visit(value, (*path, i), in_tuple, place, other, stable) for i, value in enumerate(node)]
    if isinstance(node, tuple):
        return tuple(_visit(value, (*path, i), True, place, other, stable) for i, value in enumerate(node))
    if other is not None:
        other(node, path)
    return node


def pack(tree: dict[str, Any]) -> dict[str, Any]:
    """``tree`` with its tensor and :class:`FlatShard` leaves moved into flat buffers under :data:`PACKED_KEY`,
    or ``tree`` as it is when its tensors are not views filling a few storages exactly."""
    buffers: list[Tensor] = []
    slots: dict[int, int] = {}  # storage address -> buffer
    rows: list[list[Any]] = []

    def place(tensor: Tensor, path: Keys, shard: tuple[Any, ...] | None) -> None:
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.is_sparse:
            raise _NotPackable
        storage = tensor.untyped_storage()
        index = slots.get(storage.data_ptr())
        if index is None:
            index = slots[storage.data_ptr()] = len(buffers)
            itemsize = tensor.element_size()
            buffers.append(torch.empty(0, dtype=tensor.dtype).set_(storage, 0, (storage.nbytes() // itemsize,)))
        elif buffers[index].dtype != tensor.dtype:
            raise _NotPackable
        rows.append([path, index, tensor.storage_offset(), tensor.numel(), list(tensor.shape), shard])

    try:
        skeleton = _skeleton(tree, place)
    except _NotPackable:
        return tree
    used = [0] * len(buffers)
    seen: set[tuple[int, int]] = set()
    for _, index, offset, numel, _, _ in rows:
        if (index, offset) not in seen:
            seen.add((index, offset))
            used[index] += numel
    if not buffers or any(u != b.numel() for u, b in zip(used, buffers)):
        return tree  # a storage holding bytes no leaf holds (a view of a larger tensor): written as before
    skeleton[PACKED_KEY] = {"buffers": buffers, "index": json.dumps(rows).encode()}
    return skeleton


def unpack(content: Any) -> Any:
    """A file's content with every leaf :func:`pack` took out back in place, as a view of its loaded buffer."""
    if not isinstance(content, dict) or PACKED_KEY not in content:
        return content
    content = dict(content)
    packed = content.pop(PACKED_KEY)
    buffers = packed["buffers"]
    for path, index, offset, numel, shape, shard in json.loads(packed["index"]):
        view = buffers[index][offset: offset + numel].view(shape)
        leaf: Any = view if shard is None else FlatShard(view, tuple(shard[0]), *shard[1:])
        container: Any = content
        for key in path[:-1]:
            container = container[key]
        container[path[-1]] = leaf
    return content


def locate(content: Any) -> Any:
    """For :func:`~lightning_zero.checkpoint.formats.integrity.verify`: the names of the leaves stored in a
    byte range of one of ``content``'s packed buffers (read before :func:`unpack`)."""
    packed = content.get(PACKED_KEY) if isinstance(content, dict) else None

    def names(key: str, damage: tuple[int, int]) -> str | None:
        prefix = f"{PACKED_KEY}/buffers/"
        if packed is None or not key.startswith(prefix):
            return None
        buffer = int(key[len(prefix):])
        itemsize = packed["buffers"][buffer].element_size()
        start, end = damage
        hit = ["/".join(str(k) for k in path) for path, index, offset, numel, _, _ in json.loads(packed["index"])
               if index == buffer and offset * itemsize < end and (offset + numel) * itemsize > start]
        shown = ", ".join(repr(name) for name in hit[:10]) + (f" and {len(hit) - 10} more" if len(hit) > 10 else "")
        return f"tensor {shown}" if len(hit) == 1 else f"tensors {shown}"

    return names


_JSON_KEYS = frozenset((str, int))  # the key types the index names (a subclass of them: the tree is staged as before)


@dataclass
class PackPlan:
    """(built on the training thread, filled on the background thread) A ``local`` rank file's layout, see
    [Note: pack plans]."""

    skeleton: dict[str, Any]  # the tree with ``None`` for each tensor and FlatShard leaf: new containers
    sources: list[list[Tensor]]  # per buffer, the live tensors in buffer order (each tensor object once)
    index: bytes  # the JSON index (see [Note: packed rank files])
    checked: list[tuple[str, bytes]]  # the skeleton's bytes leaves, by path, for the integrity header
    shard_group_size: int | None  # the world size the flat shards were split over (None: no flat shard)
    nbytes: int  # tensor bytes of the file (each tensor object once)


@dataclass
class FilledPlan:
    """A plan with its tensors copied: what the ``local`` writer writes (:func:`fill`)."""

    content: dict[str, Any]  # the skeleton with the buffers and index under :data:`PACKED_KEY`
    checked: list[tuple[str, Tensor | bytes]]  # every leaf the integrity header checks
    shard_group_size: int | None  # as :class:`PackPlan`'s (not the plan itself: it holds the live tensors)
    nbytes: int


@dataclass
class _Walked:
    """What a plan's walk of one :class:`StableDict` found, replayed by the next plan that meets the same object at
    the same place ([Note: stable subtrees] in formats/tree.py)."""

    node: StableDict  # held, so that no other object takes its id
    path: Keys
    entry: tuple[Any, ...]  # the walk's state where it entered: dtype -> buffer, buffer sizes, a shard seen
    ids: frozenset[int]  # its tensors (none was placed before it)
    skeleton: dict[str, Any]
    added: list[tuple[int, list[Tensor]]]  # per buffer, its tensors in buffer order
    exit: tuple[dict[torch.dtype, int], list[int]]  # dtype -> buffer and buffer sizes after it
    slots: dict[int, tuple[int, int]]
    rows: list[tuple[Any, ...]]
    checked: list[tuple[str, bytes]]
    shard_size: int | None  # the first flat shard's world size in it


@dataclass
class PlanMemo:
    """What a plan hands the next one: its rows and JSON index, and what it found in stable subtrees."""

    rows: list[tuple[Any, ...]]
    index: bytes
    walked: dict[int, _Walked]


def plan(tree: dict[str, Any], many_small: Callable[[int, int], bool],
         previous: PlanMemo | None = None) -> tuple[PackPlan, PlanMemo] | None:
    """(training thread) The layout of ``tree``'s packed file, and what to pass as ``previous`` to the next
    call; None where :func:`pack` would not pack (a CUDA, sparse or tuple-held tensor, a key JSON cannot name) or
    the tree is not many small tensors (``many_small(distinct tensors, their bytes)`` is False:
    ``staging.many_small``). A :class:`StableDict` met again where the previous plan met it is not walked again
    ([Note: stable subtrees] in formats/tree.py)."""
    slots: dict[int, tuple[int, int]] = {}  # id(tensor) -> (buffer, offset)
    buffer_of: dict[torch.dtype, int] = {}
    sources: list[list[Tensor]] = []
    sizes: list[int] = []
    rows: list[tuple[Any, ...]] = []
    checked: list[tuple[str, bytes]] = []
    shard_sizes: list[int] = []  # of the first flat shard, as ``tree.shard_group_size_of`` reads it

    def place(tensor: Tensor, path: Keys, shard: tuple[Any, ...] | None) -> None:
        slot = slots.get(id(tensor))
        numel = tensor.numel()
        if slot is None:
            if tensor.device.type != "cpu" or tensor.is_sparse:
                raise _NotPackable
            buffer = buffer_of.get(tensor.dtype)
            if buffer is None:
                buffer = buffer_of[tensor.dtype] = len(sources)
                sources.append([])
                sizes.append(0)
            slot = slots[id(tensor)] = (buffer, sizes[buffer])
            sources[buffer].append(tensor)
            sizes[buffer] += numel
        if shard is not None and not shard_sizes:
            shard_sizes.append(shard[2])  # the shard's world_size
        # Tuples of plain values, which the collector stops tracking: the rows are kept until the next save's plan
        # compares with them ([Note: the collector and a save's objects] in checkpoint/saver.py).
        rows.append((path, slot[0], slot[1], numel, tuple(tensor.shape), shard))
        if recording:
            recording[-1].add(id(tensor))

    def other(node: Any, path: Keys) -> None:
        if isinstance(node, (bytes, bytearray)):
            checked.append(("/".join(str(key) for key in path), node))

    recording: list[set[int]] = []
    memo = previous.walked if previous is not None else {}
    walked: dict[int, _Walked] = {}

    def stable(node: StableDict, path: Keys) -> Any:
        entry = (tuple(buffer_of.items()), tuple(sizes), bool(shard_sizes))
        hit = memo.get(id(node))
        if hit is not None and hit.node is node and hit.path == path and hit.entry == entry \
                and slots.keys().isdisjoint(hit.ids):
            for buffer, tensors in hit.added:
                if buffer == len(sources):
                    sources.append([])
                sources[buffer] += tensors
            buffer_of.update(hit.exit[0])
            sizes[:] = hit.exit[1]
            slots.update(hit.slots)
            rows.extend(hit.rows)
            checked.extend(hit.checked)
            if hit.shard_size is not None and not shard_sizes:
                shard_sizes.append(hit.shard_size)
            walked[id(node)] = hit
            return hit.skeleton
        before = (set(slots), [len(group) for group in sources], len(rows), len(checked), len(shard_sizes))
        recording.append(set())
        try:
            skeleton = _visit(node, path, False, place, other)  # a plain walk (a stable dict inside it too)
        finally:
            ids = recording.pop()
        if recording:
            recording[-1] |= ids
        if ids.isdisjoint(before[0]):  # a replay needs none of its tensors placed before it
            grown = [(b, group[before[1][b] if b < len(before[1]) else 0:]) for b, group in enumerate(sources)]
            walked[id(node)] = _Walked(
                node, path, entry, frozenset(ids), skeleton, [(b, new) for b, new in grown if new],
                (dict(buffer_of), list(sizes)), {k: v for k, v in slots.items() if k not in before[0]},
                rows[before[2]:], checked[before[3]:], shard_sizes[0] if len(shard_sizes) > before[4] else None)
        return skeleton

    try:
        skeleton = _skeleton(tree, place, other, stable)
    except _NotPackable:
        return None
    nbytes = sum(size * group[0].element_size() for size, group in zip(sizes, sources))
    if not many_small(len(slots), nbytes) or PACKED_KEY in skeleton:
        return None
    index = previous.index if previous is not None and previous.rows == rows else json.dumps(rows).encode()
    layout = PackPlan(skeleton, sources, index, checked, shard_sizes[0] if shard_sizes else None, nbytes)
    return layout, PlanMemo(rows, index, walked)


def fill(layout: PackPlan) -> FilledPlan:
    """(background thread) The buffers copied off the live tensors: one call per dtype, which releases the GIL."""
    with torch.no_grad():  # grad mode is per thread: the copy records no graph even of a tensor that requires grad
        # A single tensor would come back as a view of itself, not a copy.
        buffers = [torch._C._nn.flatten_dense_tensors(group) if len(group) > 1 else group[0].reshape(-1).clone()
                   for group in layout.sources]
    content = dict(layout.skeleton)
    content[PACKED_KEY] = {"buffers": buffers, "index": layout.index}
    checked: list[tuple[str, Tensor | bytes]] = [*layout.checked, (f"{PACKED_KEY}/index", layout.index)]
    checked += [(f"{PACKED_KEY}/buffers/{i}", buffer) for i, buffer in enumerate(buffers)]
    return FilledPlan(content, checked, layout.shard_group_size, layout.nbytes)
