"""Property tests of the even-split arithmetic and the row copies (no process group needed)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_zero.engine.collectives import copy_flat_to_rows, copy_rows_to_flat
from lightning_zero.engine.sharding import EvenShard, assign_buckets

numels = st.integers(min_value=0, max_value=5000)
world_sizes = st.integers(min_value=1, max_value=64)


def shard_sizes(layout: EvenShard) -> list[int]:
    return [layout.shard_numel(r) for r in range(layout.world_size)]


@given(numels, world_sizes)
def test_shards_tile_the_parameter_in_rank_order(numel: int, world_size: int) -> None:
    layout = EvenShard(numel, world_size)
    assert layout.start(0) == 0
    for rank in range(world_size - 1):
        assert layout.end(rank) == layout.start(rank + 1)
    assert layout.end(world_size - 1) == numel
    assert sum(shard_sizes(layout)) == numel


@given(numels, world_sizes)
def test_padding_is_the_smallest_multiple_of_world_size(numel: int, world_size: int) -> None:
    layout = EvenShard(numel, world_size)
    assert layout.padded_numel == layout.chunk * world_size
    assert numel <= layout.padded_numel < numel + world_size
    assert all(0 <= size <= layout.chunk for size in shard_sizes(layout))


@given(numels, world_sizes)
def test_rows_are_full_then_one_partial_then_empty(numel: int, world_size: int) -> None:
    layout = EvenShard(numel, world_size)
    sizes = shard_sizes(layout)
    assert sizes == sorted(sizes, reverse=True)
    assert sum(0 < size < layout.chunk for size in sizes) <= 1
    assert sizes.count(layout.chunk) == layout.full_rows if layout.chunk else True
    assert layout.full_rows * layout.chunk + layout.tail == numel
    assert 0 <= layout.tail < max(layout.chunk, 1)


@given(st.integers(min_value=1, max_value=5000), world_sizes)
def test_split_is_torch_chunk_which_dtensor_shard0_uses(numel: int, world_size: int) -> None:
    layout = EvenShard(numel, world_size)
    pieces = torch.arange(numel).chunk(world_size)
    expected = [len(p) for p in pieces] + [0] * (world_size - len(pieces))
    assert shard_sizes(layout) == expected
    for rank, piece in enumerate(pieces):
        assert piece[0].item() == layout.start(rank)


@given(numels, world_sizes)
def test_no_rank_holds_a_whole_element_more_than_its_share(numel: int, world_size: int) -> None:
    layout = EvenShard(numel, world_size)
    assert all(size < numel / world_size + 1 for size in shard_sizes(layout))


@given(st.integers(min_value=1, max_value=64), st.data())
def test_no_rank_is_empty_for_parameters_of_at_least_ws_times_ws_minus_one(world_size: int,
                                                                          data: st.DataObject) -> None:
    # With torch.chunk's split only the *last* rank can come up short; from ws*(ws-1)
    # elements on (or for exact multiples of ws) every rank holds something.
    numel = data.draw(st.one_of(
        st.integers(min_value=max(1, world_size * (world_size - 1)), max_value=world_size * world_size + 5000),
        st.integers(min_value=1, max_value=200).map(lambda k: k * world_size),
    ))
    assert min(shard_sizes(EvenShard(numel, world_size))) > 0


def test_small_parameter_leaves_trailing_ranks_empty() -> None:
    # The torch.chunk split: 9 elements on 8 ranks are 4 rows of 2 and one of 1. Pinned so a
    # change of layout (which the checkpoint format depends on) is a deliberate one.
    assert shard_sizes(EvenShard(9, 8)) == [2, 2, 2, 2, 1, 0, 0, 0]
    assert shard_sizes(EvenShard(1, 3)) == [1, 0, 0]
    assert shard_sizes(EvenShard(0, 2)) == [0, 0]


@pytest.mark.parametrize(("numel", "world_size", "rank"), [(-1, 2, 0), (4, 0, 0), (4, 2, 2), (4, 2, -1)])
def test_invalid_layout_arguments_raise(numel: int, world_size: int, rank: int) -> None:
    with pytest.raises(ValueError, match=r"numel|world_size|outside world size"):
        EvenShard(numel, world_size).shard_numel(rank)


@given(st.lists(st.integers(min_value=0, max_value=3000), max_size=40), world_sizes,
       st.integers(min_value=1, max_value=6000))
def test_buckets_hold_every_parameter_once_in_order(numels_: list[int], world_size: int, capacity: int) -> None:
    buckets = assign_buckets(numels_, world_size, capacity)
    assert [i for bucket in buckets for i in bucket] == list(range(len(numels_)))
    assert all(buckets)


@given(st.lists(st.integers(min_value=0, max_value=3000), max_size=40), world_sizes,
       st.integers(min_value=1, max_value=6000))
def test_every_bucket_but_the_last_reaches_capacity_and_closes_then(numels_: list[int], world_size: int,
                                                                   capacity: int) -> None:
    def padded(i: int) -> int:
        return EvenShard(numels_[i], world_size).padded_numel

    buckets = assign_buckets(numels_, world_size, capacity)
    for bucket in buckets[:-1]:
        assert sum(padded(i) for i in bucket) >= capacity
    for bucket in buckets:  # closed as soon as it was full: without its last member it was not
        assert sum(padded(i) for i in bucket[:-1]) < capacity


def test_parameter_larger_than_capacity_gets_its_own_bucket() -> None:
    assert assign_buckets([3, 100, 3, 3], world_size=1, capacity_numel=10) == [[0, 1], [2, 3]]
    assert assign_buckets([100, 3], world_size=1, capacity_numel=10) == [[0], [1]]
    assert assign_buckets([], world_size=4, capacity_numel=10) == []


def test_bucket_capacity_below_one_element_raises() -> None:
    with pytest.raises(ValueError, match="bucket capacity must be >= 1"):
        assign_buckets([1, 2], world_size=2, capacity_numel=0)


@given(numels.filter(lambda n: n <= 400), st.integers(min_value=1, max_value=9),
       st.integers(min_value=0, max_value=5), st.integers(min_value=0, max_value=5))
def test_rows_round_trip_inside_a_strided_bucket_buffer(numel: int, world_size: int, before: int,
                                                        after: int) -> None:
    layout = EvenShard(numel, world_size)
    flat = torch.arange(1, numel + 1, dtype=torch.float32)
    buffer = torch.full((world_size, before + layout.chunk + after), -7.0)
    rows = buffer[:, before : before + layout.chunk]  # a strided column block, as in a bucket

    copy_flat_to_rows(rows, flat, layout)

    for rank in range(world_size):
        start, end = layout.start(rank), layout.end(rank)
        assert torch.equal(rows[rank, : end - start], flat[start:end])
        assert (rows[rank, end - start :] == -7.0).all(), "padding must be left untouched"
    assert (buffer[:, :before] == -7.0).all() and (buffer[:, before + layout.chunk :] == -7.0).all()

    back = torch.zeros(numel)
    copy_rows_to_flat(back, rows, layout)
    assert torch.equal(back, flat)
