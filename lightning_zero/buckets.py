"""Gradient buckets: per-parameter shards, backward hooks and the async reductions.

Granularity follows FSDP2: a :class:`ShardedParam` owns one parameter's shard on this rank,
a :class:`GradBucket` owns a group of parameters that communicate together, and the
:class:`GradReducer` owns the hooks and the launch order. The collectives themselves are the
stateless functions in :mod:`lightning_zero._collectives`.

[Note: bucket layout] A bucket's communication buffer is ``[world_size, row_numel + k]``:
row ``r`` holds, for every parameter of the bucket, its padded chunk ``r`` (so rows are
``g-0 | g-1 | ...`` of DESIGN.md), followed by ``k`` (= parameters in the bucket) presence
flags. Every rank writes 1 into the flag column of each parameter it has a gradient for, in
every row, so after the reduction every rank holds, per parameter, how many ranks produced a
gradient. That tells all ranks, without a collective of its own, which parameters got no
gradient anywhere (layer drop) and must be left untouched by the optimizer.

[Note: launch order] Bucket membership and order are fixed at setup (parameters in reverse
registration order, the usual order gradients arrive in). A bucket is launched when all its
parameters have reported, and only after every earlier bucket; whatever is left is launched,
in order, with missing gradients as zeros, when backward ends. So every rank issues the same
collectives in the same order even when ranks skip different parameters, the cause of the
hangs reported against other ZeRO implementations (PyTorch #158719, DeepSpeed #777).

[Note: gloo reduce-scatter] gloo's ``reduce_scatter`` clones its whole input on the calling
thread, all-reduces the clone and copies out one chunk: measured on 2 CPU ranks with 40 MB, 57 ms
against 31 ms for an in-place all-reduce of the same buffer (BENCHMARKS.md). On gloo, stage 2
therefore all-reduces its packed buffer in place and keeps its row, which moves the same bytes
gloo would move anyway; on NCCL it uses the real reduce-scatter (half the bytes of an all-reduce).
Either way the full gradients are freed at packing and only the fp32 shard outlives the bucket.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero import _collectives as comm
from lightning_zero.sharding import EvenShard


def master_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """fp32 master copies for low-precision parameters; float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class ShardedParam:
    """One model parameter's even shard on this rank."""

    def __init__(self, fqn: str, param: nn.Parameter, layout: EvenShard, rank: int,
                 bucket: GradBucket, offset: int) -> None:
        self.fqn = fqn
        self.param = param  # ND: the model's own full parameter
        self.layout = layout
        self.rank = rank
        self.bucket = bucket
        self.offset = offset  # where this parameter's chunk starts inside a bucket row
        n = layout.shard_numel(rank)
        # 1D views into the bucket's flat buffers, real elements only (the padding is not
        # the optimizer's business and is never written).
        self.master = nn.Parameter(bucket.master_shard[offset : offset + n])
        self.grad_shard = bucket.grad_shard[offset : offset + n]
        self.has_grad = False  # some rank produced a gradient since the last zero_grad
        self.reported = False  # this rank's hook fired in the current backward
        self.load_master_from(param.detach())

    def own_elements(self, full: Tensor) -> Tensor:
        """This rank's elements of a tensor shaped like the parameter (1D view)."""
        return full.reshape(-1)[self.layout.local_slice(self.rank)]

    @torch.no_grad()
    def load_master_from(self, full: Tensor) -> None:
        """Set the master shard from a whole tensor shaped like the parameter."""
        self.master.copy_(self.own_elements(full))

    @property
    def shard_numel(self) -> int:
        return self.master.numel()

    def rows(self, buffer: Tensor) -> Tensor:
        """This parameter's ``[world_size, chunk]`` column block of a bucket buffer."""
        return buffer[:, self.offset : self.offset + self.layout.chunk]


