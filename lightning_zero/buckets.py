"""Buckets: per-parameter shards, the backward reductions and the parameter all-gathers.

Granularity follows FSDP2: a :class:`ShardedParam` owns one parameter's shard on this rank,
a :class:`GradBucket` owns a group of parameters that communicate together, the
:class:`GradReducer` owns the backward hooks and the reduction order, and the
:class:`ParamGatherer` owns the all-gathers after the step and their order. Both borrow their
full-size communication buffers from one :class:`BufferPool`. The collectives themselves are the
stateless functions in :mod:`lightning_zero._collectives`.

[Note: bucket layout] A bucket's communication buffer is ``[world_size, row_numel + k]``:
row ``r`` holds, for every parameter of the bucket, its padded chunk ``r`` (so rows are
``g-0 | g-1 | ...`` of DESIGN.md), followed by ``k`` (= parameters in the bucket) presence
flags. Every rank writes 1 into the flag column of each parameter it has a gradient for, in
every row, so after the reduction every rank holds, per parameter, how many ranks produced a
gradient. That tells all ranks, without a collective of its own, which parameters got no
gradient anywhere (layer drop) and must be left untouched by the optimizer.

[Note: presence on the device] The flags are written on the device (a ``fill_`` per parameter,
no host-to-device copy) and the reduced counts are added, in place, to one persistent device
vector per device. Nothing is read back during backward: every parameter of a communicating bucket
provisionally gets its shard gradient as ``master.grad`` (zeros where no rank had one, so a
GradScaler's unscale and an inf check see only zeros), and :meth:`GradReducer.resolve_presence`
reads the counts once per step, at clipping or at the step, and takes ``.grad`` away from
parameters no rank produced a gradient for, before the inner optimizer looks at them.

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
gloo would move anyway; on backends with a native reduce-scatter (NCCL) both stages use it (half
the bytes of an all-reduce: stage 1 needs only its row too). Either way the full gradients are
freed at packing and only the fp32 shard outlives the bucket.

[Note: hybrid reduction] With a shard group smaller than the world (``shard_group_size``), a
bucket's buffer is ``[shard_group_size, ...]`` and its reduction has two hops: the reduce-scatter
(or gloo's in-place all-reduce) within the shard group leaves this rank's row summed over its
shard group, then that row alone (1/N of the bytes, flags included, so presence counts span the
whole world) is all-reduced across the replica group. The second hop of bucket ``i`` is launched
once bucket ``i + 1``'s first hop is on its way (:meth:`GradReducer._launch_next`), so both run
during backward; each group sees its collectives in bucket order on every rank. Averaging divides
by the whole world size.

[Note: buffer pool] A bucket's ``[world_size, row_numel + k]`` buffer lives only from packing
until its reduction is folded into the shard, and a gathered ``[world_size, row_numel]`` buffer
only until it is copied into the parameters. At most ``MAX_IN_FLIGHT`` of either exist at once, so
they are slots of a :class:`BufferPool`: ``MAX_IN_FLIGHT`` flat allocations per device, each grown
to the largest bucket and reused by every bucket of a backward and of the step that follows (one
allocation per slot and step, none per bucket). Reductions and gathers never overlap in time (the
gathers are finished before the first reduction of a backward, the reductions before the step), so
they share the slots. A slot is reused only after the collective that used it was waited for.

[Note: pool between steps] The slots are dropped when a step's gathers end (the last gathered
bucket is in the parameters): between steps, when the forward's activations grow, the engine holds
its model states only, as ZeRO's accounting says, and not ``MAX_IN_FLIGHT`` buckets on top (at 2
ranks that made zero2 hold more than DDP). The next backward takes them again from the allocator,
which has kept the freed blocks: CUDA's caching allocator reuses them with no ``cudaMalloc`` (and
lends them to the forward's activations meanwhile), glibc's malloc serves the same sizes from its
heap once its mmap threshold has risen to them. They are dropped on the training thread once it
has waited for every gather, so on CUDA the current stream is already ordered after the side
stream's last use of them. Between the reductions and the step's gathers they stay: the gathers
follow at once and reuse them.

[Note: gather overlap] After the step, :class:`ParamGatherer` gathers the buckets in *forward*
order (the reverse of the reduction order: the first layers' parameters come first), at most
``MAX_IN_FLIGHT`` at a time: bucket ``i + MAX_IN_FLIGHT`` is launched once bucket ``i`` is copied
into the parameters and its slot is free. That program runs by itself, never waiting for the
training thread: on CUDA it is all enqueued at the step on a side stream (slot reuse is ordered on
the device, each bucket records an event); on CPU a thread of the gatherer runs it (gloo's wait
blocks the caller). Reading a parameter through its module waits only for that parameter's bucket
([Note: guarded parameter reads] in engine.py): Megatron's ``overlap_param_gather``, where a forward
pre-hook waits for a module's buckets. Iterating parameters (``state_dict``, ``parameters()``),
the first gradient hook of the next backward (the reductions reuse the slots), the next step,
clipping, :meth:`ZeroEngine.finish_param_gather` and ``close`` wait for all of them.

Why not launch the next gather from the read that waits, as Megatron's pre-hook does: the gathers
a rank has launched would then depend on how far its forward got. A rank that skips the last layers
(layer drop) would stop launching, and if it then enters another collective (a ``sync_dist`` log
between forward and backward) while a rank with the full forward waits for a gather the first one
never launched, both hang (``test_param_gather`` has this case). Launching independently of the
forward, in the same order on every rank, on a process group of the gathers' own
(:func:`lightning_zero.engine._gather_group`), makes the gathers complete whatever else the ranks do.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero import _collectives as comm
from lightning_zero.sharding import EvenShard

MAX_IN_FLIGHT = 2
"""Full-size bucket buffers (reductions or gathers) alive at once; see [Note: buffer pool]."""


def master_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """fp32 master copies for low-precision parameters; float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class BufferPool:
    """``slots`` reusable flat buffers per device ([Note: buffer pool])."""

    def __init__(self, slots: int = MAX_IN_FLIGHT) -> None:
        self.slots = slots
        self._storage: dict[tuple[torch.device, int], Tensor] = {}  # 1D uint8
        self._busy: set[tuple[torch.device, int]] = set()
        # The most bytes each slot was asked for: a slot taken again after ``release`` is allocated
        # at that size at once, not grown bucket by bucket (one allocation per slot and step).
        self._high_water: dict[tuple[torch.device, int], int] = {}

    def take(self, slot: int, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A 1D ``dtype`` view of ``numel`` elements of slot ``slot`` (growing it if needed)."""
        key = (device, slot % self.slots)
        assert key not in self._busy, f"buffer slot {key} taken twice: a collective would overwrite it"
        nbytes = numel * dtype.itemsize
        if key not in self._storage or self._storage[key].numel() < nbytes:
            # The smaller allocation is freed before the bigger one is made; slots grow to the
            # largest bucket during the first backward and step.
            self._storage.pop(key, None)
            self._high_water[key] = max(nbytes, self._high_water.get(key, 0))
            self._storage[key] = torch.empty(self._high_water[key], dtype=torch.uint8, device=device)
        self._busy.add(key)
        return self._storage[key][:nbytes].view(dtype)

    def give_back(self, slot: int, device: torch.device) -> None:
        self._busy.discard((device, slot % self.slots))

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds now (what the bounded-memory checks read)."""
        return sum(t.numel() for t in self._storage.values())

    @property
    def high_water_bytes(self) -> int:
        """Bytes the pool holds while a backward or a step's gathers run (0 before the first)."""
        return sum(self._high_water.values())

    def clear(self) -> None:
        """Drop every slot (engine close; callers have waited for their collectives)."""
        self._storage.clear()
        self._busy.clear()
        self._high_water.clear()

    def release(self) -> None:
        """Drop the idle slots between steps ([Note: pool between steps]). A slot still marked in
        use (only after a failed collective) is kept: something may still write into it."""
        for key in [key for key in self._storage if key not in self._busy]:
            del self._storage[key]


class ShardedParam:
    """One model parameter's even shard on this rank."""

    def __init__(self, fqn: str, param: nn.Parameter, layout: EvenShard, rank: int,
                 bucket: GradBucket, offset: int, flag_index: int) -> None:
        self.fqn = fqn
        self.param = param  # ND: the model's own full parameter
        self.layout = layout
        self.rank = rank
        self.bucket = bucket
        self.offset = offset  # where this parameter's chunk starts inside a bucket row
        self.flag_index = flag_index  # its presence flag's column after the bucket's rows
        n = layout.shard_numel(rank)
        # 1D views into the bucket's flat buffers, real elements only (the padding is not
        # the optimizer's business and is never written).
        self.master = nn.Parameter(bucket.master_shard[offset : offset + n])
        self.grad_shard = bucket.grad_shard[offset : offset + n]
        self.has_grad = False  # some rank produced a gradient since the last zero_grad (host view)
        self.reported = False  # this rank's hook fired in the current backward
        # Stepped on the whole parameter ([Note: whole-matrix step] in whole_step.py); then the state
        # under these keys is held as even shards like the master, every other value whole.
        self.shape_aware = False
        self.split_state_keys: frozenset[str] = frozenset()
        self.load_master_from(param.detach())
        # The parameter's autograd version when the master last agreed with it: an in-place write
        # into the parameter (``copy_``, ``load_state_dict``) moves it; the engine's own gathers
        # write through ``.data`` and do not ([Note: the module is the truth] in engine.py).
        self.adopted_version = param._version

    @torch.no_grad()
    def adopt_param_writes(self, compare_values: bool) -> bool:
        """Take into the master what was written into this rank's elements of the parameter since
        the master last agreed with it; True if something may have been. Elements still equal to the
        master in the parameter's dtype keep the master (its fp32 precision under bf16 parameters).
        ``compare_values`` also finds writes that leave the version as it was (``p.data.copy_``);
        the parameter must then hold the last gather."""
        version = self.param._version
        if version == self.adopted_version and not compare_values:
            return False
        own = self.own_elements(self.param.detach())
        if own.dtype == self.master.dtype:
            self.master.copy_(own)
        else:
            written = own != self.master.to(own.dtype)
            self.master.copy_(torch.where(written, own.to(self.master.dtype), self.master))
        self.adopted_version = version
        return True

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

    @property
    def present_count(self) -> Tensor:
        """0-dim device view: ranks that produced a gradient since the last resolve (reduced)."""
        return self.bucket.present_count[self.flag_index]

    def rows(self, buffer: Tensor) -> Tensor:
        """This parameter's ``[world_size, chunk]`` column block of a bucket buffer."""
        return buffer[:, self.offset : self.offset + self.layout.chunk]


class GradBucket:
    """Parameters that reduce and all-gather together, with this rank's flat shard buffers."""

    def __init__(self, index: int, named_params: Sequence[tuple[str, nn.Parameter]],
                 world_size: int, rank: int, communicates: bool = True,
                 reduce_dtype: torch.dtype | None = None, average_over: int | None = None) -> None:
        self.index = index
        self.world_size = world_size  # ranks sharing the shards: the shard group's size
        self.rank = rank  # in the shard group
        # Ranks whose gradients are averaged: the whole world, more than ``world_size`` when hybrid.
        self.average_over = average_over or world_size
        # Hybrid sharding: shard groups holding this split, and which of them this rank is in.
        self.replicas = 1  # set by the engine
        self.replica_rank = 0
        self.communicates = communicates  # False for optimized-but-frozen parameters
        first = named_params[0][1]
        self.dtype = first.dtype
        self.device = first.device
        self.reduce_dtype = reduce_dtype or self.dtype  # what gradients are summed in
        self.gather_position = -1  # set by ParamGatherer: place in the forward-order gather queue
        layouts = [EvenShard(p.numel(), world_size) for _, p in named_params]
        offsets = [sum(layout.chunk for layout in layouts[:i]) for i in range(len(layouts))]
        self.row_numel = sum(layout.chunk for layout in layouts)
        master_dtype = master_dtype_for(self.dtype)
        self.master_shard = torch.zeros(self.row_numel, dtype=master_dtype, device=self.device)  # 1D
        self.grad_shard = torch.zeros(self.row_numel, dtype=master_dtype, device=self.device)  # 1D
        # Replaced by a view into the reducer's per-device vector ([Note: presence on the device]).
        self.present_count = torch.zeros(len(named_params), dtype=torch.float32, device=self.device)  # 1D
        self.params = [
            ShardedParam(fqn, param, layout, rank, self, offset, j)
            for j, ((fqn, param), layout, offset) in enumerate(zip(named_params, layouts, offsets))
        ]
        self.reported = 0
        self.pending: _PendingReduce | None = None

    @property
    def reduce_numel(self) -> int:
        """Elements of one row of the reduction buffer: the chunks, then one flag per parameter."""
        return self.row_numel + len(self.params)

    # ---- reduction ---------------------------------------------------------------------

    def pack_gradients(self, buffer: Tensor) -> None:
        """Move every present gradient into ``buffer`` (``[ws, reduce_numel]``) and free it."""
        # Every element is written below (padding zeroed per parameter), so the pooled buffer
        # needs no zero-fill pass; flags are device fills, never a host-to-device copy.
        flags = buffer[:, self.row_numel :]
        for j, sp in enumerate(self.params):
            grad = sp.param.grad
            rows = sp.rows(buffer)
            if grad is None:
                rows.zero_()  # no gradient here: zeros in the sum (DESIGN.md, layer drop)
                flags[:, j].zero_()
                continue
            if grad.is_sparse:
                raise ValueError(
                    f"Parameter {sp.fqn!r} has a sparse gradient, which ZeRO sharding cannot split"
                    " evenly. Use dense gradients (e.g. nn.Embedding(sparse=False))."
                )
            comm.copy_flat_to_rows(rows, grad.reshape(-1), sp.layout, zero_padding=True)
            flags[:, j].fill_(1.0)
            # The full gradient dies here: only the packed copy (a pooled slot) lives until the
            # reduction, so no rank keeps two full gradients alive.
            sp.param.grad = None
        if self.predivide:
            buffer[:, : self.row_numel].div_(self.average_over)

    @property
    def predivide(self) -> bool:
        """Average as a SUM of pre-divided values only where the SUM could overflow (fp16);
        otherwise divide the reduced shard, 1/world_size of the data (ReduceOp.AVG is not on
        every backend)."""
        return self.average_over > 1 and self.reduce_dtype == torch.float16

    def launch_reduce(self, pool: BufferPool, slot: int, reduce_scatter: bool,
                      group: dist.ProcessGroup | None, async_op: bool,
                      replica_group: dist.ProcessGroup | None = None) -> None:
        """``reduce_scatter``: leave only this rank's row (native reduce-scatter backends); otherwise
        all-reduce the buffer in place and take the row (gloo: see [Note: gloo reduce-scatter]).
        ``replica_group``: the second hop of [Note: hybrid reduction], launched by :meth:`advance_reduce`."""
        assert self.pending is None, f"bucket {self.index} launched twice in one backward"
        n = self.reduce_numel
        # The reduce-scatter output sits in the same slot, after the input.
        flat = pool.take(slot, n * (self.world_size + (1 if reduce_scatter else 0)), self.reduce_dtype,
                         self.device)
        buffer = flat[: n * self.world_size].view(self.world_size, n)
        try:
            self.pack_gradients(buffer)
        except BaseException:
            pool.give_back(slot, self.device)  # a rejected gradient must not leak the slot
            raise
        if reduce_scatter:
            output = flat[n * self.world_size :]
            work = comm.reduce_scatter(output, buffer.view(-1), group, async_op)
        else:
            work = comm.all_reduce(buffer, group, async_op)
            output = buffer[self.rank]
        self.pending = _PendingReduce(work, output, slot, replica_group, async_op,
                                      rows=None if reduce_scatter else buffer)

    def advance_reduce(self) -> None:
        """Hybrid only: once the shard group's hop is done, start the replica group's all-reduce of
        this rank's row ([Note: hybrid reduction]). A no-op otherwise, or when already started."""
        pending = self.pending
        assert pending is not None
        if pending.replica_group is None:
            return
        comm.wait(pending.work)
        pending.work = comm.all_reduce(pending.output, pending.replica_group, pending.async_op)
        pending.replica_group = None

    def finish_reduce(self, pool: BufferPool, full_gradients: bool = False) -> None:
        """Wait for the reduction, add it to the fp32 shard gradient and the presence counts.
        ``full_gradients`` (stage 1, all-reduced): every parameter's ``.grad`` also gets the whole averaged
        gradient, as under DDP (``finish_backward`` drops it again where no rank produced a gradient)."""
        self.advance_reduce()
        assert self.pending is not None
        pending, self.pending = self.pending, None
        comm.wait(pending.work)  # bounded: see [Note: bounded waits] in _collectives.py
        scale = 1.0 if self.predivide or self.average_over == 1 else 1.0 / self.average_over
        self.grad_shard.add_(pending.output[: self.row_numel], alpha=scale)
        self.present_count.add_(pending.output[self.row_numel :])
        if full_gradients:
            assert pending.rows is not None, "full gradients need the all-reduced rows"
            for sp in self.params:
                grad = torch.empty_like(sp.param)
                comm.copy_rows_to_flat(grad.view(-1), sp.rows(pending.rows), sp.layout)
                sp.param.grad = grad.mul_(scale) if scale != 1.0 else grad
        pool.give_back(pending.slot, self.device)  # the full-size buffer is free from here

    # ---- parameter all-gather ----------------------------------------------------------

    def launch_all_gather(self, pool: BufferPool, slot: int, group: dist.ProcessGroup | None,
                          async_op: bool, piece_numel: int | None = None) -> _PendingGather:
        """``piece_numel`` (gloo): a bucket with a larger output is gathered synchronously, piece
        by piece (:func:`~lightning_zero._collectives.all_gather_in_pieces`); ParamGatherer runs
        gloo's gathers on its own thread, so only that thread waits."""
        # For fp32 parameters ``to`` returns the master shard itself (no copy): the gather must
        # be finished before the next inner step writes it (ParamGatherer.finish in the step).
        gather_input = self.master_shard.to(self.dtype)
        gathered = pool.take(slot, self.world_size * self.row_numel, self.dtype, self.device)
        rows = gathered.view(self.world_size, self.row_numel)
        if piece_numel is not None and gathered.numel() > piece_numel:
            comm.all_gather_in_pieces(rows, gather_input, group, piece_numel)
            work = None
        else:
            work = comm.all_gather(gathered, gather_input, group, async_op)
        return _PendingGather(self, work, rows, gather_input, slot)

    def reset_backward(self) -> None:
        self.reported = 0
        for sp in self.params:
            sp.reported = False


@dataclass
class _PendingReduce:
    work: comm.Work
    output: Tensor  # this rank's row (in the pooled slot), flags after the chunks
    slot: int
    replica_group: dist.ProcessGroup | None = None  # hybrid: the hop still to launch (None once launched)
    async_op: bool = True
    rows: Tensor | None = None  # [world_size, reduce_numel]: every row, when all-reduced (full gradients)


@dataclass
class _PendingGather:
    bucket: GradBucket
    work: comm.Work
    gathered: Tensor  # [world_size, row_numel], a pooled slot
    gather_input: Tensor  # kept alive until the collective completes
    slot: int

    def finish(self, pool: BufferPool) -> None:
        comm.wait(self.work)  # bounded: see [Note: bounded waits] in _collectives.py
        with torch.no_grad():
            for sp in self.bucket.params:
                comm.copy_rows_to_flat(sp.param.data.view(-1), sp.rows(self.gathered), sp.layout)
        pool.give_back(self.slot, self.bucket.device)


class ParamGatherer:
    """The all-gathers after the step, in forward order, at most ``MAX_IN_FLIGHT`` at a time.

    See [Note: gather overlap]. ``start`` queues the buckets and starts the gather program;
    ``wait_for(position)`` returns once every queued bucket up to that forward position is in the
    parameters (a parameter read); ``finish`` waits for all. All are no-ops when nothing is
    queued, so callers can call them freely. Call order, on the training thread only:
    ``start`` (the step) -> ``wait_for``* (reads) -> ``finish`` (backward, step, close).
    """

    def __init__(self, buckets: Sequence[GradBucket], group: dist.ProcessGroup | None,
                 pool: BufferPool, async_op: bool, background: bool) -> None:
        # Forward order: buckets were built in backward (reverse registration) order.
        self.order = list(reversed(buckets))
        for position, bucket in enumerate(self.order):
            bucket.gather_position = position
        self.group = group
        self.pool = pool
        self.async_op = async_op
        self.background = background  # False: the program runs to its end inside ``start``
        # Fixed here, not read at each launch: every rank must split the same buckets the same way.
        self.piece_numel = comm.GLOO_GATHER_PIECE_NUMEL if comm.gathers_through_a_copy(group) else None
        self._queue: list[GradBucket] = []
        self._consumed = 0  # queue entries the training thread has waited for
        self._done: list[threading.Event] = []  # CPU: set by the gather thread per entry
        self._cuda_done: list[Any] = []  # CUDA: an event on the gather stream per entry
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._side_stream: Any = None
        self.in_flight = 0
        """Gathers launched and not yet copied into the parameters (bounded by the pool's slots)."""
        self.launch_hook: Callable[[ParamGatherer], None] | None = None
        """Called after every launch (tests and benchmarks watch the in-flight bound with it)."""

    @property
    def pending(self) -> bool:
        return self._consumed < len(self._queue)

    def start(self, buckets: Iterable[GradBucket]) -> None:
        """Queue ``buckets`` (in forward order, the same on every rank) and start gathering them."""
        self.finish()  # an older round first: its buffers and its order come before ours
        wanted = set(buckets)
        queue = [b for b in self.order if b in wanted]
        if not queue:
            return
        self._queue, self._consumed, self._error = queue, 0, None
        device = queue[0].device
        if not self.background:
            self._run(queue, lambda _: None)
            self._queue = []
            self.pool.release()
        elif device.type == "cuda":
            # Everything is enqueued now, on a side stream ordered after the step; nothing here
            # blocks the host, and a read waits on the device for its bucket's event only.
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(device)
            side = self._side_stream
            side.wait_stream(torch.cuda.current_stream(device))
            self._cuda_done = [torch.cuda.Event() for _ in queue]
            with torch.cuda.stream(side):
                self._run(queue, lambda i: self._cuda_done[i].record(side))
        else:
            # gloo's wait blocks the calling thread: a thread of our own runs the program, so the
            # gathers proceed whatever the training thread does ([Note: gather overlap]).
            self._done = [threading.Event() for _ in queue]
            self._thread = threading.Thread(target=self._run_in_thread, args=(queue,), daemon=True,
                                            name="lightning_zero-param-gather")
            self._thread.start()

    def _run(self, queue: Sequence[GradBucket], done: Callable[[int], None]) -> None:
        """Launch in order, keeping at most the pool's slots in flight; ``done(i)`` per copy-out."""
        in_flight: deque[tuple[int, _PendingGather]] = deque()
        for index, bucket in enumerate(queue):
            if len(in_flight) == self.pool.slots:
                finished, gather = in_flight.popleft()
                gather.finish(self.pool)
                done(finished)
            in_flight.append((index, bucket.launch_all_gather(self.pool, index, self.group, self.async_op,
                                                              self.piece_numel)))
            self.in_flight = len(in_flight)
            if self.launch_hook is not None:
                self.launch_hook(self)
        while in_flight:
            finished, gather = in_flight.popleft()
            gather.finish(self.pool)
            self.in_flight = len(in_flight)
            done(finished)

    def _run_in_thread(self, queue: Sequence[GradBucket]) -> None:
        try:
            with torch.no_grad():
                self._run(queue, lambda i: self._done[i].set())
        except BaseException as exc:  # raised on the training thread at its next wait
            self._error = exc
            for event in self._done:
                event.set()

    def wait_for(self, position: int) -> None:
        """Return once every queued bucket at forward ``position`` or before is in the parameters."""
        while self._consumed < len(self._queue) and self._queue[self._consumed].gather_position <= position:
            if self._cuda_done:
                torch.cuda.current_stream(self._queue[0].device).wait_event(self._cuda_done[self._consumed])
            else:
                self._done[self._consumed].wait()
                if self._error is not None:
                    error, self._error = self._error, None
                    self._end_round()
                    # The cause's own words first: a lost or frozen peer is named there.
                    raise RuntimeError(f"The parameter all-gather failed in its thread: {error}") from error
            self._consumed += 1
        if self._queue and self._consumed == len(self._queue):
            self._end_round()

    def _end_round(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._queue, self._consumed, self._done, self._cuda_done = [], 0, [], []
        self.pool.release()  # every gather is waited for: [Note: pool between steps]

    def finish(self) -> None:
        if self.pending:
            self.wait_for(len(self.order))


class GradReducer:
    """Backward hooks that launch the bucket reductions, in a fixed order, and their flush."""

    def __init__(self, buckets: Sequence[GradBucket], stage: int, group: dist.ProcessGroup | None,
                 overlap_communication: bool, pool: BufferPool,
                 before_first_reduction: Callable[[], None] = lambda: None,
                 replica_group: dist.ProcessGroup | None = None, full_gradients: bool = False) -> None:
        self.buckets = [b for b in buckets if b.communicates]
        self.full_gradients = full_gradients  # stage 1: whole averaged gradients in param.grad too
        self.stage = stage
        self.group = group  # the shard group
        self.replica_group = replica_group  # hybrid only: see [Note: hybrid reduction]
        self.async_op = overlap_communication
        self.pool = pool
        self.before_first_reduction = before_first_reduction  # finishes pending parameter gathers
        # Full gradients need every rank's row: all-reduce then, also where reduce-scatter is native.
        self.reduce_scatter = comm.has_native_reduce_scatter(group) and not full_gradients
        # One presence vector per device; each bucket's flags are a view ([Note: presence on the device]).
        by_device: dict[torch.device, list[GradBucket]] = {}
        for bucket in self.buckets:
            by_device.setdefault(bucket.device, []).append(bucket)
        self._presence: list[tuple[Tensor, list[GradBucket]]] = []
        for device, members in by_device.items():
            vector = torch.zeros(sum(len(b.params) for b in members), dtype=torch.float32, device=device)  # 1D
            start = 0
            for bucket in members:
                bucket.present_count = vector[start : start + len(bucket.params)]
                start += len(bucket.params)
            self._presence.append((vector, members))
        self._presence_stale = False
        self._next_launch = 0
        self._next_finish = 0
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
        self._callback_queued = False
        if not self._sync_enabled:
            return
        self.before_first_reduction()  # a no-op unless no hook fired (ensure_flushed)
        while self._next_launch < len(self.buckets):
            self._launch_next()
        while self._next_finish < len(self.buckets):
            self._finish_next()
        # Provisional until resolve_presence: see [Note: presence on the device].
        for bucket in self.buckets:
            for sp in bucket.params:
                sp.master.grad = sp.grad_shard
            bucket.reset_backward()
        self._presence_stale = True
        self._next_launch = 0
        self._next_finish = 0
        self._flushed = True
        if self.full_gradients:
            # As under DDP, a parameter no rank produced a gradient for has none: the presence is read
            # now (the step's one device-to-host read, earlier), before hooks read ``.grad``.
            self.resolve_presence()
            for bucket in self.buckets:
                for sp in bucket.params:
                    if not sp.has_grad:
                        sp.param.grad = None

    def resolve_presence(self) -> None:
        """Read the reduced presence counts (one device-to-host copy per device, at most once per
        step) and drop ``master.grad`` of parameters that got no gradient on any rank."""
        if not self._presence_stale:
            return
        self._presence_stale = False
        for vector, members in self._presence:
            present = vector.gt(0).tolist()
            vector.zero_()
            flat = (sp for bucket in members for sp in bucket.params)
            for sp, got in zip(flat, present, strict=True):
                sp.has_grad = sp.has_grad or got
                sp.master.grad = sp.grad_shard if sp.has_grad else None

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
