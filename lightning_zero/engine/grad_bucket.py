"""A gradient bucket: parameters that reduce and all-gather together, and their shards on this rank.

Granularity follows FSDP2: a :class:`ShardedParam` owns one parameter's shard on this rank (as
``FSDPParam``; here views into its bucket's flat buffers), a :class:`GradBucket` owns a group of
parameters that communicate together (as ``FSDPParamGroup``) and the launch and completion of its
collectives, and :class:`PresenceCounts` holds every communicating bucket's reduced presence flags.
Who launches which bucket when is :mod:`lightning_zero.engine.grad_reducer` (backward) and
:mod:`lightning_zero.engine.param_gather` (after the step); the full-size buffers come from
:mod:`lightning_zero.engine.comm_pool`; the collectives are the stateless functions of
:mod:`lightning_zero.engine.collectives`.

[Note: bucket layout] A bucket's communication buffer is ``[shard_size, row_numel + k]``:
row ``r`` holds, for every parameter of the bucket, its padded chunk ``r`` (so rows are
``g-0 | g-1 | ...``: rank r's chunks of every parameter side by side), followed by ``k`` (= parameters in the bucket) presence
flags. Every rank writes 1 into the flag column of each parameter it has a gradient for, in
every row, so after the reduction every rank holds, per parameter, how many ranks produced a
gradient. That tells all ranks, without a collective of its own, which parameters got no
gradient anywhere (layer drop) and must be left untouched by the optimizer.

[Note: presence on the device] The flags are written on the device (a ``fill_`` per parameter,
no host-to-device copy) and the reduced counts are added, in place, to one persistent device
vector per device (:class:`PresenceCounts`; each bucket's counts are a view of it). Nothing is read
back during backward: every parameter of a communicating bucket provisionally gets its shard
gradient as ``master.grad`` (zeros where no rank had one, so a GradScaler's unscale and an inf check
see only zeros), and :meth:`PresenceCounts.resolve` reads the counts once per step, at clipping or
at the step, and takes ``.grad`` away from parameters no rank produced a gradient for, before the
inner optimizer looks at them.

[Note: gradient shards between steps] A bucket's fp32 gradient shard (``4 Psi / N`` bytes over the
model) is needed from the first reduction of a backward until the step has read it; DeepSpeed's ZeRO-2
frees its gradient partitions after the step, so between steps it holds the parameters, the master
shard and the optimizer state only. So does this engine: ``zero_grad(set_to_none=True)`` releases
the shard (:meth:`GradBucket.release_grad_shard`) and the first reduction after it writes a new one
(:meth:`GradBucket._fold_into_grad_shard`: copy and scale, the same values as adding to zeros).
Gradient accumulation is untouched (no ``zero_grad`` between micro-batches, so each reduction adds
to the shard held), and so is a loop that never calls ``zero_grad`` (the shard keeps accumulating
across steps, as ``.grad`` does). ``zero_grad(set_to_none=False)`` zeroes the storage and keeps it,
as PyTorch keeps ``.grad`` then, and ``ZeroConfig.release_grad_shards=False`` does so for every call.
On CUDA the caching allocator gives the block back at no cost; on CPU the new allocation can cost
page faults (BENCHMARKS.md measures them against the step). Lightning's automatic optimization calls
``zero_grad`` inside the next step's closure, after its ``training_step`` (forward) and before its
backward, so under the Trainer the shards are freed from then until that backward's first reduction;
a plain loop (and Fabric) that calls ``zero_grad`` after ``step`` frees them over the forward too.

[Note: hybrid reduction] With a shard group smaller than the world (``shard_group_size``), a
bucket's buffer is ``[shard_group_size, ...]`` and its reduction has two hops: the reduce-scatter
(or gloo's in-place all-reduce) within the shard group leaves this rank's row summed over its
shard group, then that row alone (1/N of the bytes, flags included, so presence counts span the
whole world) is all-reduced across the replica group. The second hop of bucket ``i`` is launched
once bucket ``i + 1``'s first hop is on its way (:meth:`GradReducer._launch_next
<lightning_zero.engine.grad_reducer.GradReducer._launch_next>`), so both run during backward; each group
sees its collectives in bucket order on every rank. Averaging divides by the whole world size.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero.engine import collectives as comm
from lightning_zero.engine.comm_pool import BufferPool
from lightning_zero.engine.sharding import EvenShard, HybridLayout


class ReplicaHop(Protocol):
    """A second hop that is not a process group of this job: fault_tolerance.ReplicaGroups."""

    def all_reduce(self, tensor: Tensor) -> Any: ...


def master_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """fp32 master copies for low-precision parameters; float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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
        self.has_grad = False  # some rank produced a gradient since the last zero_grad (host view)
        self.reported = False  # this rank's hook fired in the current backward
        # Stepped on the whole parameter ([Note: whole-matrix step] in whole_step.py); then the state
        # under these keys is held as even shards like the master, every other value whole.
        self.shape_aware = False
        self.split_state_keys: frozenset[str] = frozenset()
        self.load_master_from(param.detach())
        # The parameter's autograd version when the master last agreed with it: an in-place write
        # into the parameter (``copy_``, ``load_state_dict``) moves it; the engine's own gathers
        # write through ``.data`` and do not ([Note: the module is the truth] in zero_engine.py).
        self.adopted_version = param._version

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
    def grad_shard(self) -> Tensor:
        """1D view: this parameter's reduced fp32 gradient shard, in its bucket's flat buffer (taken, as
        zeros, if the bucket holds none: [Note: gradient shards between steps])."""
        return self.bucket.grad_shard[self.offset : self.offset + self.shard_numel]

    @property
    def present_count(self) -> Tensor:
        """0-dim device view: ranks that produced a gradient since the last resolve (reduced)."""
        return self.bucket.present_count[self.flag_index]

    def rows(self, buffer: Tensor) -> Tensor:
        """This parameter's ``[shard_size, chunk]`` column block of a bucket buffer."""
        return buffer[:, self.offset : self.offset + self.layout.chunk]


