"""The chunks ``sharded`` mode hands DCP ([Note: flat chunks for DCP]) are the ones a DTensor of
the same placement would give it, and the files they make are ordinary DCP checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from lightning_zero.checkpoint import load, save
from lightning_zero.checkpoint.dcp.adapter import FlatChunk
from lightning_zero.checkpoint.formats.tree import FlatShard
from lightning_zero.engine.sharding import EvenShard


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

    from lightning_zero.checkpoint.dcp.adapter import split_reads

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


def test_repeated_saves_of_one_tree_reuse_the_global_plan_and_a_changed_tree_replans(
        single_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_zero.checkpoint.dcp import adapter as dcp_adapter

    global_plans = []
    original = dcp_adapter.FlatChunkSavePlanner._create_global_plan

    def counted(self: dcp_adapter.FlatChunkSavePlanner, all_plans: list) -> object:
        global_plans.append(len(all_plans))
        return original(self, all_plans)

    monkeypatch.setattr(dcp_adapter.FlatChunkSavePlanner, "_create_global_plan", counted)

    def tree(value: float, extra: bool = False) -> dict:
        state = {"w": FlatShard(torch.full((12,), value), (3, 4), 0, 1), "b": torch.full((2,), value)}
        if extra:
            state["c"] = torch.full((3,), value)
        return state

    def round_trip(name: str, state: dict) -> dict:
        save(state, str(tmp_path / name), mode="sharded")
        target = {key: FlatShard(torch.zeros(12), (3, 4), 0, 1) if key == "w" else torch.zeros_like(leaf)
                  for key, leaf in state.items()}
        load(target, str(tmp_path / name))
        return target

    first = round_trip("a", tree(1.0))
    planned_once = len(global_plans)
    second = round_trip("b", tree(2.0))  # same structure: DCP's cached global plan and metadata
    assert len(global_plans) == planned_once
    assert torch.equal(second["w"].local, torch.full((12,), 2.0)) and torch.equal(second["b"], torch.full((2,), 2.0))
    assert torch.equal(first["w"].local, torch.full((12,), 1.0))
    third = round_trip("c", tree(3.0, extra=True))  # another tree: planned again, and complete
    assert len(global_plans) == planned_once + 1
    assert torch.equal(third["c"], torch.full((3,), 3.0)) and torch.equal(third["w"].local, torch.full((12,), 3.0))


def test_repeated_saves_of_one_layout_reuse_the_local_plan_and_a_resized_tensor_replans(
        single_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: a layout instead of a local plan]: the second save of one layout builds no local plan; a tensor of
    another size under the same name and dtype (the same plan-cache key: names and dtypes) is planned again, and its
    new size is what the checkpoint records and loads."""
    from torch.distributed.checkpoint import default_planner

    local_plans = []
    original = default_planner.create_default_local_save_plan

    def counted(state_dict: dict, is_coordinator: bool) -> object:
        local_plans.append(len(state_dict))
        return original(state_dict, is_coordinator)

    monkeypatch.setattr(default_planner, "create_default_local_save_plan", counted)

    def tree(value: float, b_size: int = 2) -> dict:
        return {"w": FlatShard(torch.full((12,), value), (3, 4), 0, 1), "b": torch.full((b_size,), value)}

    def round_trip(name: str, state: dict) -> dict:
        save(state, str(tmp_path / name), mode="sharded")
        target = {"w": FlatShard(torch.zeros(12), (3, 4), 0, 1), "b": torch.zeros_like(state["b"])}
        load(target, str(tmp_path / name))
        return target

    round_trip("a", tree(1.0))
    planned = len(local_plans)
    assert planned >= 1
    second = round_trip("b", tree(2.0))
    assert len(local_plans) == planned  # the same layout: the cached plan, no new one
    assert torch.equal(second["w"].local, torch.full((12,), 2.0)) and torch.equal(second["b"], torch.full((2,), 2.0))
    third = round_trip("c", tree(3.0, b_size=5))
    assert len(local_plans) == planned + 1  # resized: planned again
    assert torch.equal(third["b"], torch.full((5,), 3.0)) and torch.equal(third["w"].local, torch.full((12,), 3.0))
    fourth = round_trip("d", tree(4.0, b_size=5))
    assert len(local_plans) == planned + 1  # and the new layout's plan is the cached one from then on
    assert torch.equal(fourth["b"], torch.full((5,), 4.0))


