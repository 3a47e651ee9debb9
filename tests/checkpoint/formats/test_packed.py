"""formats/packed.py: a rank file's tensors as the few flat buffers the stager copied them into
([Note: packed rank files]), and the local mode that writes and reads them."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from torch import Tensor

from lightning_zero.checkpoint import CheckpointCorruptError, last_save_stats, load, save
from lightning_zero.checkpoint.formats import integrity, packed
from lightning_zero.checkpoint.formats.tree import FlatShard, StableDict, walk
from lightning_zero.checkpoint.runtime.staging import Stager
from lightning_zero.checkpoint.store import storage


def many_leaves() -> dict:
    torch.manual_seed(0)
    return {"model": {f"layer{i}.weight": FlatShard(torch.randn(64 * 64), (64, 64), 0, 1) for i in range(40)},
            "optimizer": [{"state": {f"layer{i}.weight": {"exp_avg": torch.randn(64 * 64), "step": torch.tensor(3.0)}
                                     for i in range(40)}, "param_groups": [{"lr": 0.1, "params": ["a", "b"]}]}],
            "half": torch.randn(5, 3).to(torch.bfloat16), "note": "kept", "empty": None}


def same(a: object, b: object) -> None:
    left, right = dict(walk(a)), dict(walk(b))
    assert left.keys() == right.keys()
    for path, value in left.items():
        other = right[path]
        if isinstance(value, FlatShard):
            assert isinstance(other, FlatShard) and (value.shape, value.rank, value.world_size) == \
                (other.shape, other.rank, other.world_size)
            value, other = value.local, other.local
        if isinstance(value, Tensor):
            assert value.dtype == other.dtype and torch.equal(value, other), path
        else:
            assert value == other, path


def test_a_staged_tree_packs_into_one_buffer_per_dtype_and_unpacks_to_the_same_leaves() -> None:
    tree = many_leaves()
    staged = Stager().stage(tree)
    written = packed.pack(staged)
    assert [b.dtype for b in written[packed.PACKED_KEY]["buffers"]] == [torch.float32, torch.bfloat16]
    assert not any(isinstance(leaf, (Tensor, FlatShard)) for path, leaf in walk(written)
                   if path[0] != packed.PACKED_KEY)  # the tensors live in the buffers only
    same(packed.unpack(written), tree)


def test_tensors_not_filling_their_storage_exactly_are_written_as_before() -> None:
    base = torch.arange(10.0)
    tree = {"a": base[:4], "b": base[4:8]}  # two views leaving base[8:] out
    assert packed.pack(tree) is tree
    assert packed.pack({"t": (torch.zeros(2),)}) is not None  # a tensor in a tuple: as before, no error
    assert packed.unpack({"plain": 1}) == {"plain": 1}  # a file of an earlier version


@pytest.mark.usefixtures("one_rank")
def test_a_local_checkpoint_round_trips_packed_and_a_damaged_byte_names_the_tensors_around_it(tmp_path: Path) -> None:
    tree = many_leaves()
    save(tree, str(tmp_path / "c.ckpt"), mode="local")
    into = {"model": {k: FlatShard(torch.zeros(64 * 64), (64, 64), 0, 1) for k in tree["model"]},
            "optimizer": [{"state": {k: {"exp_avg": torch.zeros(64 * 64), "step": torch.tensor(0.0)}
                                     for k in tree["model"]}, "param_groups": [{"lr": 0.0, "params": []}]}],
            "half": torch.zeros(5, 3, dtype=torch.bfloat16), "note": "", "empty": None}
    load(into, str(tmp_path / "c.ckpt"))
    for key, shard in tree["model"].items():
        assert torch.equal(into["model"][key].local, shard.local)
    assert torch.equal(into["optimizer"][0]["state"]["layer39.weight"]["exp_avg"],
                       tree["optimizer"][0]["state"]["layer39.weight"]["exp_avg"])
    # One byte of the last exp_avg flipped: the error names it among the tensors of its chunk (1 of at most 32).
    (rank_file,) = (tmp_path / "_zero_data" / "c.ckpt").glob("*/rank00000-of-00001.pt")
    data = bytearray(rank_file.read_bytes())
    needle = tree["optimizer"][0]["state"]["layer39.weight"]["exp_avg"][100:108].numpy().tobytes()
    at = bytes(data).index(needle)
    data[at] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"Checksum mismatch in tensors? .*optimizer/0/state/layer39"
                                                     r"\.weight/exp_avg") as error:
        load(into, str(tmp_path / "c.ckpt"))
    assert "layer0.weight" not in str(error.value)


def test_a_pack_plan_writes_the_file_a_staged_tree_packs_into_with_copies_of_the_live_tensors() -> None:
    tree = many_leaves()
    layout = Stager().plan(tree)
    assert layout is not None
    assert all(value is None for value in layout.skeleton["model"].values())  # tensors live in the buffers only
    filled = packed.fill(layout)
    staged = packed.pack(Stager().stage(tree))
    assert filled.content[packed.PACKED_KEY]["index"] == staged[packed.PACKED_KEY]["index"]
    for ours, theirs in zip(filled.content[packed.PACKED_KEY]["buffers"], staged[packed.PACKED_KEY]["buffers"]):
        assert torch.equal(ours, theirs)
    expected = dict(integrity._checked_leaves(staged))
    assert {key for key, _ in filled.checked} == expected.keys()  # the header checks what a walk would find
    copy = packed.unpack(dict(filled.content))
    tree["model"]["layer0.weight"].local.add_(1.0)  # the update after staging: the file keeps the staged values
    tree["half"].add_(1.0)  # the only bf16 tensor: a buffer of one tensor is a copy too, not a view of it
    same(copy, many_leaves())


def test_a_pack_plan_reuses_the_previous_index_until_the_layout_changes() -> None:
    stager, tree = Stager(), many_leaves()
    first = stager.plan(tree)
    second = stager.plan(many_leaves())
    assert first is not None and second is not None and second.index is first.index
    tree["optimizer"][0]["state"]["layer3.weight"]["exp_avg"] = torch.randn(64 * 63)
    third = stager.plan(tree)
    assert third is not None and third.index != first.index
    assert packed.unpack(dict(packed.fill(third).content))["optimizer"][0]["state"]["layer3.weight"]["exp_avg"] \
        .shape == (64 * 63,)


def test_trees_a_plan_does_not_take_are_staged_as_before() -> None:
    stager = Stager()
    assert stager.plan({"few": torch.zeros(3)}) is None  # a few tensors: cloned one by one
    assert stager.plan({"big": [torch.zeros(2**19) for _ in range(70)]}) is None  # large on average
    assert stager.plan({**many_leaves(), "held": (torch.zeros(2),)}) is None  # a tensor in a tuple
    assert stager.plan({**many_leaves(), 1.5: "a key JSON cannot name"}) is None


def test_a_pack_plan_knows_the_shard_group_size_and_the_bytes_it_writes() -> None:
    tree = {f"w{i}": FlatShard(torch.zeros(8), (32,), 1, 4, replicas=2, replica_rank=1) for i in range(70)}
    layout = Stager().plan(tree)
    assert layout is not None and layout.shard_group_size == 4 and layout.nbytes == 70 * 8 * 4
    plain = Stager().plan({f"t{i}": torch.zeros(8) for i in range(70)})
    assert plain is not None and plain.shard_group_size is None


@pytest.mark.usefixtures("one_rank")
def test_a_planned_save_marks_the_shard_group_size_and_counts_its_bytes(tmp_path: Path) -> None:
    # Shards of a group of 2 saved by a world of 1: the marker must say so (a local load checks it).
    tree = {f"w{i}": FlatShard(torch.full((8,), float(i)), (16,), 0, 2) for i in range(70)}
    save(tree, str(tmp_path / "c.ckpt"), mode="local")
    assert storage.read_marker(storage.resolve(str(tmp_path / "c.ckpt")))["shard_group_size"] == 2
    stats = last_save_stats()
    assert stats is not None and stats.bytes_written == 70 * 8 * 4


def test_a_save_leaves_no_cyclic_garbage_behind(tmp_path: Path) -> None:
    """[Note: no closure cycles on a save's path]: what a local save of many small tensors made (its plan, its index
    rows) is freed when the save ends, not left to the cyclic collector, whose full collections of the process's heap
    it would set off every few saves. (The walk of the tree nested a recursive function: about three lists a tensor
    waited for the collector.)"""
    tree = {f"w{i}": torch.full((4,), float(i)) for i in range(1000)}
    save(tree, str(tmp_path / "warm.ckpt"), mode="local")  # what a first save caches
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        save(tree, str(tmp_path / "c.ckpt"), mode="local")
        assert last_save_stats() is not None
        unreachable = gc.collect()
    finally:
        if was_enabled:
            gc.enable()
    assert unreachable < 200, f"{unreachable} objects of one save were left to the cyclic collector"


def stable_tree(state: StableDict) -> dict:
    """A tree as the strategy builds it at each save: new containers around the optimizer state it keeps."""
    tree = many_leaves()
    tree["optimizer"][0]["state"] = state
    return tree


def plan_of(layout: packed.PackPlan) -> tuple:
    """Everything a plan hands the writer, tensors by identity."""
    return (layout.skeleton, [[id(t) for t in group] for group in layout.sources], layout.index, layout.checked,
            layout.shard_group_size, layout.nbytes)


def test_a_stable_subtree_met_again_is_not_walked_and_the_plan_is_the_one_a_fresh_walk_makes() -> None:
    """[Note: stable subtrees]: the optimizer's state, the same object from save to save, is replayed from the
    previous plan; everything around it (new tensors in the model part, new containers) is walked. The plan
    is exactly what a stager that never saw the tree plans."""
    state = StableDict({f"layer{i}.weight": {"exp_avg": FlatShard(torch.randn(64 * 64), (64, 64), 0, 2),
                                             "step": torch.tensor(3.0), "note": b"bytes checked"} for i in range(40)})
    stager = Stager()
    first = stager.plan(stable_tree(state))
    tree = stable_tree(state)
    second = stager.plan(tree)
    assert first is not None and second is not None
    assert second.skeleton["optimizer"][0]["state"] is first.skeleton["optimizer"][0]["state"]  # replayed
    fresh = Stager().plan(tree)
    assert fresh is not None and plan_of(second) == plan_of(fresh)
    assert second.shard_group_size == 1  # the model part's first shard comes first
    same(packed.unpack(dict(packed.fill(second).content)), packed.unpack(dict(packed.fill(fresh).content)))

    # What comes before it changed its place in the buffers: walked again, planned as a fresh walk plans.
    tree = stable_tree(state)
    tree["model"]["layer0.weight"] = FlatShard(torch.randn(64 * 65), (64, 65), 0, 1)
    third = stager.plan(tree)
    assert third is not None and third.skeleton["optimizer"][0]["state"] is not first.skeleton["optimizer"][0]["state"]
    assert plan_of(third) == plan_of(Stager().plan(tree))  # type: ignore[arg-type]

    # One of its tensors also placed before it (the same tensor twice): walked, and not kept for a replay.
    tree = stable_tree(state)
    tree["model"]["alias"] = state["layer1.weight"]["exp_avg"]
    for _ in range(2):
        kept = stager.plan(tree)
        assert kept is not None and plan_of(kept) == plan_of(Stager().plan(tree))  # type: ignore[arg-type]
    assert id(state) not in stager._memo.walked  # type: ignore[union-attr]