_GROUP = 32
"""Parameters a foreach copy of a bucket's blocks takes at a time ([Note: one copy a bucket])."""


class OwnViews:
    """The masters in their parameter's own dtype and this rank's elements of those parameters (views), kept
    while they are the same masters and the parameters keep their addresses: a save compares every parameter, and
    slicing each again was per-parameter Python on the training thread at every save (BENCHMARKS.md)."""

    def __init__(self) -> None:
        self._key: list[int] | None = None
        self._pair: tuple[list[Tensor], list[Tensor]] = ([], [])

    def of(self, params: list[ShardedParam]) -> tuple[list[Tensor], list[Tensor]]:
        """(masters, views) of ``params`` (all in their parameter's dtype)."""
        # The masters' ids: the pair holds the masters, so no other object takes one while it is kept.
        key = [*(id(sp.master) for sp in params), *((sp.param.data_ptr(), sp.param.stride()) for sp in params)]
        if key == self._key:
            return self._pair
        pair = [sp.master for sp in params], [sp.own_elements(sp.param.detach()) for sp in params]
        # A view only: reshaping a parameter that is not contiguous copies it, and a copy would go stale.
        views = all(v.untyped_storage().data_ptr() == sp.param.untyped_storage().data_ptr()
                    for v, sp in zip(pair[1], params))
        self._key, self._pair = (key, pair) if views else (None, ([], []))
        return pair


@torch.no_grad()
def adopt_param_writes(params: Iterable[ShardedParam], compare_values: bool, views: OwnViews | None = None) -> None:
    """Take into each master what was written into this rank's elements of its parameter since the master
    last agreed with it (the parameter's autograd version moved; ``compare_values``: always, which also finds
    writes that leave the version as it was, ``p.data.copy_``, and needs the parameters to hold the last
    gather). Elements still equal to the master in the parameter's dtype keep the master (its fp32 precision
    under bf16 parameters). Masters in their parameter's own dtype take their elements in one foreach copy:
    a save of a model of many small parameters compares them all, and a Python call each held the GIL. ``views``:
    where the views of a comparison of every parameter are kept."""
    written = [(sp, sp.param._version) for sp in params if compare_values or sp.param._version != sp.adopted_version]
    same_dtype = [sp for sp, _ in written if sp.master.dtype == sp.param.dtype]
    if same_dtype:
        masters, own = (views.of(same_dtype) if views is not None and compare_values else
                        ([sp.master for sp in same_dtype], [sp.own_elements(sp.param.detach()) for sp in same_dtype]))
        torch._foreach_copy_(masters, own)
    for sp, version in written:
        if sp.master.dtype != sp.param.dtype:
            own = sp.own_elements(sp.param.detach())
            changed = own != sp.master.to(own.dtype)
            sp.master.copy_(torch.where(changed, own.to(sp.master.dtype), sp.master))
        sp.adopted_version = version