def test_plan_cache_keys_differ_per_team_dedup_rule_and_any_rank_s_dtypes() -> None:
    from lightning_zero.checkpoint.dcp.adapter import plan_cache_key, tree_signature

    fp32 = tree_signature({"w": FlatChunk(torch.zeros(3), 6, 0), "b": torch.zeros(2)})
    bf16 = tree_signature({"w": FlatChunk(torch.zeros(3, dtype=torch.bfloat16), 6, 0), "b": torch.zeros(2)})
    assert fp32 == tree_signature({"w": FlatChunk(torch.ones(3), 6, 0), "b": torch.ones(2)})  # values do not count
    keys = {plan_cache_key((0, 1), False, [fp32, fp32]), plan_cache_key((0, 1), True, [fp32, fp32]),
            plan_cache_key((2, 3), False, [fp32, fp32]), plan_cache_key((0, 1), False, [fp32, bf16])}
    assert len(keys) == 4


def test_a_new_key_drops_the_team_s_previous_plans() -> None:
    from torch.distributed.checkpoint.planner import SavePlanner

    from lightning_zero.checkpoint.dcp.adapter import forget_other_plans, plan_cache_key

    old = plan_cache_key((5, 6), False, [1, 1])
    SavePlanner._cached_metadata[old] = "cached"
    forget_other_plans(plan_cache_key((5, 6), False, [1, 2]))  # one rank's tree changed
    assert old not in SavePlanner._cached_metadata


def test_a_save_in_another_dtype_records_its_own_dtype(single_rank_group: None, tmp_path: Path) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        path = tmp_path / str(dtype).split(".")[-1]
        save({"w": FlatShard(torch.ones(12, dtype=dtype), (3, 4), 0, 1), "b": torch.ones(2, dtype=dtype)}, str(path),
             mode="sharded")
        (metadata_file,) = path.parent.glob(f"_zero_data/{path.name}/*/.metadata")
        metadata = dcp.FileSystemReader(str(metadata_file.parent)).read_metadata()
        assert metadata.state_dict_metadata["w"].properties.dtype == dtype
        assert metadata.state_dict_metadata["b"].properties.dtype == dtype


def test_at_three_ranks_the_second_save_of_a_tree_skips_the_global_plan_and_both_load(tmp_path: Path) -> None:
    from _dist import run_distributed
    from checkpoint_cases import repeated_sharded_saves

    results = run_distributed(repeated_sharded_saves, 3, str(tmp_path), start_method="forkserver")
    assert [same for _, same in results] == [True, True, True]
    assert results[0][0] == 1  # the coordinator planned the first save only
    assert [planned for planned, _ in results[1:]] == [0, 0]


def test_a_tree_that_changed_on_one_rank_only_is_planned_afresh_by_every_rank(tmp_path: Path) -> None:
    # With a key computed per rank, rank 1 alone missed its cache and DCP failed this save and every later one.
    from _dist import run_distributed
    from checkpoint_cases import asymmetric_tree_saves

    results = run_distributed(asymmetric_tree_saves, 2, str(tmp_path), start_method="forkserver")
    assert results == [["torch.float32", "torch.bfloat16"]] * 2


