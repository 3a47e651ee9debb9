"""How a flat shard is handed to ``torch.distributed.checkpoint`` (DCP) in ``sharded`` mode.

[Note: flat chunks for DCP] A :class:`~lightning_zero.checkpoint.formats.tree.FlatShard` is the local
part of a 1-D tensor with ``Shard(0)`` placement: elements ``[start, start + len)`` of the
flattened parameter, ``start`` fixed by the even split. DCP stores such a chunk by its global
offset and size, and any world size reads back the ranges it needs.

A 1-D DTensor would describe the same chunk, but DCP asks a DTensor for its offset through
``compute_local_shape_and_global_offset``, which in torch 2.13 builds ``torch.arange`` over the
whole local shard for every tensor: 8 bytes per element of the shard, at every save and every
load (about 0.1 s of a 284 MB save here; 7 GB for one 7B-parameter tensor group at 8 ranks).
:class:`FlatChunk` implements the checkpointable protocol DCP asks of DTensor
(``__create_write_items__``, ``__create_chunk_list__``) with the offset the even split already
knows, and the two planners hand DCP its local tensor where DCP would look into a DTensor. The
files and ``.metadata`` are the same as for the DTensor: standard DCP readers, with DTensors or
plain tensors as targets, read them.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from lightning_zero import _compat
from lightning_zero.checkpoint.formats.tree import FlatShard
from lightning_zero.checkpoint.runtime.process import gc_paused


class FlatChunk:
    """One rank's chunk of a flattened tensor of ``numel`` elements, for DCP (see the module note).

    ``offset`` is where the chunk starts in the flat tensor; an empty chunk (a trailing rank of a
    tensor smaller than the group) sits at ``numel``, where DTensor puts it."""

    def __init__(self, local: Tensor, numel: int, offset: int) -> None:
        self.local = local
        self.numel = numel
        self.offset = offset

    @classmethod
    def of(cls, shard: FlatShard) -> FlatChunk:
        return cls(shard.local, shard.numel, shard.layout.start(shard.rank))

    def size(self) -> torch.Size:
        return torch.Size([self.numel])

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.offset]), sizes=torch.Size([self.local.numel()]))

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        chunk = self._chunk()
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(
                              self.local), size=self.size()))]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()]

    def __repr__(self) -> str:
        return f"FlatChunk(numel={self.numel}, offset={self.offset}, local={self.local.numel()})"


_FLAT_VALUES = (Tensor, FlatChunk)
"""The values DCP's flattening leaves as they are (a plain tensor, a flat chunk)."""


# [Note: no collections while planning]
# DCP's plans and `.metadata` are millions of small objects at scale (1.2M items at 1024 ranks of
# a 291-tensor model, each a dataclass holding torch.Size values). Building them (the coordinator's
# global save plan, a rank's load plan) or unpickling them (every loading rank's `.metadata`)
# triggers Python's cyclic collector over and over, and each full collection walks every object
# made so far: the work grows faster than the object count. None of these objects form cycles
# that need collecting, so the collector is paused while they are made (`bench/scale.py` measures
# both). The pause is process-wide, for the seconds the planning takes; a `sharded` save keeps it for the
# whole of DCP's save (modes/sharded.py).


class FlatChunkSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, for state dicts that hold :class:`FlatChunk` values.

    ``spread_replicas``: see [Note: spread replicated writes]. ``cache_key``: given, DCP's plans are
    cached under it ([Note: cached save plans]; the same key on every rank, see :func:`plan_cache_key`)."""

    def __init__(self, spread_replicas: bool = False, cache_key: str | None = None, pause_gc: bool = True) -> None:
        super().__init__(dedup_save_to_lowest_rank=True, **_compat.save_planner_kwargs(cache_key is not None))
        if cache_key is not None:
            self._cached_plans_key = cache_key  # DCP's caches are class attributes under this name
        self.spread_replicas = spread_replicas
        self.pause_gc = pause_gc
        self.bytes_planned = 0

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False) -> None:
        """A ``sharded`` save's tensors are already one flat dict of plain tensors and flat chunks under string
        keys: DCP's flattening (a walk of every value, then of every ``ShardedTensor``) would hand it back as it
        is, with each key its own path, which is what is set here without the walks. Anything else is DCP's."""
        self._flat = False
        if self.flatten_state_dict and all(type(key) is str and type(value) in _FLAT_VALUES
                                           for key, value in state_dict.items()):
            self.mappings = {key: (key,) for key in state_dict}
            self.state_dict, self.is_coordinator, self._flat = state_dict, is_coordinator, True
            return
        super().set_up_planner(state_dict, storage_meta, is_coordinator)

    def create_local_plan(self) -> Any:
        """[Note: a layout instead of a local plan] With plans cached ([Note: cached save plans]), DCP still
        builds this rank's local plan at every save (a write item with its chunk and tensor properties per
        tensor, about 5 us each) only to compare it with the cached one and send nothing when they are equal.
        For a flat dict, what the plan is made of (each key with its chunk's offset and size, its tensor's
        dtype, layout, shape, requires_grad, contiguity and pinning: every field of a write item) is compared
        with what it was when the cached plan was made, and where nothing changed the cached plan stands, as
        DCP's comparison would have decided."""
        key = getattr(self, "_cached_plans_key", None)
        if not (getattr(self, "_enable_plan_caching", False) and self._flat and key is not None):
            return super().create_local_plan()
        layout = _plan_layout(self.state_dict)
        cached = SavePlanner._cached_save_plan.get(key)
        known = _PLAN_LAYOUTS.get(key)
        if cached is not None and known is not None and known[1] is cached and known[0] == layout:
            self.plan = cached
            return SavePlan([], usable=False)
        plan = super().create_local_plan()
        # The plan DCP keeps for this key once the save succeeds: the new one, or the cached one it equals.
        _PLAN_LAYOUTS[key] = (layout, getattr(self, "_pending_local_plan", cached))
        return plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, FlatChunk):
            if tuple(index.offset) != (obj.offset,):
                raise ValueError(f"{index.fqn!r}: this rank holds the chunk at {obj.offset}, not {index.offset}")
            return obj.local
        return super().lookup_object(index)

    def create_global_plan(self, all_plans: list[Any]) -> Any:
        with gc_paused(self.pause_gc):  # [Note: no collections while planning]
            return super().create_global_plan(all_plans)

    def _dedup_save_plans(self, all_plans: list[Any]) -> list[Any]:
        if not self.spread_replicas:
            return super()._dedup_save_plans(all_plans)
        return spread_dedup(all_plans, {key for key, value in self.state_dict.items() if isinstance(value, FlatChunk)})

    def finish_plan(self, new_plan: Any) -> Any:
        plan = super().finish_plan(new_plan)  # with a cache hit, the cached plan: new_plan is empty
        self.bytes_planned = sum(chunk_bytes(item) for item in plan.items)
        return plan


_PLAN_LAYOUTS: dict[str, tuple[list[Any], Any]] = {}
"""Per plan-cache key: the layout a cached local plan was made from, and that plan ([Note: a layout instead of a
local plan]); dropped with DCP's caches (:func:`forget_plans`)."""


def _plan_layout(state_dict: dict[str, Any]) -> list[Any]:
    rows = []
    for key, value in state_dict.items():
        chunk = value if type(value) is FlatChunk else None
        tensor = value.local if chunk is not None else value
        rows.append((key, None if chunk is None else (chunk.numel, chunk.offset), tensor.shape, tensor.dtype,
                     tensor.layout, tensor.requires_grad, tensor.is_contiguous(), tensor.is_pinned()))
    return rows


def tree_signature(tensors: dict[str, Any]) -> int:
    """CRC32 of the names and dtypes of what one rank hands DCP (FlatChunks, flat shards, tensors)."""
    return zlib.crc32(repr(sorted((key, str(_dtype(value))) for key, value in tensors.items())).encode())


def _dtype(value: Any) -> Any:
    if isinstance(value, (FlatChunk, FlatShard)):
        return value.local.dtype
    return getattr(value, "dtype", type(value).__name__)