class PresenceCounts:
    """The reduced presence counts of every communicating bucket: one vector per device, of which each
    bucket holds a view from its construction, read at most once per step ([Note: presence on the device]).

    Call order: (engine) ``PresenceCounts(devices)`` -> (each communicating bucket, in launch order)
    ``claim`` -> per backward (reducer) ``mark_reduced`` -> at clipping or the step ``resolve``."""

    def __init__(self, devices: Iterable[torch.device]) -> None:
        """``devices``: the device of every parameter that will communicate, one entry each."""
        sizes = Counter(devices)
        self._vectors = {device: torch.zeros(n, dtype=torch.float32, device=device)  # 1D
                         for device, n in sizes.items()}
        self._members: dict[torch.device, list[ShardedParam]] = {device: [] for device in sizes}
        self._unread = False  # counts were reduced into the vectors since they were last read

    def claim(self, device: torch.device, params: Sequence[ShardedParam]) -> Tensor:
        """The next ``len(params)`` counts of ``device``'s vector (1D view), one per parameter."""
        members = self._members[device]
        start = len(members)
        assert start + len(params) <= len(self._vectors[device]), "more parameters claimed than declared"
        members.extend(params)
        return self._vectors[device][start : start + len(params)]

    def mark_reduced(self) -> None:
        """A backward's reductions were added to the counts: the next :meth:`resolve` reads them."""
        self._unread = True

    def resolve(self) -> None:
        """Read the reduced presence counts (one device-to-host copy per device, at most once per
        step) and drop ``master.grad`` of parameters that got no gradient on any rank."""
        if not self._unread:
            return
        self._unread = False
        for device, vector in self._vectors.items():
            present = vector.gt(0).tolist()
            vector.zero_()
            for sp, got in zip(self._members[device], present, strict=True):
                sp.has_grad = sp.has_grad or got
                sp.master.grad = sp.grad_shard if sp.has_grad else None