class GradBucket:
    """Parameters that reduce and all-gather together, with this rank's flat shard buffers."""

    def __init__(self, index: int, named_params: Sequence[tuple[str, nn.Parameter]],
                 world_size: int, rank: int, communicates: bool = True) -> None:
        self.index = index
        self.world_size = world_size
        self.rank = rank
        self.communicates = communicates  # False for optimized-but-frozen parameters
        first = named_params[0][1]
        self.dtype = first.dtype
        self.device = first.device
        layouts = [EvenShard(p.numel(), world_size) for _, p in named_params]
        offsets = [sum(layout.chunk for layout in layouts[:i]) for i in range(len(layouts))]
        self.row_numel = sum(layout.chunk for layout in layouts)
        master_dtype = master_dtype_for(self.dtype)
        self.master_shard = torch.zeros(self.row_numel, dtype=master_dtype, device=self.device)  # 1D
        self.grad_shard = torch.zeros(self.row_numel, dtype=master_dtype, device=self.device)  # 1D
        self.params = [
            ShardedParam(fqn, param, layout, rank, self, offset)
            for (fqn, param), layout, offset in zip(named_params, layouts, offsets)
        ]
        self.reported = 0
        self.pending: _PendingReduce | None = None

    # ---- reduction ---------------------------------------------------------------------

    def pack_gradients(self) -> Tensor:
        """Move every present gradient into a fresh ``[ws, row_numel + k]`` buffer and free it."""
        k = len(self.params)
        # Not zero-filled: every element is written below (padding zeroed per parameter), which
        # saves a pass over the whole buffer each backward.
        buffer = torch.empty(self.world_size, self.row_numel + k, dtype=self.dtype, device=self.device)
        present = []
        for sp in self.params:
            grad = sp.param.grad
            rows = sp.rows(buffer)
            if grad is None:
                rows.zero_()  # no gradient here: zeros in the sum (DESIGN.md, layer drop)
                present.append(0.0)
                continue
            if grad.is_sparse:
                raise ValueError(
                    f"Parameter {sp.fqn!r} has a sparse gradient, which ZeRO sharding cannot split"
                    " evenly. Use dense gradients (e.g. nn.Embedding(sparse=False))."
                )
            comm.copy_flat_to_rows(rows, grad.reshape(-1), sp.layout, zero_padding=True)
            present.append(1.0)
            # The full gradient dies here: stage 2 keeps only the reduced shard, and stage 1
            # holds the packed copy, so no rank keeps two full gradients alive.
            sp.param.grad = None
        buffer[:, self.row_numel :] = torch.tensor(present, dtype=self.dtype, device=self.device)
        if self.predivide:
            buffer[:, : self.row_numel].div_(self.world_size)
        return buffer

    @property
    def predivide(self) -> bool:
        """Average as a SUM of pre-divided values only where the SUM could overflow (fp16);
        otherwise divide the reduced shard, 1/world_size of the data (ReduceOp.AVG is not on
        every backend)."""
        return self.world_size > 1 and self.dtype == torch.float16

    def launch_reduce(self, reduce_scatter: bool, group: dist.ProcessGroup | None, async_op: bool) -> None:
        """``reduce_scatter``: leave only this rank's row (stage 2 on NCCL); otherwise all-reduce
        the buffer and take the row (stage 1, and stage 2 on gloo: see [Note: gloo reduce-scatter])."""
        assert self.pending is None, f"bucket {self.index} launched twice in one backward"
        buffer = self.pack_gradients()
        if reduce_scatter:
            output = torch.empty(self.row_numel + len(self.params), dtype=self.dtype, device=self.device)
            work = comm.reduce_scatter(output, buffer.view(-1), group, async_op)
        else:
            work = comm.all_reduce(buffer, group, async_op)
            output = buffer[self.rank]
        self.pending = _PendingReduce(work, buffer, output)

    def finish_reduce(self) -> Tensor:
        """Wait for the reduction, add it to the fp32 shard gradient; return the flag counts."""
        assert self.pending is not None
        pending, self.pending = self.pending, None
        if pending.work is not None:
            pending.work.wait()
        scale = 1.0 if self.predivide or self.world_size == 1 else 1.0 / self.world_size
        self.grad_shard.add_(pending.output[: self.row_numel], alpha=scale)
        return pending.output[self.row_numel :].clone()  # the buffer itself is released here

    # ---- parameter all-gather ----------------------------------------------------------

    def launch_all_gather(self, group: dist.ProcessGroup | None, async_op: bool) -> _PendingGather:
        gather_input = self.master_shard.to(self.dtype)
        gathered = torch.empty(self.world_size, self.row_numel, dtype=self.dtype, device=self.device)
        work = comm.all_gather(gathered.view(-1), gather_input, group, async_op)
        return _PendingGather(self, work, gathered)

    def reset_backward(self) -> None:
        self.reported = 0
        for sp in self.params:
            sp.reported = False