def plan_cache_key(team: tuple[int, ...], spread_replicas: bool, signatures: Sequence[int]) -> str:
    """[Note: cached save plans] DCP's global save plan is the coordinator's work over every rank's
    local plan: deduplication, validation and ``.metadata``, about 20 us per item of every rank
    (``bench/scale.py``: seconds at hundreds of ranks, for every save), and each rank sends its plan
    to the coordinator and gets its final plan back. Every save of one training run plans the same
    tree, so DCP's ``enable_plan_caching`` applies: a rank whose local plan equals its previous one
    sends an empty plan, and when no rank's changed the coordinator reuses its global plan and
    ``.metadata`` and every rank its final plan.

    DCP keeps these caches in class attributes under ``_cached_plans_key``, merges new plans into
    the cached ones position by position, and assumes every rank's caches change together: a key
    that changed on one rank only fails that save and every later one (a rank asked to reuse a plan
    it never cached, a coordinator given empty plans it has no copy of). So the key is the same on
    every rank by construction. It names the team's ranks (a save over another group or world size
    never meets this one's plans), the dedup rule (which decides who writes a replicated chunk) and
    ``signatures``, every rank's :func:`tree_signature` as exchanged before the save: DCP's plan
    comparison looks at names, offsets and sizes only, and a cached ``.metadata`` would keep an old
    dtype. A save that fails drops its plans on every rank (:func:`forget_plans`), so the next one
    plans afresh. The cost: between saves the coordinator keeps what DCP caches, every rank's last
    local plan, the global plan and ``.metadata``, once per team (:func:`forget_other_plans` drops
    the team's plans of other trees): about 1.2M plan items at 1024 ranks of a 291-tensor model."""
    rule = "spread" if spread_replicas else "lowest"
    team_part = f"{FlatChunkSavePlanner.__name__}:{','.join(map(str, team))}:{rule}"  # forget_other_plans splits here
    return f"{team_part}:{zlib.crc32(repr(list(signatures)).encode()):08x}"


def _dcp_plan_caches() -> tuple[dict[str, Any], ...]:
    """DCP's class-level save-plan caches (local, all local, global and final plans, metadata), and the layouts
    of the local plans."""
    return (*_compat.save_planner_caches(), _PLAN_LAYOUTS)


def forget_plans(key: str) -> None:
    """Drop what DCP cached under ``key`` on this rank."""
    for cache in _dcp_plan_caches():
        cache.pop(key, None)


def forget_other_plans(key: str) -> None:
    """Drop what DCP cached on this rank for ``key``'s team and dedup rule under any other key (plans
    of a tree this team no longer saves)."""
    team_part = key.rsplit(":", 1)[0]
    for cache in _dcp_plan_caches():
        for stale in [k for k in cache if k != key and k.rsplit(":", 1)[0] == team_part]:
            del cache[stale]


class FlatChunkLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, for state dicts that hold :class:`FlatChunk` targets."""

    def __init__(self, pause_gc: bool = True) -> None:
        super().__init__()
        self.pause_gc = pause_gc

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        chunks = {key: value for key, value in state_dict.items() if isinstance(value, FlatChunk)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        # DCP's meta-tensor initialisation rewrites, in place, every value it does not know as None.
        state_dict.update(chunks)
        self.state_dict.update(chunks)

    def create_local_plan(self) -> Any:
        with gc_paused(self.pause_gc):  # [Note: no collections while planning]
            return super().create_local_plan()

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, FlatChunk):
            return obj.local  # ReadItem.dest_offsets are relative to this rank's chunk
        return super().lookup_tensor(index)


def chunk_bytes(item: Any) -> int:
    """Bytes of the chunk a write item writes. (``WriteItem.tensor_storage_size`` counts the whole
    tensor's size, not the chunk's, so DCP's own balancing weighs every shard of a tensor alike.)"""
    if item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * _compat.element_size(item.tensor_data.properties.dtype)


def spread_dedup(all_plans: list[Any], spread_fqns: set[str]) -> list[Any]:
    """One holder per write item.

    [Note: spread replicated writes] DCP keeps one copy of every chunk several ranks hold. Its
    ``dedup_save_to_lowest_rank`` gives every copy of a hybrid shard to shard group 0, which would
    then write the whole state while the other groups write nothing. Here a plain tensor (buffers,
    parameters no optimizer holds) still goes to the lowest rank, so a checkpoint holds rank 0's
    buffers, the ones DDP keeps; a chunk replicated across shard groups goes to
    whichever of its holders has the fewest bytes planned so far, largest chunks first
    (longest-processing-time first), so the writes spread over the replica groups, each chunk is
    written once and the total is one copy of the state."""
    holders: dict[Any, list[int]] = collections.defaultdict(list)
    items: dict[Any, Any] = {}
    for plan_index, plan in enumerate(all_plans):
        for item in plan.items:
            holders[item.index].append(plan_index)
            items[item.index] = item
    planned = [0] * len(all_plans)
    keep: dict[Any, int] = {}
    spread = []
    for index, ranks in holders.items():
        if len(ranks) == 1 or index.fqn not in spread_fqns:
            keep[index] = min(ranks)
            planned[keep[index]] += chunk_bytes(items[index])
        else:
            spread.append(index)
    spread.sort(key=lambda index: -chunk_bytes(items[index]))
    for index in spread:
        keep[index] = min(holders[index], key=lambda r: (planned[r], r))
        planned[keep[index]] += chunk_bytes(items[index])
    return [dataclasses.replace(plan, items=[item for item in plan.items if keep[item.index] == plan_index])
            for plan_index, plan in enumerate(all_plans)]


def split_reads(items: list[Any], storage_data: dict[Any, Any], parts: int) -> list[list[Any]]:
    """``items`` (DCP read items) cut into at most ``parts`` runs of about equal bytes, in file and
    offset order, for that many reader threads ([Note: parallel reads]). Each run reads its own
    byte ranges; a file may be split between two runs."""
    ordered = sorted(items, key=lambda item: (storage_data[item.storage_index].relative_path,
                                              storage_data[item.storage_index].offset))
    total = sum(storage_data[item.storage_index].length for item in ordered)
    runs: list[list[Any]] = [[]]
    done = 0
    for item in ordered:
        if runs[-1] and done >= total * len(runs) / parts:
            runs.append([])
        runs[-1].append(item)
        done += storage_data[item.storage_index].length
    return runs


def parallel_reads(base: type, threads: int) -> type:
    """A subclass of DCP reader class ``base`` whose ``read_data`` runs on ``threads`` threads.

    [Note: parallel reads] DCP's file readers read a plan's items one after the other on the
    calling thread: a read, a ``torch.load`` of the item's bytes, a copy into the target. One
    process loading a checkpoint that several wrote (a reshard to fewer ranks, a conversion) then
    reads at one thread's rate. File reads, checksums, deserialisation of the storage bytes and
    the copies release the GIL, so a few threads over disjoint byte ranges read in parallel;
    every run of items opens its own streams and writes disjoint targets."""

    class ParallelReader(base):  # type: ignore[misc, valid-type]
        def read_data(self, plan: Any, planner: Any) -> Any:
            runs = split_reads(plan.items, self.storage_data, threads) if threads > 1 else []
            if len(runs) < 2:
                return super().read_data(plan, planner)
            read = super().read_data
            with ThreadPoolExecutor(len(runs), thread_name_prefix="lightning_zero_read") as pool:
                futures = [pool.submit(read, dataclasses.replace(plan, items=run), planner) for run in runs]
                errors = [future.exception() for future in futures]
            first = next((error for error in errors if error is not None), None)
            if first is not None:
                raise first
            done: torch.futures.Future[None] = torch.futures.Future()
            done.set_result(None)
            return done

    ParallelReader.__name__ = ParallelReader.__qualname__ = f"Parallel{base.__name__}"
    return ParallelReader


def read_threads(local_ranks: int, most: int) -> int:
    """Reader threads per rank: the CPUs this process may use, shared by the ranks of its node,
    at most ``most`` (``CheckpointTuning.max_read_threads``)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(most, cpus // max(1, local_ranks)))


# [Note: parallel writes] ``CheckpointTuning.write_threads`` writer threads, each with its own file, per
# rank of a ``sharded`` save. DCP's file writer serializes an item (the zip records and their CRC32) and
# then writes it, one item after the other on one thread: the disk idles while the CPU serializes,
# and the CPU idles while the stream waits for the disk ([Note: drop behind] in writeback.py). Two
# threads over disjoint items overlap the two. That is overlap, not CPU parallelism, so unlike the
# reader threads the count does not shrink with the CPUs per rank (``bench/write_loop.py``'s
# ``sharded_one_thread`` row measures one thread against two; BENCHMARKS.md has the figures).
# Megatron-core's ``torch_dist`` save strategy also writes with two threads per rank by default.
#
# DCP's threads handle failures badly: an extra thread that raises just ends (its files' results are
# missing from what ``write_data`` returns), and when the calling thread's own part raises it stops
# without joining the others, which go on writing into a version the failed save then deletes. So
# the checksumming file system (``dcp_integrity.checksumming_writer``) records a data file's failure
# (creating it, writing it, its fsync or close) instead of raising it, every thread runs to its end,
# and ``write_data`` then raises the first one; a planned item without a result fails the save too.
# Once one file has failed, the other threads' next writes fail too (``dcp_integrity.SaveAbandoned``), so
# they end within one write instead of writing the rest of a save that is lost; on S3 the failed
# file and the stopped ones abort their multipart uploads (``Store.abort``) rather than
# complete them at close. This holds with checksums off too (``checksums_disabled``).
# ``.metadata``, written after, fails as it comes. A KeyboardInterrupt or SystemExit in a data
# file is not kept but goes on up; it still stops the other files at their next write.