def test_a_load_reads_and_unpickles_metadata_once(single_rank_group: None, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # The load checks .metadata (save id, keys) before DCP reads it again: one read serves both.
    from lightning_zero.checkpoint.dcp import integrity as dcp_integrity

    path = str(tmp_path / "c.ckpt")
    save({"w": FlatShard(torch.arange(12.0), (3, 4), 0, 1), "b": torch.full((2,), 7.0)}, path, mode="sharded")
    reads = []
    original = dcp_integrity._MetadataUnpickler.load
    monkeypatch.setattr(dcp_integrity._MetadataUnpickler, "load", lambda self: reads.append(1) or original(self))
    target = {"w": FlatShard(torch.zeros(12), (3, 4), 0, 1), "b": torch.zeros(2)}
    load(target, path)
    assert torch.equal(target["w"].local, torch.arange(12.0)) and torch.equal(target["b"], torch.full((2,), 7.0))
    assert len(reads) == 1


def test_a_sharded_save_writes_one_file_per_writer_thread_each_holding_part_of_the_items(
        single_rank_group: None, tmp_path: Path) -> None:
    # [Note: parallel writes]: the items are spread over CheckpointTuning.write_threads files, and all load back.
    from lightning_zero.checkpoint.store.tuning import DEFAULT_TUNING

    state = {f"w{i}": FlatShard(torch.full((1000 * (i + 1),), float(i)), (1000 * (i + 1),), 0, 1) for i in range(4)}
    path = str(tmp_path / "c.ckpt")
    save(state, path, mode="sharded")
    (metadata,) = tmp_path.rglob(".metadata")
    data_files = sorted(p.name for p in metadata.parent.glob("*.distcp"))
    assert DEFAULT_TUNING.write_threads == 2
    assert data_files == ["__0_0.distcp", "__0_1.distcp"]
    stored = dcp.FileSystemReader(str(metadata.parent)).read_metadata().storage_data
    assert {info.relative_path for info in stored.values()} == set(data_files)  # neither file is empty
    target = {name: FlatShard(torch.zeros(shard.local.numel()), shard.shape, 0, 1) for name, shard in state.items()}
    load(target, path)
    assert all(torch.equal(target[name].local, state[name].local) for name in state)


# ---- [Note: no collections while planning] -------------------------------------------------


def test_gc_paused_nests_across_threads_and_restores_what_it_found() -> None:
    import gc
    import threading

    from lightning_zero.checkpoint.runtime.process import gc_paused

    assert gc.isenabled()
    inner_entered, outer_left = threading.Event(), threading.Event()
    seen: list[bool] = []

    def other_thread() -> None:
        with gc_paused():
            inner_entered.set()
            outer_left.wait(10)
            seen.append(gc.isenabled())  # the first pause ended, this one has not

    thread = threading.Thread(target=other_thread)
    with gc_paused():
        assert not gc.isenabled()
        thread.start()
        inner_entered.wait(10)
    outer_left.set()
    thread.join(10)
    assert seen == [False]
    assert gc.isenabled()
    gc.disable()  # the user's own choice stays
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_planning_and_metadata_unpickling_run_with_the_collector_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc
    import pickle

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    from lightning_zero.checkpoint.dcp import integrity as dcp_integrity
    from lightning_zero.checkpoint.dcp.adapter import FlatChunkLoadPlanner, FlatChunkSavePlanner

    enabled: dict[str, bool] = {}
    monkeypatch.setattr(DefaultSavePlanner, "create_global_plan",
                        lambda self, plans: enabled.setdefault("global save plan", gc.isenabled()))
    monkeypatch.setattr(DefaultLoadPlanner, "create_local_plan",
                        lambda self: enabled.setdefault("load plan", gc.isenabled()))
    find_class = dcp_integrity._MetadataUnpickler.find_class

    def recording(self: Any, module: str, name: str) -> Any:
        enabled.setdefault("unpickling .metadata", gc.isenabled())
        return find_class(self, module, name)

    monkeypatch.setattr(dcp_integrity._MetadataUnpickler, "find_class", recording)
    FlatChunkSavePlanner().create_global_plan([])
    FlatChunkLoadPlanner().create_local_plan()
    from torch.distributed.checkpoint.metadata import Metadata

    dcp_integrity.unpickle_metadata(pickle.dumps(Metadata(state_dict_metadata={})), "ckpt")
    assert enabled == {"global save plan": False, "load plan": False, "unpickling .metadata": False}
    assert gc.isenabled()


@pytest.mark.parametrize("mode", ["sharded", "local"])
@pytest.mark.parametrize("pause_gc", [True, False])
def test_a_save_runs_with_the_collector_paused_until_its_staged_copy_is_gone(
        one_rank: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, pause_gc: bool) -> None:
    # [Note: the collector and a save's objects] in saver.py: what async_save builds on the caller's thread (a local
    # rank file's layout, a sharded save's containers), staging, the write and the commit all run paused; the
    # collector is on again once the job is over; CheckpointTuning(pause_gc=False) leaves it alone.
    import gc
    import weakref

    from lightning_zero.checkpoint import CheckpointTuning, async_save, maybe_finalize_async_calls, saver
    from lightning_zero.checkpoint.formats.tree import walk
    from lightning_zero.checkpoint.runtime.staging import Stager
    from lightning_zero.checkpoint.saver import _SaveJob

    seen: dict[str, bool] = {}
    staged_copy: list[Any] = []
    stage, write = _SaveJob.stage, _SaveJob.write

    def recording_stage(self: _SaveJob, staged: Any) -> None:
        seen["stage"] = gc.isenabled()
        stage(self, staged)
        copied = self.state  # a tree of copies (sharded), or the local rank file's filled pack plan
        staged_copy.append(weakref.ref(next(leaf for _, leaf in walk(copied)) if isinstance(copied, dict) else copied))

    def recording_write(self: _SaveJob) -> None:
        seen["write"] = gc.isenabled()
        write(self)

    plan, map_leaves = Stager.plan, saver.map_leaves

    def recording_plan(self: Stager, tree: Any) -> Any:
        seen["queue"] = gc.isenabled()
        return plan(self, tree)

    def recording_map_leaves(tree: Any, fn: Any) -> Any:
        seen["queue"] = gc.isenabled()
        return map_leaves(tree, fn)

    monkeypatch.setattr(_SaveJob, "stage", recording_stage)
    monkeypatch.setattr(_SaveJob, "write", recording_write)
    monkeypatch.setattr(Stager, "plan", recording_plan)
    monkeypatch.setattr(saver, "map_leaves", recording_map_leaves)
    state = {f"w{i}": torch.full((4, 4), float(i)) for i in range(80)}
    async_save(state, str(tmp_path / "c.ckpt"), mode=mode, tuning=CheckpointTuning(pause_gc=pause_gc))  # a copy
    maybe_finalize_async_calls(blocking=True)
    assert seen == {"queue": not pause_gc, "stage": not pause_gc, "write": not pause_gc}
    assert gc.isenabled()
    assert staged_copy[0]() is None  # the staged copy was dropped, not left for the collector
    loaded = {key: torch.zeros(4, 4) for key in state}
    load(loaded, str(tmp_path / "c.ckpt"))
    assert all(torch.equal(loaded[key], value) for key, value in state.items())


def test_a_flat_state_dict_is_planned_as_dcp_would_without_its_flattening() -> None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from lightning_zero.checkpoint.dcp.adapter import FlatChunkSavePlanner

    flat = {"model/w": torch.ones(3), "optimizer/state/0/exp_avg": FlatChunk(torch.zeros(2), 4, 2)}
    planner = FlatChunkSavePlanner()
    planner.set_up_planner(flat, is_coordinator=True)
    assert planner.state_dict is flat and planner.mappings == flatten_state_dict(flat)[1]
    nested = {"model": {"w": torch.ones(3)}, "n": 1}  # anything else takes DCP's own flattening
    planner.set_up_planner(nested, is_coordinator=True)
    assert set(planner.state_dict) == {"model.w", "n"} and planner.mappings == flatten_state_dict(nested)[1]


def test_a_process_forked_during_a_pause_starts_with_the_collector_as_it_was() -> None:
    # A DataLoader worker forked while the background thread plans a save has no thread to end
    # the pause: it starts with the collector on, and can pause and resume it itself.
    import gc
    import os

    from lightning_zero.checkpoint.runtime.process import gc_paused

    read_end, write_end = os.pipe()
    with gc_paused():
        pid = os.fork()
        if pid == 0:  # the child: report, then leave without running the parent's cleanup
            enabled = gc.isenabled()
            with gc_paused():
                paused = not gc.isenabled()
            os.write(write_end, bytes([enabled, paused, gc.isenabled()]))
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read_end, 3) == bytes([True, True, True])
    os.close(read_end)
    os.close(write_end)
    assert gc.isenabled()
