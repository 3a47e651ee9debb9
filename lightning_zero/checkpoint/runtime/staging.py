"""Staging: copying a checkpoint's tensors off the live state while training goes on.

[Note: staging on GPUs] A save is taken on the training thread at a point where the state is
consistent (after the optimizer update); the copy runs in the background and must see exactly
that state. On CUDA:

* the training thread records an event on its current stream when the save is queued
  (:func:`ready_event`), so the copy is ordered after every kernel that produced the state,
  without a host synchronisation;
* the background thread binds itself to the rank's device and copies on a dedicated stream that
  waits for that event, device-to-host and ``non_blocking`` into *pinned* host buffers, so the
  copies use the copy engine and overlap the training stream's forward and backward (DCP's
  ``DefaultStager`` and torchtitan do the same);
* the pinned buffers are kept and reused by the next save of a tensor of the same key, shape and
  dtype (allocating pinned memory costs far more than the copy). The previous save is always
  finalized before the next one stages (see ``_AsyncSaver.submit``), so a buffer is never
  overwritten while it is still being written out;
* the stream is synchronised before the save reports "staged", which is what the optimizer's
  pre-update fence waits for: only then may the update change the live tensors.

CPU tensors are copied into one new flat buffer per dtype by one ``torch._foreach_copy_`` (a host copy
is just a memcpy; keeping the buffers between saves would double host memory for good): one call that
releases the GIL instead of a clone per tensor that holds it, and a few storages that the ``local`` writer
saves as a few records ([Note: packed rank files] in formats/packed.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_zero.checkpoint.formats import packed
from lightning_zero.checkpoint.formats.tree import FlatShard, map_with_path, walk


def ready_event(tree: Any) -> tuple[torch.cuda.Event, torch.device] | None:
    """(training thread) An event on the current CUDA stream after the state was produced, or None
    when the tree holds no CUDA tensor."""
    if not torch.cuda.is_initialized():
        return None  # no CUDA tensor exists before CUDA is initialized: no walk of the tree on the hot path
    device = next((t.device for t in _tensors(tree) if t.device.type == "cuda"), None)
    if device is None:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event, device


class Stager:
    """Copies trees off the device into reused pinned host buffers (see [Note: staging on GPUs])."""

    def __init__(self) -> None:
        self._host: dict[tuple[str, tuple[int, ...], torch.dtype], Tensor] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._memo: packed.PlanMemo | None = None  # what the previous plan hands the next

    def plan(self, tree: dict[str, Any]) -> packed.PackPlan | None:
        """(training thread) The layout of a ``local`` rank file of ``tree`` when it is many small CPU tensors,
        reusing the previous save's index when the rows are the same ([Note: pack plans]); None otherwise (the
        tree is staged by :meth:`stage`)."""
        planned = packed.plan(tree, many_small, self._memo)
        if planned is None:
            return None
        layout, self._memo = planned
        return layout

    def stage(self, tree: Any, ready: tuple[torch.cuda.Event, torch.device] | None = None, flat: bool = True,
              live: bool = False) -> Any:
        """(background thread) ``tree`` with every tensor copied to the host; other leaves as they are.
        ``flat=False``: each CPU tensor a storage of its own (a file other tools read, where a tensor that is
        a view of a larger storage would carry all of it). A :meth:`plan` is filled instead (``packed.fill``).
        ``live``: the caller waits for the whole save ([Note: synchronous saves write the live state])."""
        if isinstance(tree, packed.PackPlan):
            return packed.fill(tree)
        if ready is None:
            to_host = _live_or_copy if live else _host_copy
            return _stage_on_host(tree, to_host) if flat else _clone_each(tree, to_host)
        event, device = ready
        torch.cuda.set_device(device)  # this thread's kernels and allocations go to the rank's device
        stream = self._streams.setdefault(device, torch.cuda.Stream(device))
        with torch.cuda.stream(stream):
            stream.wait_event(event)
            staged = _map_tensors(tree, self._copy)
        stream.synchronize()
        return staged

    def _copy(self, path: str, tensor: Tensor) -> Tensor:
        tensor = tensor.detach()
        if tensor.device.type == "cpu":
            return tensor.clone()
        key = (path, tuple(tensor.shape), tensor.dtype)
        host = self._host.get(key)
        if host is None:
            host = self._host[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host

    def host_buffers(self) -> list[Tensor]:
        """The pinned buffers kept for reuse (for checks and memory accounting)."""
        return list(self._host.values())


FLAT_MIN_TENSORS = 64
FLAT_MAX_MEAN_BYTES = 2**20
"""Flat staging pays where a tree has many small tensors (at least :data:`FLAT_MIN_TENSORS`, of at most
:data:`FLAT_MAX_MEAN_BYTES` on average): there the per-tensor Python of a clone, a pickled record and a CRC32
each held the GIL for longer than the copy took. A tree of a few large tensors gains nothing from it and was
measured slower with it (one large fresh buffer, BENCHMARKS.md), so it is cloned tensor by tensor."""


def many_small(count: int, nbytes: int) -> bool:
    """Whether ``count`` distinct tensors of ``nbytes`` in all are staged flat (and a ``local`` file of them
    packed): the rule of :data:`FLAT_MAX_MEAN_BYTES`, in one place for the copy and the pack plan."""
    return count >= FLAT_MIN_TENSORS and nbytes <= FLAT_MAX_MEAN_BYTES * count


def _live_or_copy(tensor: Tensor) -> Tensor:
    """[Note: synchronous saves write the live state] A synchronous save (``saver.save``, ``ZeroCheckpointIO(
    async_save=False)``) holds the training thread until the files are written, so nothing changes the state
    meanwhile and a host copy of it would only cost time and memory (a tenth of a 50 MB save's time here,
    BENCHMARKS.md). A CPU tensor is written as it is where it is the whole of its storage, as a clone would
    be; a view of a larger buffer (a bucket's slice) is still copied, or the file would carry all the buffer.
    Many small tensors are still copied into flat buffers (:func:`_stage_on_host`): a ``local`` file packs those."""
    owns = (tensor.device.type == "cpu" and not tensor.is_sparse and tensor.storage_offset() == 0
            and tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())
    return tensor.detach() if owns else _host_copy(tensor)


def _host_copy(tensor: Tensor) -> Tensor:
    """A copy of ``tensor`` on the host, in a storage of its own."""
    return tensor.detach().clone() if tensor.device.type == "cpu" else tensor.detach().to("cpu")


def _clone_each(tree: Any, to_host: Callable[[Tensor], Tensor] = _host_copy) -> Any:
    """``tree`` with every tensor copied to the host into a storage of its own (``to_host``: how)."""
    return _map_tensors(tree, lambda _, t: to_host(t))


def _stage_on_host(tree: Any, to_host: Callable[[Tensor], Tensor] = _host_copy) -> Any:
    """``tree`` with its CPU tensors copied into one flat buffer per dtype (views of it, each tensor object
    once), in one ``_foreach_copy_`` per dtype, when it has many small tensors (else cloned one by one); a
    tensor on another device (a caller's meta or CUDA tensor without a CUDA stream to order by) is copied to
    the host alone."""
    unique: dict[int, Tensor] = {}
    for tensor in _tensors(tree):
        if tensor.device.type == "cpu" and not tensor.is_sparse:
            unique.setdefault(id(tensor), tensor.detach())
    if not many_small(len(unique), sum(t.numel() * t.element_size() for t in unique.values())):
        return _clone_each(tree, to_host)
    by_dtype: dict[torch.dtype, list[tuple[int, Tensor]]] = {}
    for key, tensor in unique.items():
        by_dtype.setdefault(tensor.dtype, []).append((key, tensor))
    staged: dict[int, Tensor] = {}
    for dtype, items in by_dtype.items():
        sources = [tensor for _, tensor in items]
        flat = torch.empty(sum(t.numel() for t in sources), dtype=dtype)
        views = torch._C._nn.unflatten_dense_tensors(flat, sources)  # one call: a view per tensor
        torch._foreach_copy_(views, sources)
        staged.update((key, view) for (key, _), view in zip(items, views))
    return _map_tensors(tree, lambda _, t: staged[id(t)] if id(t) in staged else to_host(t))


def _tensors(tree: Any) -> list[Tensor]:
    out = []
    for _, leaf in walk(tree):
        if isinstance(leaf, FlatShard):
            out.append(leaf.local)
        elif isinstance(leaf, Tensor):
            out.append(leaf)
    return out


def _map_tensors(tree: Any, fn: Any) -> Any:
    """``fn(path, tensor)`` on every tensor of ``tree``, a flat shard's local part included."""

    def leaf(path: str, value: Any) -> Any:
        if isinstance(value, FlatShard):
            shard = copy.copy(value)  # dataclasses.replace costs several times more, and a save has thousands
            shard.local = fn(path, value.local)
            return shard
        return fn(path, value) if isinstance(value, Tensor) else value

    return map_with_path(tree, leaf)
