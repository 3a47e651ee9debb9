"""Stateless collectives over tensors, and the row copies that pack/unpack even shards.

[Note: collective names] PyTorch 2.13 renamed ``reduce_scatter_tensor`` /
``all_gather_into_tensor`` to ``reduce_scatter_single`` / ``all_gather_single`` and warns on the
old names. This module is the one place that picks whichever exists, so the engine runs on
older and newer PyTorch alike. ``ReduceOp.AVG`` is not on every backend: callers divide by
the world size and SUM.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.engine import _compat
from lightning_zero.engine.sharding import EvenShard

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

Work = Any  # torch.distributed.Work, or None when the call was synchronous


def has_native_reduce_scatter(group: dist.ProcessGroup | None) -> bool:
    """False where reduce-scatter is an all-reduce plus a copy (gloo: [Note: gloo reduce-scatter]
    in grad_reducer.py), so callers all-reduce in place there instead."""
    return "gloo" not in dist.get_backend(group)


def broadcast_sources(group: dist.ProcessGroup | None) -> list[int] | None:
    """Where an all-gather goes through a flat temporary of its whole output (gloo: ``newLikeFlat`` in
    ProcessGroupGloo's allgather): the global rank of each of ``group``'s ranks, in group order, for
    :func:`all_gather_by_broadcasts`. Elsewhere None (the backend's all-gather is used). Looked up once,
    at setup: ``dist.get_global_rank`` scans the group's ranks at every call."""
    if "gloo" not in dist.get_backend(group):
        return None
    size = dist.get_world_size(group)
    return list(range(size)) if group is None else [dist.get_global_rank(group, r) for r in range(size)]


def all_gather_by_broadcasts(output_rows: Tensor, input: Tensor, group: dist.ProcessGroup | None,
                             sources: Sequence[int]) -> None:
    """All-gather ``input`` (``[n]``) into ``output_rows`` (``[world_size, n]``): row ``r`` is group
    rank ``r``'s input, each row broadcast in place from its rank (global rank ``sources[r]``, from
    :func:`broadcast_sources`), one after another, every wait bounded.

    [Note: gloo all-gather] gloo's all-gather allocates a flat temporary of its whole output on its
    worker thread, gathers into it and copies it out. That costs a copy of the output and an allocation
    in the worker thread's malloc arena, whose freed top glibc keeps resident (``malloc_trim`` trims only
    the main arena's top): 8-16 MiB per rank stayed resident between steps at 2-4 ranks. A broadcast
    writes into its tensor and allocates nothing, and each rank's row still reaches every other rank.
    bench/gloo_gather.py measures both, bench/engine.py the step with each (BENCHMARKS.md). Every rank
    runs the same broadcasts in the same order, so the calls match on every rank."""
    output_rows[dist.get_rank(group)].copy_(input)
    for row, src in zip(output_rows, sources, strict=True):
        wait(dist.broadcast(row, src=src, group=group, async_op=True))


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device whose tensors ``group``'s collectives take: its accelerator (the current one)
    if it serves one, else the CPU. For fallbacks only; tensors normally follow the parameters."""
    types = [t for t in _compat.device_types(group) if t != "cpu"]
    if not types:
        return torch.device("cpu")
    module = getattr(torch, types[0], None)
    if module is not None and hasattr(module, "is_available") and module.is_available():
        return torch.device(types[0], module.current_device())
    # Registered for an accelerator this process cannot use (the fake backend on a CPU host).
    return torch.device("cpu")


def reduce_scatter(output: Tensor, input: Tensor, group: dist.ProcessGroup | None, async_op: bool) -> Work:
    """Sum ``input`` (``[world_size * n]``) over ranks; rank r keeps elements ``[r*n, (r+1)*n)``."""
    return _reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce(tensor: Tensor, group: dist.ProcessGroup | None, async_op: bool) -> Work:
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather(output: Tensor, input: Tensor, group: dist.ProcessGroup | None, async_op: bool) -> Work:
    """Concatenate every rank's ``input`` into ``output`` (``[world_size * n]``) in rank order."""
    return _all_gather(output, input, group=group, async_op=async_op)


def process_group_timeout() -> timedelta:
    """The default process group's timeout (the strategy's ``timeout``), else torch's 30 minutes."""
    if dist.is_initialized():
        for device in ("cpu", "cuda"):
            try:
                return _compat.process_group_timeout(device)
            except Exception:  # no backend for this device type (NCCL has no CPU one); try the next
                continue
    return timedelta(minutes=30)


def new_group(ranks: list[int] | None = None, backend: str | None = None) -> Any:
    """``dist.new_group`` with the default group's timeout (the strategy's ``timeout``).

    ``new_group`` without one takes torch's 30 minutes, whatever the default group has: a peer
    frozen in the middle of one of its collectives then holds the group's worker thread for half an
    hour, and the survivor, although its bounded wait has already raised, hangs at exit where
    gloo's destructor joins that thread."""
    return dist.new_group(ranks=ranks, backend=backend, timeout=process_group_timeout())


def wait(work: Work) -> None:
    """Wait for an async collective for at most the process group timeout.

    [Note: bounded waits] gloo's ``Work.wait()`` without a timeout never returns when a peer is
    frozen (SIGSTOP, a hung host): the rank hangs in the next forward (overlapped parameter gather)
    although its own collectives time out. With the timeout it raises, naming the operation."""
    if work is None:
        return
    timeout = process_group_timeout()
    try:
        work.wait(timeout)
    except RuntimeError as exc:
        raise RuntimeError(f"rank {dist.get_rank()}: a collective failed: {peer_failure(exc, timeout)}") from exc


_CLOSED = ("connection closed", "connection reset", "broken pipe", "econnreset", "epipe", "socket closed")


def peer_failure(exc: BaseException, timeout: timedelta | None = None) -> str:
    """What a failed collective's error says happened, in words a user acts on: a peer closed its
    connection (it exited, destroyed its process group or died: the failure comes at once), or nothing came
    within the timeout (a peer frozen, hung or unreachable); the backend's own words follow."""
    text = str(exc).lower()
    if any(sign in text for sign in _CLOSED):
        what = ("a peer closed its connection (the process exited, destroyed its process group or died);"
                " its own log says which")
    elif "timed out" in text or "timeout" in text:
        limit = timeout if timeout is not None else process_group_timeout()
        what = f"no answer within the process group timeout ({limit}): a peer is frozen, hung or unreachable"
    else:
        what = "another rank died or stopped answering"
    return f"{what}. ({type(exc).__name__}: {exc})"


def copy_flat_to_rows(rows: Tensor, flat: Tensor, layout: EvenShard, zero_padding: bool = False) -> None:
    """Copy a flattened parameter (or gradient) into its ``[world_size, chunk]`` row block.

    ``rows`` may be a strided column slice of a larger bucket buffer. Its padding elements are
    zeroed with ``zero_padding``, left as they are otherwise.
    """
    full, tail, chunk = layout.full_rows, layout.tail, layout.chunk
    if zero_padding and full < layout.world_size:
        rows[full:].zero_()
    if full:
        rows[:full].copy_(flat[: full * chunk].view(full, chunk))
    if tail:
        rows[full, :tail].copy_(flat[full * chunk :])


def copy_rows_to_flat(flat: Tensor, rows: Tensor, layout: EvenShard) -> None:
    """The inverse of :func:`copy_flat_to_rows`: drop the padding, write the real elements."""
    full, tail, chunk = layout.full_rows, layout.tail, layout.chunk
    if full:
        flat[: full * chunk].view(full, chunk).copy_(rows[:full])
    if tail:
        flat[full * chunk :].copy_(rows[full, :tail])


def all_reduce_(value: Tensor, group: dist.ProcessGroup | None, op: Any = dist.ReduceOp.SUM) -> Tensor:
    """Synchronous in-place all-reduce, a no-op in a one-rank world."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(value, op=op, group=group)
    return value


@torch.no_grad()
def broadcast_from_first(tensors: list[Tensor], group: dist.ProcessGroup | None = None) -> None:
    """(collective) The group's first rank's values of ``tensors`` on every rank, one flat broadcast per
    dtype and device (DDP's ``broadcast_buffers`` before each forward; a load's buffers)."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for same in by_kind.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for t in same:
            t.detach().copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