@dataclass
class _PendingReduce:
    work: comm.Work
    buffer: Tensor  # kept alive until the collective completes
    output: Tensor


@dataclass
class _PendingGather:
    bucket: GradBucket
    work: comm.Work
    gathered: Tensor  # [world_size, row_numel]

    def finish(self) -> None:
        if self.work is not None:
            self.work.wait()
        with torch.no_grad():
            for sp in self.bucket.params:
                comm.copy_rows_to_flat(sp.param.data.view(-1), sp.rows(self.gathered), sp.layout)


MAX_IN_FLIGHT = 2
"""Bucket reductions outstanding at once (see ``GradReducer._launch_next``)."""


class GradReducer:
    """Backward hooks that launch the bucket reductions, in a fixed order, and their flush."""

    def __init__(self, buckets: Sequence[GradBucket], stage: int, group: dist.ProcessGroup | None,
                 overlap_communication: bool) -> None:
        self.buckets = [b for b in buckets if b.communicates]
        self.stage = stage
        self.group = group
        self.async_op = overlap_communication
        self.reduce_scatter = stage == 2 and dist.get_backend(group) != "gloo"
        self._next_launch = 0
        self._next_finish = 0
        self._counts: list[Tensor] = []
        self._callback_queued = False
        self._flushed = False
        self._sync_enabled = True
        self._handles = [
            sp.param.register_post_accumulate_grad_hook(self._make_hook(sp))
            for bucket in self.buckets
            for sp in bucket.params
        ]

    def _make_hook(self, sp: ShardedParam):  # noqa: ANN202 - returns a hook closure
        def hook(_: Tensor) -> None:
            self._on_gradient(sp)

        return hook

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip communication for this backward (stage 1 only; see [Note: accumulation])."""
        previous = self._sync_enabled
        self._sync_enabled = self.stage == 2
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _on_gradient(self, sp: ShardedParam) -> None:
        if not self._sync_enabled:
            return
        if not self._callback_queued:
            # Flush at the end of *this* backward, not at the step (DESIGN.md).
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
            self._callback_queued = True
        bucket = sp.bucket
        if bucket.pending is not None:
            raise RuntimeError(
                f"Parameter {sp.fqn!r} received a gradient after its bucket was already reduced in this"
                " backward pass (its gradient arrived twice). Reentrant activation checkpointing does this;"
                " use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)."
            )
        if not sp.reported:
            sp.reported = True
            bucket.reported += 1
        while self._next_launch < len(self.buckets):
            nxt = self.buckets[self._next_launch]
            if nxt.reported < len(nxt.params):
                break
            self._launch_next()

    def _launch_next(self) -> None:
        self.buckets[self._next_launch].launch_reduce(self.reduce_scatter, self.group, self.async_op)
        self._next_launch += 1
        # At most MAX_IN_FLIGHT packed buffers (each a full-size gradient slice) live at once:
        # one reduction runs behind the one being filled, and older ones are folded into the
        # fp32 shard and freed, so a full gradient never outlives its bucket for long.
        while self._next_launch - self._next_finish > MAX_IN_FLIGHT:
            self._finish_next()

    def _finish_next(self) -> None:
        self._counts.append(self.buckets[self._next_finish].finish_reduce())
        self._next_finish += 1

    def finish_backward(self) -> None:
        """Launch what is left (in order), wait for every reduction, publish shard gradients."""
        self._callback_queued = False
        if not self._sync_enabled:
            return
        while self._next_launch < len(self.buckets):
            self._launch_next()
        while self._next_finish < len(self.buckets):
            self._finish_next()
        counts, self._counts = self._counts, []
        present = torch.cat(counts).gt(0).tolist() if counts else []  # one host sync per backward
        flat = (sp for bucket in self.buckets for sp in bucket.params)
        for sp, got in zip(flat, present):
            sp.has_grad = sp.has_grad or got
            sp.master.grad = sp.grad_shard if sp.has_grad else None
        for bucket in self.buckets:
            bucket.reset_backward()
        self._next_launch = 0
        self._next_finish = 0
        self._flushed = True

    def ensure_flushed(self) -> None:
        """Called after each backward: flush if no hook fired on this rank (nothing to reduce
        locally, but the other ranks' collectives must still be matched)."""
        if self._sync_enabled and not self._flushed:
            self.finish_backward()
        self._flushed = False

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
