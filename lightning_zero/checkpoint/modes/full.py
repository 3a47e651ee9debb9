"""``full`` mode: every shard gathered to rank 0 (in buckets, on the coordination group or the training
group), which writes one Lightning-format file, written to a temporary name and renamed locally. The
file loads anywhere, also without this package.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.checkpoint.formats import integrity
from lightning_zero.checkpoint.formats.tree import FlatShard, map_leaves, map_with_path, walk
from lightning_zero.checkpoint.modes.base import (
    CheckpointMode,
    OpenedCheckpoint,
    SaveTarget,
    check_into,
    copy_into,
    tensor_bytes,
)
from lightning_zero.checkpoint.runtime.team import Team, peer_lost
from lightning_zero.checkpoint.store import cleanup, file_io
from lightning_zero.checkpoint.store.storage import Location
from lightning_zero.checkpoint.store.tuning import DEFAULT_TUNING, CheckpointTuning
from lightning_zero.engine.collectives import group_device


def write_full(state: Any, loc: Location, rank: int, group: Any, save_id: str,
               tuning: CheckpointTuning = DEFAULT_TUNING, header: bool = True) -> None:
    """(every rank) ``state`` gathered to rank 0, which writes it as one file; ``header=False``: the file is the
    state exactly, without the integrity header (a plain file: [Note: model-only saves])."""
    full = gather_tree_to_rank0(state, group)
    if rank != 0:
        return
    if header:
        full[integrity.HEADER_KEY] = integrity.header(full, save_id)
    file_io.torch_save_to(loc, loc.path, full, tuning, whole=True)
    # Temporary files of saves of this name that died (SIGKILL) before their rename: one worker
    # writes a name at a time, so none of them is in progress.
    cleanup.remove_leftover_temporaries(loc)


GATHER_BUCKET_BYTES = 64 * 2**20
"""Shards gathered to rank 0 together (``full`` mode, plain CheckpointIO plugins): two collectives a
bucket instead of two a tensor, and never more than one bucket's gather buffers beyond the result."""


def gather_tree_to_rank0(tree: Any, group: Any) -> Any:
    """(collective, every rank) Every FlatShard of ``tree`` as a whole tensor on rank 0 (None elsewhere).

    Shards go in buckets of up to :data:`GATHER_BUCKET_BYTES` (consecutive, one dtype). Before each
    bucket's gather every rank says whether it could prepare its buffers (one tiny all-reduce), so a
    rank that runs out of memory half-way makes all of them stop at the same bucket and raise,
    instead of leaving the others in a gather it never joins (see [Note: same collectives on every rank]).
    """
    shards = [("/".join(path), leaf) for path, leaf in walk(tree) if isinstance(leaf, FlatShard)]
    failure: list[BaseException] = []
    whole: dict[str, Tensor | None] = {}
    for bucket in _gather_buckets(shards):
        whole.update(_gather_bucket_to_rank0(bucket, group, failure))
        if failure:
            raise failure[0]
    return map_with_path(tree, lambda path, leaf: whole[path] if isinstance(leaf, FlatShard) else leaf)


def _gather_buckets(shards: list[tuple[str, FlatShard]]) -> Iterator[list[tuple[str, FlatShard]]]:
    bucket: list[tuple[str, FlatShard]] = []
    filled = 0
    for key, shard in shards:
        size = shard.layout.padded_numel * shard.local.element_size()
        if bucket and (filled + size > GATHER_BUCKET_BYTES or shard.local.dtype != bucket[0][1].local.dtype):
            yield bucket
            bucket, filled = [], 0
        bucket.append((key, shard))
        filled += size
    if bucket:
        yield bucket