class GradBucket:
    """Parameters that reduce and all-gather together, with this rank's flat shard buffers."""

    def __init__(self, index: int, named_params: Sequence[tuple[str, nn.Parameter]],
                 layout: HybridLayout, rank: int, presence: PresenceCounts | None = None,
                 reduce_dtype: torch.dtype | None = None) -> None:
        """``rank``: this rank in the data-parallel group. ``presence``: where a communicating bucket's
        counts live; None for a bucket of frozen parameters, which never reduces (its shards are
        still gathered and checkpointed)."""
        self.index = index
        self.shard_size = layout.shard_group_size  # ranks the shards are split over: the shard group
        self.rank = layout.shard_rank(rank)  # in the shard group
        # Ranks whose gradients are averaged: the whole world, more than ``shard_size`` when hybrid.
        self.average_over = layout.world_size
        # Hybrid sharding: shard groups holding this split, and which of them this rank is in.
        self.replicas = layout.num_replicas
        self.replica_rank = layout.replica_rank(rank)
        self.communicates = presence is not None  # False for optimized-but-frozen parameters
        first = named_params[0][1]
        self.dtype = first.dtype
        self.device = first.device
        self.reduce_dtype = reduce_dtype or self.dtype  # what gradients are summed in
        shards = [EvenShard(p.numel(), self.shard_size) for _, p in named_params]
        offsets = [sum(shard.chunk for shard in shards[:i]) for i in range(len(shards))]
        self.row_numel = sum(shard.chunk for shard in shards)
        # A row's columns, parameter by parameter, in groups ([Note: one copy a bucket]): per group, its first
        # parameter, its columns, and its parameters (by place in the group) whose block holds no padding, the others.
        self.chunks = [shard.chunk for shard in shards]
        exact = [shard.numel == shard.padded_numel > 0 for shard in shards]  # the block holds no padding
        self.padded = [j for j, no_padding in enumerate(exact) if not no_padding]
        self._groups = [(first, offsets[first], sum(self.chunks[:first + _GROUP]),
                         [i for i, no_padding in enumerate(exact[first:first + _GROUP]) if no_padding],
                         [i for i, no_padding in enumerate(exact[first:first + _GROUP]) if not no_padding])
                        for first in range(0, len(shards), _GROUP)]
        master_dtype = master_dtype_for(self.dtype)
        self.master_shard = torch.zeros(self.row_numel, dtype=master_dtype, device=self.device)  # 1D
        # 1D, master dtype; None between steps ([Note: gradient shards between steps]).
        self._grad_shard: Tensor | None = None
        self.params = [
            ShardedParam(fqn, param, shard, self.rank, self, offset, j)
            for j, ((fqn, param), shard, offset) in enumerate(zip(named_params, shards, offsets))
        ]
        # A view of the per-device vector ([Note: presence on the device]); never read when frozen.
        self.present_count = presence.claim(self.device, self.params) if presence is not None \
            else torch.zeros(len(self.params), dtype=torch.float32, device=self.device)  # 1D
        self.reported = 0
        self.pending: PendingReduce | None = None

    @property
    def grad_shard(self) -> Tensor:
        """This rank's reduced gradient shard of the whole bucket (1D, master dtype), taken as zeros
        when none is held ([Note: gradient shards between steps])."""
        if self._grad_shard is None:
            self._grad_shard = torch.zeros_like(self.master_shard)
        return self._grad_shard

    def column_groups(self, rows: Tensor) -> Iterator[tuple[int, tuple[Tensor, ...], list[int], list[int]]]:
        """Per group of parameters: the first, their ``[shard_size, chunk]`` blocks of ``rows`` (a bucket buffer),
        which of them hold no padding and which do ([Note: one copy a bucket])."""
        for first, start, end, exact, padded in self._groups:
            yield first, rows[:, start:end].split(self.chunks[first:first + _GROUP], dim=1), exact, padded

    def grad_shard_views(self) -> list[Tensor]:
        """Each parameter's :attr:`ShardedParam.grad_shard`, from one split ([Note: one copy a bucket])."""
        views = list(self.grad_shard.split(self.chunks))
        for j in self.padded:
            views[j] = views[j][: self.params[j].shard_numel]
        return views

    @property
    def holds_grad_shard(self) -> bool:
        """Whether the gradient shard's storage is allocated now (what the memory checks read)."""
        return self._grad_shard is not None

    def release_grad_shard(self) -> None:
        """Free the gradient shard's storage (``zero_grad``): the next reduction takes it again.
        Callers drop every ``master.grad`` view of it too, or the storage would stay alive."""
        self._grad_shard = None

    def _fold_into_grad_shard(self, reduced: Tensor, scale: float) -> None:
        """Add a reduced row's chunks (``scale``-averaged) to the gradient shard; the first reduction
        since a release writes it (copy and scale: the same values as adding to zeros, one pass less)."""
        if self._grad_shard is None:
            shard = torch.empty_like(self.master_shard)
            shard.copy_(reduced)
            if scale != 1.0:
                shard.mul_(scale)
            self._grad_shard = shard
        else:
            self._grad_shard.add_(reduced, alpha=scale)

    @property
    def reduce_numel(self) -> int:
        """Elements of one row of the reduction buffer: the chunks, then one flag per parameter."""
        return self.row_numel + len(self.params)

    # ---- reduction ---------------------------------------------------------------------

    @torch.no_grad()  # the values only: a gradient of ``backward(create_graph=True)`` has a history
    def pack_gradients(self, buffer: Tensor) -> None:
        """Move every present gradient into ``buffer`` (``[ws, reduce_numel]``) and free it.

        [Note: one copy a bucket] Packing the gradients and copying the gathered parameters back were a few
        tensor ops each per parameter, Python on the training thread (or the gather thread) at every step: a
        third of the step of a model of 800 small parameters on one rank (BENCHMARKS.md, "The engine's step on
        many small parameters"). A bucket's row is its parameters' columns in order, so one ``split`` of the
        buffer gives every parameter's ``[shard_size, chunk]`` block, and the blocks without padding (most
        parameters: the numel divides by the shard group's size) move in one ``_foreach_copy_``; a padded block
        and a missing gradient take the per-parameter path. A few dozen parameters at a time: a step that held a
        view of every parameter at once kept more objects alive than the collector's youngest generation holds, and
        every few dozen steps that set off a full collection of the heap (BENCHMARKS.md)."""
        # Every element is written below (padding zeroed per parameter), so the pooled buffer
        # needs no zero-fill pass; flags are device fills, never a host-to-device copy.
        flags = buffer[:, self.row_numel :]
        grads = [sp.param.grad for sp in self.params]
        if not any(grad is None or grad.is_sparse for grad in grads):
            for first, columns, exact, padded in self.column_groups(buffer):
                if exact:
                    torch._foreach_copy_([columns[i] for i in exact], [
                        grads[first + i].reshape(self.shard_size, self.chunks[first + i]) for i in exact])
                for i in padded:
                    comm.copy_flat_to_rows(columns[i], grads[first + i].reshape(-1), self.params[first + i].layout,
                                           zero_padding=True)
            flags.fill_(1.0)
            for sp in self.params:
                sp.param.grad = None  # as below
            if self.predivide:
                buffer[:, : self.row_numel].div_(self.average_over)
            return
        for j, sp in enumerate(self.params):
            grad = sp.param.grad
            rows = sp.rows(buffer)
            if grad is None:
                rows.zero_()  # no gradient here (a dropped layer): zeros in the sum
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
        otherwise divide the reduced shard, 1/shard_size of the data (ReduceOp.AVG is not on
        every backend)."""
        return self.average_over > 1 and self.reduce_dtype == torch.float16

    def launch_reduce(self, pool: BufferPool, slot: int, reduce_scatter: bool,
                      group: dist.ProcessGroup | None, async_op: bool,
                      replica_group: dist.ProcessGroup | ReplicaHop | None = None) -> None:
        """``reduce_scatter``: leave only this rank's row (native reduce-scatter backends); otherwise
        all-reduce the buffer in place and take the row (gloo: see [Note: gloo reduce-scatter] in
        grad_reducer.py). ``replica_group``: the second hop of [Note: hybrid reduction], launched by
        :meth:`advance_reduce`."""
        assert self.pending is None, f"bucket {self.index} launched twice in one backward"
        n = self.reduce_numel
        # The reduce-scatter output sits in the same slot, after the input.
        flat = pool.take(slot, n * (self.shard_size + (1 if reduce_scatter else 0)), self.reduce_dtype,
                         self.device)
        buffer = flat[: n * self.shard_size].view(self.shard_size, n)
        try:
            self.pack_gradients(buffer)
        except BaseException:
            pool.give_back(slot, self.device)  # a rejected gradient must not leak the slot
            raise
        if reduce_scatter:
            output = flat[n * self.shard_size :]
            work = comm.reduce_scatter(output, buffer.view(-1), group, async_op)
        else:
            work = comm.all_reduce(buffer, group, async_op)
            output = buffer[self.rank]
        self.pending = PendingReduce(work, output, slot, replica_group, async_op,
                                     rows=None if reduce_scatter else buffer)

    def advance_reduce(self) -> None:
        """Hybrid only: once the shard group's hop is done, start the replica group's all-reduce of
        this rank's row ([Note: hybrid reduction]). A no-op otherwise, or when already started."""
        pending = self.pending
        assert pending is not None
        if pending.replica_group is None:
            return
        comm.wait(pending.work)
        hop = pending.replica_group
        if isinstance(hop, dist.ProcessGroup):
            pending.work = comm.all_reduce(pending.output, hop, pending.async_op)
        else:  # across replica groups: [Note: one step across groups] in fault_tolerance.py
            pending.work = hop.all_reduce(pending.output)
        pending.replica_group = None

    def finish_reduce(self, pool: BufferPool, full_gradients: bool = False) -> None:
        """Wait for the reduction, add it to the fp32 shard gradient and the presence counts.
        ``full_gradients`` (stage 1, all-reduced): every parameter's ``.grad`` also gets the whole averaged
        gradient, as under DDP (``finish_backward`` drops it again where no rank produced a gradient)."""
        self.advance_reduce()
        assert self.pending is not None
        pending, self.pending = self.pending, None
        comm.wait(pending.work)  # bounded: see [Note: bounded waits] in collectives.py
        scale = 1.0 if self.predivide or self.average_over == 1 else 1.0 / self.average_over
        self._fold_into_grad_shard(pending.output[: self.row_numel], scale)
        self.present_count.add_(pending.output[self.row_numel :])
        if full_gradients:
            assert pending.rows is not None, "full gradients need the all-reduced rows"
            for sp in self.params:
                grad = torch.empty_like(sp.param)
                comm.copy_rows_to_flat(grad.view(-1), sp.rows(pending.rows), sp.layout)
                sp.param.grad = grad.mul_(scale) if scale != 1.0 else grad
        pool.give_back(pending.slot, self.device)  # the full-size buffer is free from here

    def reset_backward(self) -> None:
        self.reported = 0
        for sp in self.params:
            sp.reported = False

    # ---- parameter all-gather ----------------------------------------------------------

    def launch_all_gather(self, pool: BufferPool, slot: int, group: dist.ProcessGroup | None,
                          async_op: bool, broadcast_sources: Sequence[int] | None = None) -> PendingGather:
        """``broadcast_sources`` (gloo, :func:`~lightning_zero.engine.collectives.broadcast_sources`): gathered
        synchronously, row by row (:func:`~lightning_zero.engine.collectives.all_gather_by_broadcasts`);
        ParamGatherer runs gloo's gathers on its own thread, so only that thread waits."""
        # For fp32 parameters ``to`` returns the master shard itself (no copy): the gather must
        # be finished before the next inner step writes it (ParamGatherer.finish in the step).
        gather_input = self.master_shard.to(self.dtype)
        gathered = pool.take(slot, self.shard_size * self.row_numel, self.dtype, self.device)
        rows = gathered.view(self.shard_size, self.row_numel)
        if broadcast_sources is not None:
            comm.all_gather_by_broadcasts(rows, gather_input, group, broadcast_sources)
            work = None
        else:
            work = comm.all_gather(gathered, gather_input, group, async_op)
        return PendingGather(self, work, rows, gather_input, slot)


