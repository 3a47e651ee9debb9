"""The backward side: :class:`GradReducer`'s gradient hooks launch the bucket reductions in a fixed
order and flush them when backward ends.

[Note: launch order] Bucket membership and order are fixed at setup (parameters in reverse
registration order, the usual order gradients arrive in). A bucket is launched when all its
parameters have reported, and only after every earlier bucket; whatever is left is launched,
in order, with missing gradients as zeros, when backward ends. So every rank issues the same
collectives in the same order even when ranks skip different parameters, the cause of the
hangs reported against other ZeRO implementations (PyTorch #158719, DeepSpeed #777).

[Note: gloo reduce-scatter] gloo's ``reduce_scatter`` clones its whole input on the calling
thread, all-reduces the clone and copies out one chunk: slower than an in-place all-reduce of the
same buffer (BENCHMARKS.md has the measurement). On gloo, stage 2
therefore all-reduces its packed buffer in place and keeps its row, which moves the same bytes
gloo would move anyway; on backends with a native reduce-scatter (NCCL) both stages use it (half
the bytes of an all-reduce: stage 1 needs only its row too). Either way the full gradients are
freed at packing and only the fp32 shard outlives the bucket.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.engine import collectives as comm
from lightning_zero.engine.comm_pool import BufferPool
from lightning_zero.engine.grad_bucket import GradBucket, PresenceCounts, ReplicaHop, ShardedParam


class ReduceState(enum.Enum):
    """Where a :class:`GradReducer` is in the cycle of one backward, as FSDP2's ``TrainingState``.

    ``IDLE`` -(first gradient hook)-> ``BACKWARD`` -(``finish_backward``, queued on the autograd
    engine)-> ``FLUSHED`` -(``ensure_flushed``, after every backward)-> ``IDLE``. A backward in which
    no hook fired on this rank goes ``IDLE`` -> ``FLUSHED`` -> ``IDLE`` inside ``ensure_flushed``.
    Inside ``no_sync`` (stage 1) hooks do nothing and the state stays as it is."""

    IDLE = enum.auto()
    """No backward of this reducer is under way, or the last one was flushed and seen by ``ensure_flushed``."""
    BACKWARD = enum.auto()
    """A hook fired in this backward: ``finish_backward`` is queued, buckets launch as they complete."""
    FLUSHED = enum.auto()
    """This backward's reductions are in the shard gradients; ``ensure_flushed`` has not run yet."""


class GradReducer:
    """Backward hooks that launch the bucket reductions, in a fixed order ([Note: launch order]), and
    their flush."""

    def __init__(self, buckets: Sequence[GradBucket], stage: int, group: dist.ProcessGroup | None,
                 overlap_communication: bool, pool: BufferPool, presence: PresenceCounts,
                 before_first_reduction: Callable[[], None] = lambda: None,
                 replica_group: dist.ProcessGroup | ReplicaHop | None = None, full_gradients: bool = False) -> None:
        """``presence``: the counts the communicating ``buckets`` were built with."""
        self.buckets = [b for b in buckets if b.communicates]
        self.full_gradients = full_gradients  # stage 1: whole averaged gradients in param.grad too
        self.stage = stage
        self.group = group  # the shard group
        self.replica_group = replica_group  # hybrid only: see [Note: hybrid reduction] in grad_bucket.py
        self.async_op = overlap_communication
        self.pool = pool
        self.presence = presence
        self.before_first_reduction = before_first_reduction  # finishes pending parameter gathers
        # Full gradients need every rank's row: all-reduce then, also where reduce-scatter is native.
        self.reduce_scatter = comm.has_native_reduce_scatter(group) and not full_gradients
        self._state = ReduceState.IDLE
        # A mode, not a state of the backward (FSDP2 keeps ``reduce_grads`` beside its state the same
        # way): False inside ``no_sync`` on stage 1.
        self._sync_enabled = True
        self._next_launch = 0
        self._next_finish = 0
        self._handles = [
            sp.param.register_post_accumulate_grad_hook(self._make_hook(sp))
            for bucket in self.buckets
            for sp in bucket.params
        ]

    @property
    def state(self) -> ReduceState:
        return self._state

    def _make_hook(self, sp: ShardedParam):  # noqa: ANN202 - returns a hook closure
        def hook(_: Tensor) -> None:
            self._on_gradient(sp)

        return hook

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip communication for this backward (stage 1 only; see [Note: accumulation] in zero_engine.py)."""
        previous = self._sync_enabled
        self._sync_enabled = self.stage == 2
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _on_gradient(self, sp: ShardedParam) -> None:
        if not self._sync_enabled:
            return
        if self._state is not ReduceState.BACKWARD:
            # Flush at the end of *this* backward, not at the step: gradient accumulation reduces each one.
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
            self._state = ReduceState.BACKWARD
            self.before_first_reduction()
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
        # Fold the oldest reduction into its shard first, so at most MAX_IN_FLIGHT packed buffers
        # (full-size gradient slices) exist even while the next one is being packed.
        while self._next_launch - self._next_finish >= self.pool.slots:
            self._finish_next()
        self.buckets[self._next_launch].launch_reduce(self.pool, self._next_launch, self.reduce_scatter,
                                                      self.group, self.async_op, self.replica_group)
        self._next_launch += 1
        if self.replica_group is not None and self._next_launch - 2 >= self._next_finish:
            # The previous bucket's first hop ran while this one was packed: start its second.
            self.buckets[self._next_launch - 2].advance_reduce()

    def _finish_next(self) -> None:
        self.buckets[self._next_finish].finish_reduce(self.pool, self.full_gradients)
        self._next_finish += 1

    def finish_backward(self) -> None:
        """Launch what is left (in order), wait for every reduction, publish shard gradients."""
        self._state = ReduceState.IDLE  # the queued flush is running (or ensure_flushed calls it)
        if not self._sync_enabled:
            return
        self.before_first_reduction()  # a no-op unless no hook fired (ensure_flushed)
        while self._next_launch < len(self.buckets):
            self._launch_next()
        while self._next_finish < len(self.buckets):
            self._finish_next()
        # Provisional until resolve_presence: see [Note: presence on the device] in grad_bucket.py.
        for bucket in self.buckets:
            for sp, grad_shard in zip(bucket.params, bucket.grad_shard_views()):
                sp.master.grad = grad_shard
            bucket.reset_backward()
        self.presence.mark_reduced()
        self._next_launch = 0
        self._next_finish = 0
        self._state = ReduceState.FLUSHED
        if self.full_gradients:
            # As under DDP, a parameter no rank produced a gradient for has none: the presence is read
            # now (the step's one device-to-host read, earlier), before hooks read ``.grad``.
            self.resolve_presence()
            for bucket in self.buckets:
                for sp in bucket.params:
                    if not sp.has_grad:
                        sp.param.grad = None

    def resolve_presence(self) -> None:
        """Drop ``master.grad`` of parameters that got no gradient on any rank (at most one read of the
        counts per step: :meth:`PresenceCounts.resolve <lightning_zero.engine.grad_bucket.PresenceCounts.resolve>`)."""
        self.presence.resolve()

    def ensure_flushed(self) -> None:
        """Called after each backward: flush if no hook fired on this rank (nothing to reduce
        locally, but the other ranks' collectives must still be matched)."""
        if self._sync_enabled and self._state is not ReduceState.FLUSHED:
            self.finish_backward()
        if self._state is ReduceState.FLUSHED:
            self._state = ReduceState.IDLE

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