def _gather_bucket_to_rank0(bucket: list[tuple[str, FlatShard]], group: Any,
                            failure: list[BaseException]) -> dict[str, Tensor | None]:
    world_size = bucket[0][1].world_size  # the shard group's
    if world_size == 1:
        return {key: shard.local.reshape(shard.shape).clone() for key, shard in bucket}
    # Hybrid: every rank of the group takes part; rank 0 keeps the rows of its own shard group, the
    # first ``world_size`` ranks ([Note: hybrid layout]). (R copies travel to rank 0; ``full`` is for export.)
    group_size = dist.get_world_size(group)
    rank = dist.get_rank()
    # The group's own device: the strategy gathers a plain CheckpointIO's file on the training group,
    # which on GPUs is NCCL and takes CUDA tensors only; the coordination group is gloo (CPU).
    device = group_device(group)
    chunks = [shard.layout.chunk for _, shard in bucket]
    padded = gather_list = None
    try:
        padded = torch.zeros(sum(chunks), dtype=bucket[0][1].local.dtype, device=device)
        offset = 0
        for (_, shard), chunk in zip(bucket, chunks):
            padded[offset: offset + shard.local.numel()] = shard.local
            offset += chunk
        gather_list = [torch.empty_like(padded) for _ in range(group_size)] if rank == 0 else None
    except Exception as exc:
        padded = gather_list = None
        largest = max((shard for _, shard in bucket), key=lambda s: s.numel)
        failure.append(RuntimeError(f"rank {rank}: gathering a tensor of shape {largest.shape} to rank 0 failed"
                                    f" ({type(exc).__name__}: {exc})"))
    ready = torch.tensor([0 if failure else 1], dtype=torch.int32, device=device)
    try:
        dist.all_reduce(ready, op=dist.ReduceOp.MIN, group=group)
        if not ready.item():
            if not failure:
                failure.append(RuntimeError(f"rank {rank}: stopped the gather to rank 0 because another rank failed"
                                            " (its error names it)"))
            return {}
        dist.gather(padded, gather_list, dst=0, group=group)
    except Exception as exc:
        raise peer_lost(exc) from exc
    if rank != 0:
        return {key: None for key, _ in bucket}
    assert gather_list is not None
    rows = torch.stack(gather_list[:world_size]).cpu()  # [world_size, sum(chunks)]
    out: dict[str, Tensor | None] = {}
    offset = 0
    for (key, shard), chunk in zip(bucket, chunks):
        # Contiguous strides: a one-element tensor cut from a column keeps the row stride otherwise,
        # which ``view(torch.uint8)`` (the checksum) refuses.
        out[key] = rows[:, offset: offset + chunk].reshape(-1)[: shard.numel].reshape(shard.shape).clone(
            memory_format=torch.contiguous_format)
        offset += chunk
    return out


def read_full_checked(loc: Location, weights_only: bool = True) -> Any:
    content, found = integrity.split(file_io.torch_load(loc, loc.path, weights_only), loc.path, loc.url,
                                     required=False)
    if found is not None:  # files written by other tools (plain Lightning, convert) carry no header
        integrity.verify(content, found, loc.path, loc.url)
    return content


class FullMode(CheckpointMode):
    """``full``: rank 0 writes one file of whole tensors in Lightning's format after gathering every rank's shards."""

    name = "full"
    commits_with_marker = False
    gathers_to_rank0 = True
    lightning_format = True

    def check_save(self, team: Team, plain: bool) -> None:
        if not team.default:
            raise ValueError("mode='full' saves over every rank to rank 0: call it without process_group/coordinator_rank,"
                             " or use mode='sharded' for a group of ranks.")

    def to_stage(self, state: Any, rank: int) -> Any:
        if rank != 0:
            # Only rank 0 writes a full file: the others stage their shards (for the gathers) only.
            return map_leaves(state, lambda leaf: None if isinstance(leaf, Tensor) else leaf)
        return state

    def write_directory(self, loc: Location, rank: int) -> str | None:
        return (loc.parent or ".") if rank == 0 else None

    def write(self, state: Any, target: SaveTarget) -> int | None:
        write_full(state, target.loc, target.team.rank, target.team.group, target.save_id, target.tuning,
                   header=target.header)
        return None

    def bytes_written(self, state: Any, rank: int) -> int:
        # Rank 0 writes the whole tensors and its replicated ones; the others write nothing.
        return tensor_bytes(state, whole_shards=True, replicated=True) if rank == 0 else 0

    def saved_tensor_keys(self, opened: OpenedCheckpoint) -> set[str]:
        raise ValueError(f"{opened.url!r} is a 'full' checkpoint; read it with load().")

    def saved_objects(self, opened: OpenedCheckpoint) -> dict[str, Any]:
        raise ValueError(f"{opened.url!r} is a 'full' checkpoint; read it with load().")

    def prepare_load(self, state_dict: dict[str, Any], opened: OpenedCheckpoint, team: Team,
                     strict: bool = True) -> Callable[[], dict[str, Any]]:
        loc = opened.loc
        content = read_full_checked(loc)
        check_into(state_dict, content, loc.url, loc.path, strict)
        return lambda: copy_into(state_dict, content, loc.url)

    def read_whole(self, opened: OpenedCheckpoint, optimizer: bool) -> dict[str, Any]:
        raise ValueError(f"{opened.url!r} is a 'full' checkpoint file; read it with torch.load.")