@dataclass
class PendingReduce:
    """A bucket's reduction in flight (:meth:`GradBucket.launch_reduce` -> :meth:`GradBucket.finish_reduce`)."""

    work: comm.Work
    output: Tensor  # this rank's row (in the pooled slot), flags after the chunks
    slot: int
    # hybrid: the hop still to launch (None once launched); a ReplicaGroups across replica groups
    replica_group: dist.ProcessGroup | ReplicaHop | None = None
    async_op: bool = True
    rows: Tensor | None = None  # [shard_size, reduce_numel]: every row, when all-reduced (full gradients)


@dataclass
class PendingGather:
    """A bucket's all-gather in flight; :meth:`finish` copies it into the parameters and frees the slot."""

    bucket: GradBucket
    work: comm.Work
    gathered: Tensor  # [shard_size, row_numel], a pooled slot
    gather_input: Tensor  # kept alive until the collective completes
    slot: int

    def finish(self, pool: BufferPool) -> None:
        comm.wait(self.work)  # bounded: see [Note: bounded waits] in collectives.py
        bucket, params = self.bucket, self.bucket.params
        with torch.no_grad():
            # Through ``.data``: the engine's own write moves no autograd version ([Note: the module is the truth]).
            for first, columns, exact, padded in bucket.column_groups(self.gathered):  # [Note: one copy a bucket]
                if exact:
                    torch._foreach_copy_([params[first + i].param.data.view(bucket.shard_size, bucket.chunks[first + i])
                                          for i in exact], [columns[i] for i in exact])
                for i in padded:
                    comm.copy_rows_to_flat(params[first + i].param.data.view(-1), columns[i], params[first + i].layout)
        pool.give_back(self.slot, self.bucket.device)
