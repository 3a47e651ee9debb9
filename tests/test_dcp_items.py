"""The chunks ``sharded`` mode hands DCP ([Note: flat chunks for DCP]) are the ones a DTensor of
the same placement would give it, and the files they make are ordinary DCP checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from lightning_zero.checkpoint import load, save
from lightning_zero.checkpoint.dcp_items import FlatChunk
from lightning_zero.checkpoint.tree import FlatShard
from lightning_zero.sharding import EvenShard


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("numel", [0, 1, 2, 5, 10, 17, 64])
def test_chunk_offsets_and_sizes_are_those_dtensor_gives_dcp(numel: int, world_size: int) -> None:
    layout = EvenShard(numel, world_size)
    for rank in range(world_size):
        shard = FlatShard(torch.empty(layout.shard_numel(rank)), (numel,), rank, world_size)
        (chunk,) = FlatChunk.of(shard).__create_chunk_list__()
        size, offset = _compute_local_shape_and_global_offset((numel,), (world_size,), [rank], [Shard(0)])
        assert (tuple(chunk.sizes), tuple(chunk.offsets)) == (tuple(size), tuple(offset)), rank
        # Hybrid: the replica coordinate changes nothing.
        hybrid = _compute_local_shape_and_global_offset((numel,), (2, world_size), [1, rank], [Replicate(), Shard(0)])
        assert (tuple(chunk.sizes), tuple(chunk.offsets)) == tuple(map(tuple, hybrid))
        (item,) = FlatChunk.of(shard).__create_write_items__("t", None)
        assert item.index.offset == chunk.offsets and item.tensor_data.size == torch.Size([numel])


def test_a_sharded_checkpoint_reads_back_with_plain_dcp_into_full_tensors(single_rank_group: None,
                                                                          tmp_path: Path) -> None:
    weight = torch.arange(12, dtype=torch.float32)
    state = {"w": FlatShard(weight.clone(), (3, 4), 0, 1), "b": torch.full((2,), 7.0)}
    path = str(tmp_path / "c.ckpt")
    save(state, path, mode="sharded")
    # torch's own reader, no lightning_zero planner: the version directory is an ordinary DCP checkpoint.
    (metadata,) = tmp_path.rglob(".metadata")
    version_dir = metadata.parent
    full = {"w": torch.zeros(12), "b": torch.zeros(2)}
    dcp.load(full, checkpoint_id=str(version_dir), no_dist=True)
    assert torch.equal(full["w"], weight) and torch.equal(full["b"], state["b"])
    # And through lightning_zero into a flat shard.
    target = {"w": FlatShard(torch.zeros(12), (3, 4), 0, 1), "b": torch.zeros(2)}
    load(target, path)
    assert torch.equal(target["w"].local, weight) and torch.equal(target["b"], state["b"])


def test_reads_split_into_runs_of_about_equal_bytes_covering_every_item_once() -> None:
    from types import SimpleNamespace

    from lightning_zero.checkpoint.dcp_items import split_reads

    lengths = {("f1", 0): 100, ("f1", 100): 100, ("f0", 0): 50, ("f0", 50): 250, ("f1", 200): 10}
    storage = {key: SimpleNamespace(relative_path=key[0], offset=key[1], length=n) for key, n in lengths.items()}
    items = [SimpleNamespace(storage_index=key) for key in lengths]
    for parts in (1, 2, 3, 8):
        runs = split_reads(items, storage, parts)
        flat = [item.storage_index for run in runs for item in run]
        assert flat == sorted(lengths), parts  # every item once, in file and offset order
        assert 1 <= len(runs) <= min(parts, len(items)) and all(runs)
    two = split_reads(items, storage, 2)
    sizes = [sum(lengths[item.storage_index] for item in run) for run in two]
    assert sizes == [300, 210]  # the cut after the first run reaches half of 510 bytes
