"""One test per private torch/Lightning API in ``lightning_zero/_compat.py``: an upgrade that moves one
fails the test named for it."""

from __future__ import annotations

import inspect
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins import TorchCheckpointIO

from lightning_zero import _compat
from lightning_zero.engine import _compat as engine_compat

# -- versions -----------------------------------------------------------------------------------


def test_older_torch_is_refused_at_import_naming_both_versions() -> None:
    with pytest.raises(ImportError, match=r"torch >= 2\.9; torch 2\.8\.0\+cu128 is installed.*pip install 'torch>=2\.9'"):
        _compat.require_supported_versions(torch_version="2.8.0+cu128", lightning_version=lightning.__version__)


def test_older_lightning_is_refused_at_import_naming_both_versions() -> None:
    with pytest.raises(ImportError, match=r"lightning >= 2\.5; lightning 2\.4\.0 is installed"):
        _compat.require_supported_versions(torch_version=torch.__version__, lightning_version="2.4.0")


def test_supported_versions_import() -> None:
    _compat.require_supported_versions()
    _compat.require_supported_versions(torch_version="2.9.0", lightning_version="2.5.0.post0")
    _compat.require_supported_versions(torch_version="2.15.0a0+git1234", lightning_version="2.6.6")


# -- torch --------------------------------------------------------------------------------------


def test_fsspec_writer_and_reader_take_storage_options(tmp_path: Path) -> None:
    writer_class, reader_class = _compat.fsspec_storage_classes()
    url = f"file://{tmp_path}"
    # auto_mkdir is an option of fsspec's local filesystem: it reaches the filesystem DCP builds.
    writer = writer_class(url, sync_files=False, auto_mkdir=True, skip_instance_cache=True)
    reader = reader_class(url, auto_mkdir=True, skip_instance_cache=True)
    assert writer.fs.fs.auto_mkdir is True and reader.fs.fs.auto_mkdir is True


def test_save_planner_takes_plan_caching() -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planner = DefaultSavePlanner(**_compat.save_planner_kwargs(True))
    assert planner._cached_plans_key == "DefaultSavePlanner"  # the key lightning_zero sets per team


def test_save_planner_caches_are_five_dicts_dcp_fills() -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class Planner(DefaultSavePlanner):
        pass

    planner = Planner(**_compat.save_planner_kwargs(True))
    planner._cached_plans_key = key = "test_compat_key"
    planner.set_up_planner({"weight": torch.zeros(3)}, is_coordinator=True)
    try:
        planner.create_global_plan([planner.create_local_plan()])
        caches = _compat.save_planner_caches()
        assert len(caches) == 5 and all(isinstance(cache, dict) for cache in caches)
        assert key in caches[1] and key in caches[3]  # all local plans, metadata
    finally:
        for cache in _compat.save_planner_caches():
            cache.pop(key, None)


def test_save_planner_dedup_hook_is_called_by_create_global_plan() -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    called: list[int] = []

    class Planner(DefaultSavePlanner):
        def _dedup_save_plans(self, all_plans: list[Any]) -> list[Any]:
            called.append(len(all_plans))
            return super()._dedup_save_plans(all_plans)

    planner = Planner(dedup_save_to_lowest_rank=True)
    planner.set_up_planner({"weight": torch.zeros(3)}, is_coordinator=True)
    planner.create_global_plan([planner.create_local_plan()])
    assert called == [1]


def test_dcp_metadata_path_names_the_global_and_a_ranks_file(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(str(tmp_path))
    assert Path(_compat.dcp_metadata_path(reader, None)) == tmp_path / ".metadata"
    per_rank = Path(_compat.dcp_metadata_path(reader, 3))
    assert per_rank.parent == tmp_path and per_rank.name != ".metadata" and "3" in per_rank.name


def test_file_system_reader_slices_items_with_slice_file(tmp_path: Path) -> None:
    import io

    from torch.distributed.checkpoint import FileSystemReader

    class Info:
        offset, length = 2, 3

    view = FileSystemReader(str(tmp_path))._slice_file(io.BytesIO(b"0123456789"), Info())
    assert view.read() == b"234"


def test_storage_alignment_is_the_alignment_of_torch_save_data_records() -> None:
    import io
    import zipfile

    alignment = _compat.storage_alignment()
    assert alignment > 0 and alignment & (alignment - 1) == 0
    blob = io.BytesIO()
    torch.save(torch.arange(10.0), blob)
    with zipfile.ZipFile(io.BytesIO(blob.getvalue())) as archive:
        record = next(info for info in archive.infolist() if info.filename.endswith("/data/0"))
    header = blob.getvalue()[record.header_offset: record.header_offset + 30]
    start = record.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
    assert start % alignment == 0


def test_dcp_save_tensors_writes_what_dcp_save_writes(single_rank_group: None, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"a": torch.arange(6.0), "b": torch.full((2, 3), 7, dtype=torch.int64)}
    _compat.dcp_save_tensors(state, dcp.FileSystemWriter(str(tmp_path / "ours")), None, None)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")))
    for name in ("ours", "dcp"):
        target = {"a": torch.zeros(6), "b": torch.zeros((2, 3), dtype=torch.int64)}
        dcp.load(target, checkpoint_id=str(tmp_path / name))
        assert all(torch.equal(target[key], state[key]) for key in state), name
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == sorted(p.name for p in (tmp_path / "dcp").iterdir())
    ours, theirs = (dcp.FileSystemReader(str(tmp_path / name)).read_metadata() for name in ("ours", "dcp"))
    assert ours.storage_data == theirs.storage_data  # the results came back from their rows as DCP's own
    assert ours.state_dict_metadata == theirs.state_dict_metadata


def test_dcp_writer_file_names_and_storage_records_are_the_ones_it_writes(tmp_path: Path) -> None:
    import types

    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(str(tmp_path), thread_count=1)
    assert _compat.dcp_writes_plain_files(writer)
    assert not _compat.dcp_writes_plain_files(dcp.FileSystemWriter(str(tmp_path / "x"), single_file_per_rank=False))
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    assert not _compat.dcp_writes_plain_files(dcp.FileSystemWriter(
        str(tmp_path / "y"), serialization_format=SerializationFormat.SAFETENSORS))
    dcp.save({"w": torch.arange(4.0)}, storage_writer=writer, no_dist=True)
    (info,) = dcp.FileSystemReader(str(tmp_path)).read_metadata().storage_data.values()
    prefix = info.relative_path[: -len("0.distcp")]
    assert _compat.dcp_data_file_name(types.SimpleNamespace(storage_data=types.SimpleNamespace(prefix=prefix)), 0) == (
        info.relative_path)
    ours = _compat.dcp_storage_info_type()(info.relative_path, info.offset, info.length)
    assert type(ours) is type(info)
    assert (ours.relative_path, ours.offset, ours.length, ours.transform_descriptors) == (
        info.relative_path, info.offset, info.length, info.transform_descriptors)


def test_crc32_in_torch_save_follows_torch_setting() -> None:
    before = _compat.crc32_in_torch_save()
    torch.serialization.set_crc32_options(not before)
    try:
        assert _compat.crc32_in_torch_save() is (not before)
    finally:
        torch.serialization.set_crc32_options(before)


def test_torch_save_without_record_crcs_loads_as_torch_save_does(tmp_path: Any) -> None:
    import zipfile

    state = {"w": torch.arange(5000, dtype=torch.float32), "meta": {"step": 3}}
    path = tmp_path / "no-crcs.pt"
    with open(path, "wb") as f:
        _compat.torch_save_without_record_crcs(state, f)
    for mmap in (False, True):
        loaded = torch.load(path, weights_only=True, mmap=mmap)
        assert torch.equal(loaded["w"], state["w"]) and loaded["meta"] == {"step": 3}
    with zipfile.ZipFile(path) as archive:  # the records carry no CRC32 of their own
        assert {info.CRC for info in archive.infolist() if info.file_size} == {0}
    assert torch.serialization.get_crc32_options()  # the process-wide setting is untouched


def test_a_checkpoint_callbacks_state_carries_what_decides_its_next_save(tmp_path: Any) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    source = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    source.last_model_path, source.best_model_path = str(tmp_path / "last.ckpt"), str(tmp_path / "best.ckpt")
    source._last_global_step_saved, source._last_checkpoint_saved = 15, str(tmp_path / "step=15.ckpt")
    healed = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _compat.load_checkpoint_callback_state(healed, _compat.checkpoint_callback_state(source))
    assert healed.last_model_path == source.last_model_path and healed.best_model_path == source.best_model_path
    assert (healed._last_global_step_saved, healed._last_checkpoint_saved) == (15, str(tmp_path / "step=15.ckpt"))


def test_device_types_of_a_gloo_group(single_rank_group: None) -> None:
    types = engine_compat.device_types(dist.group.WORLD)
    assert "cpu" in types and all(isinstance(t, str) for t in types)  # gloo also registers for cuda


def test_process_group_timeout_of_the_cpu_backend() -> None:
    from _dist import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=123))
    try:
        assert engine_compat.process_group_timeout("cpu") == timedelta(seconds=123)
    finally:
        dist.destroy_process_group()


def test_element_size_of_dtypes() -> None:
    assert [_compat.element_size(d) for d in (torch.bfloat16, torch.float32, torch.int64, torch.bool)] == [2, 4, 8, 1]


TRACED: list[int] = []


def _note_trace(_ctx: Any) -> None:
    TRACED.append(1)


def test_run_at_trace_time_runs_once_while_tracing_and_never_in_the_graph() -> None:
    TRACED.clear()
    graphs: list[torch.fx.GraphModule] = []

    def backend(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(graph)
        return graph.forward

    def double(x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            engine_compat.run_at_trace_time(_note_trace)
        return x * 2

    compiled = torch.compile(double, backend=backend, fullgraph=True)
    for _ in range(3):
        assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))
    assert TRACED == [1]  # traced once, then the cached graph runs without it
    assert len(graphs) == 1
    double(torch.ones(2))  # eager: nothing runs
    assert TRACED == [1]


def test_is_compiled_function_tells_what_torch_compile_returned() -> None:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    assert not engine_compat.is_compiled_function(optimizer.step)
    assert engine_compat.is_compiled_function(torch.compile(optimizer.step, backend="eager"))


def test_tensor_version_counter_counts_in_place_writes() -> None:
    tensor = torch.zeros(2)
    before = tensor._version
    tensor.add_(1)
    assert tensor._version == before + 1


def test_module_parameters_dict_holds_the_registered_parameters() -> None:
    layer = torch.nn.Linear(2, 2)
    assert dict(layer._parameters) == dict(layer.named_parameters(recurse=False))


def test_autograd_engine_runs_a_queued_callback_at_the_end_of_backward() -> None:
    ran: list[bool] = []
    weight = torch.ones(2, requires_grad=True)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: ran.append(True))
        return grad

    weight.register_hook(hook)
    (weight * 2).sum().backward()
    assert ran == [True]


def test_foreach_clipping_kernels() -> None:
    grads = [torch.tensor([1.0, -4.0]), torch.tensor([3.0])]
    torch._foreach_mul_(grads, torch.tensor(2.0))
    torch._foreach_clamp_min_(grads, -5.0)
    torch._foreach_clamp_max_(grads, 5.0)
    assert [g.tolist() for g in grads] == [[2.0, -5.0], [5.0]]


# -- Lightning ----------------------------------------------------------------------------------


def test_strategy_registry_registers_a_strategy() -> None:
    registry = _compat.StrategyRegistry()
    registry.register("compat_test", lambda: None, description="a test")
    assert "compat_test" in registry


def test_mock_optimizer_is_the_optimizer_lightning_stands_in_for_none() -> None:
    optimizer = _compat.MockOptimizer()
    assert isinstance(optimizer, torch.optim.Optimizer) and optimizer.state_dict() == {}
    assert optimizer.step() is None


def test_sync_module_states_broadcasts_rank_zeros_values(single_rank_group: None) -> None:
    layer = torch.nn.Linear(2, 2)
    before = [p.clone() for p in layer.parameters()]
    _compat.sync_module_states(layer)
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))


def test_lightning_loader_is_what_load_from_checkpoint_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.core import saving

    calls: list[str] = []
    monkeypatch.setattr(saving, "pl_load", lambda path, **kwargs: calls.append(str(path)) or {"state_dict": {}})
    assert _compat.lightning_loader() is saving.pl_load
    with pytest.raises(Exception):  # noqa: B017 - the loader ran; what a checkpoint without fields does next is Lightning's
        lightning.LightningModule.load_from_checkpoint(tmp_path / "x.ckpt")
    assert calls == [str(tmp_path / "x.ckpt")]


def test_plain_checkpoint_load_passes_weights_only_where_lightning_takes_it(tmp_path: Path) -> None:
    path = tmp_path / "plain.ckpt"
    torch.save({"value": 1}, path)
    io = TorchCheckpointIO()
    assert _compat.plain_checkpoint_load(io, path) == {"value": 1}
    if "weights_only" in __import__("inspect").signature(io.load_checkpoint).parameters:
        assert _compat.plain_checkpoint_load(io, path, weights_only=True) == {"value": 1}
    else:
        with pytest.raises(TypeError, match=r"weights_only=True needs lightning >= 2\.6"):
            _compat.plain_checkpoint_load(io, path, weights_only=True)


def test_model_checkpoint_methods_replaced_by_name_exist() -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    callback = ModelCheckpoint(dirpath="memory://compat")
    assert callable(callback._find_last_checkpoints) and callable(callback._link_checkpoint)
    assert callback._fs.protocol in ("memory", ("memory",))


def test_lightning_optimizer_wraps_its_optimizer_as_underscore_optimizer() -> None:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    assert LightningOptimizer(optimizer)._optimizer is optimizer


def test_checkpoint_connector_resumes_through_resume_start() -> None:
    from lightning.pytorch import Trainer

    connector = _compat.checkpoint_connector(Trainer(logger=False, accelerator="cpu", devices=1))
    assert "weights_only" in inspect.signature(type(connector).resume_start).parameters
    connector.resume_start(None)  # no path: nothing loaded
    assert connector._ckpt_path is None and not connector._loaded_checkpoint


def test_persistent_buffers_are_the_buffers_state_dict_holds() -> None:
    class Rope(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cos", torch.ones(3), persistent=False)
            self.register_buffer("scale", torch.ones(1))
            self.register_buffer("empty", None)

    model = torch.nn.Sequential(torch.nn.BatchNorm1d(2), Rope())
    model.shared = model[1]  # the same submodule under two names: named once, as state_dict does
    names = [name for name, _ in _compat.persistent_buffers(model)]
    expected = [k for k in model.state_dict() if k in dict(model.named_buffers())]
    assert names == expected
    assert "1.cos" not in names and "1.scale" in names


def test_restart_training_iterator_makes_the_fit_loops_iterator_anew() -> None:
    from lightning.pytorch.loops import _FitLoop

    # The attribute the fit loop's setup_data iterates (and the one _compat.restart_training_iterator uses).
    assert "iter(self._data_fetcher)" in inspect.getsource(_FitLoop.setup_data)

    class Fetcher:
        iterated = 0

        def __iter__(self) -> Any:
            Fetcher.iterated += 1
            return iter(())

    class Loop:
        _data_fetcher = Fetcher()

    class FakeTrainer:
        fit_loop = Loop()

    _compat.restart_training_iterator(FakeTrainer())
    assert Fetcher.iterated == 1


def test_replace_inserted_sampler_offers_only_the_distributed_sampler_lightning_puts_in_a_training_loader() -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.trainer.states import RunningStage
    from torch.utils.data import DataLoader, DistributedSampler

    class Replacement(DistributedSampler):
        pass

    offered: list[Any] = []

    def replace(loader: DataLoader, sampler: DistributedSampler) -> Replacement:
        offered.append(sampler)
        return Replacement(sampler.dataset, num_replicas=sampler.num_replicas, rank=sampler.rank)

    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)  # not launched: no processes
    _compat.replace_inserted_sampler(trainer, replace)
    _compat.replace_inserted_sampler(trainer, replace)  # replaces the first wrapper, does not wrap it
    prepare = trainer._data_connector._prepare_dataloader
    data = list(range(8))
    loader = prepare(DataLoader(data, batch_size=2, shuffle=True), shuffle=True, mode=RunningStage.TRAINING)
    assert type(loader.sampler) is Replacement and loader.batch_size == 2
    [inserted] = offered
    assert type(inserted) is DistributedSampler and inserted.shuffle and inserted.num_replicas == 2
    own = DistributedSampler(data, num_replicas=2, rank=0)
    assert prepare(DataLoader(data, sampler=own), shuffle=True, mode=RunningStage.TRAINING).sampler is own
    validation = prepare(DataLoader(data, batch_size=2), shuffle=False, mode=RunningStage.VALIDATING)
    assert type(validation.sampler) is DistributedSampler and len(offered) == 1


def test_not_resumable_warning_is_lightnings_and_left_out_only_while_resumed_exactly(tmp_path: Path) -> None:
    import warnings

    from data_cases import Ids, RecordsIds
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    def fit(max_steps: int, ckpt_path: Path | None = None, resumed_exactly: bool | None = None) -> list[str]:
        trainer = Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
        if resumed_exactly is not None:
            _compat.quiet_not_resumable_warning(trainer, lambda: resumed_exactly)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(RecordsIds(), DataLoader(Ids(), batch_size=4, shuffle=True), ckpt_path=ckpt_path)
        if ckpt_path is None:
            trainer.save_checkpoint(tmp_path / "middle.ckpt")  # 2 of the epoch's 6 batches done
        return [str(w.message) for w in caught if _compat.NOT_RESUMABLE_WARNING in str(w.message)]

    assert fit(2) == []
    assert len(fit(3, tmp_path / "middle.ckpt")) == 1  # Lightning's own text
    assert len(fit(3, tmp_path / "middle.ckpt", resumed_exactly=False)) == 1
    assert fit(3, tmp_path / "middle.ckpt", resumed_exactly=True) == []


# -- fault tolerance: the fit loop's counters (lightning_zero/trainer_fault_tolerance.py) -----------


class _StepCounting:
    """A one-rank fit of a tiny model whose optimizer step runs ``inside_step(trainer)`` before its update."""

    @staticmethod
    def fit(tmp_path: Path, steps: int, inside_step: Any) -> Any:
        from lightning.pytorch import LightningModule, Trainer
        from torch.utils.data import DataLoader

        class Tiny(LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.layer = torch.nn.Linear(2, 1)

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                return self.layer(batch).sum()

            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.parameters(), lr=0.1)

            def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
                super().optimizer_step(*args, **kwargs)
                inside_step(self.trainer)

        trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
        trainer.fit(Tiny(), DataLoader(torch.randn(64, 2), batch_size=4))
        return trainer


def test_discard_optimizer_step_keeps_global_step_and_the_loggers_step(tmp_path: Path) -> None:
    """Every other step discarded inside its optimizer step: trainer.global_step and the loggers' step count the
    others only, and Lightning's ready/completed counters still agree."""
    seen: list[int] = []

    def inside_step(trainer: Any) -> None:
        seen.append(trainer.global_step)
        if len(seen) % 2 == 0:
            _compat.discard_optimizer_step(trainer)

    trainer = _StepCounting.fit(tmp_path, 3, inside_step)
    assert trainer.global_step == 3 and len(seen) == 5  # 5 batches for 3 counted steps
    assert trainer.fit_loop.epoch_loop._batches_that_stepped == 3
    step = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step
    assert step.total.ready == step.total.completed == 3


def test_loop_counters_read_in_a_step_load_into_another_trainer_in_or_out_of_a_step(tmp_path: Path) -> None:
    """loop_counters read inside a peer's step (its "ready" is one ahead) and loaded into a trainer inside its own
    step give that trainer the peer's global step, loggers' step and epoch, with ready == completed after the step."""
    counters: list[dict[str, Any]] = []
    _StepCounting.fit(tmp_path / "peer", 7, lambda trainer: counters.append(_compat.loop_counters(trainer)))
    peer = counters[-1]  # read inside the peer's 7th step: 6 steps completed
    assert peer["optim_progress"]["optimizer"]["step"]["total"]["completed"] == 6

    def heal_once(trainer: Any) -> None:
        if trainer.global_step == 0:
            _compat.load_loop_counters(trainer, peer, in_step=True)

    trainer = _StepCounting.fit(tmp_path / "healed", 9, heal_once)
    assert trainer.global_step == 9  # 6 carried, then its own three steps (the first of them the healed one)
    step = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step
    assert step.total.ready == step.total.completed == 9
    outside = _StepCounting.fit(tmp_path / "outside", 1, lambda trainer: None)
    _compat.load_loop_counters(outside, peer, in_step=False)
    assert outside.global_step == 6 and outside.fit_loop.epoch_loop._batches_that_stepped == 6


def test_mark_last_batch_ends_the_epoch_after_this_batch(tmp_path: Path) -> None:
    """is_last_batch set during a step ends the epoch there (16 batches per epoch; marked at the 3rd)."""
    from lightning.pytorch import Trainer

    epochs: list[int] = []

    def inside_step(trainer: Any) -> None:
        epochs.append(trainer.current_epoch)
        if len(epochs) == 3:
            _compat.mark_last_batch(trainer, True)

    trainer = _StepCounting.fit(tmp_path, 5, inside_step)
    assert isinstance(trainer, Trainer)
    assert epochs == [0, 0, 0, 1, 1]


def test_write_results_travel_as_plain_rows_and_come_back_as_dcp_made_them() -> None:
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    info = _StorageInfo("__0_0.distcp", 128, 64)
    info.crc32 = ("zip-records", 7)  # the package's checksum rides along
    results = [WriteResult(index=MetadataIndex("w", [4], 0), size_in_bytes=64, storage_data=info),
               WriteResult(index=MetadataIndex("b"), size_in_bytes=8, storage_data=_StorageInfo("__0_0.distcp", 0, 8))]
    rows = _compat._write_result_rows(results)
    assert rows[1] and all(type(value) in (str, int, tuple, type(None)) for row in rows[1] for value in row)
    back = _compat._write_results(pickle.loads(pickle.dumps(rows)))
    assert back == results  # dataclass equality: index, size and storage record
    assert back[0].storage_data.crc32 == ("zip-records", 7) and not hasattr(back[1].storage_data, "crc32")
    assert back[0].index.offset == torch.Size([4]) and back[0].index.index == 0
    # A record of another writer (stream transforms) goes as it is, and so does a list already of results.
    transformed = [WriteResult(index=MetadataIndex("w", [0]), size_in_bytes=4,
                               storage_data=_StorageInfo("__0_0.distcp", 0, 4, transform_descriptors=["zstd"]))]
    assert _compat._write_result_rows(transformed) is transformed
    assert _compat._write_results(transformed) is transformed


def test_update_dataloader_makes_a_loader_subclass_again_with_a_new_sampler() -> None:
    from torch.utils.data import DataLoader, SequentialSampler

    class Loader(DataLoader):
        def __init__(self, dataset: Any, tag: str, **kwargs: Any) -> None:
            super().__init__(dataset, **kwargs)
            self.tag = tag

    dataset = list(range(10))
    loader = Loader(dataset, "mine", batch_size=3, shuffle=True)
    sampler = SequentialSampler(dataset)
    rebuilt = _compat.update_dataloader(loader, sampler)
    assert type(rebuilt) is Loader and rebuilt.tag == "mine" and rebuilt.batch_size == 3
    assert rebuilt.sampler is sampler and [batch.tolist() for batch in rebuilt][0] == [0, 1, 2]


def test_write_result_rows_hold_every_field_of_dcps_records() -> None:
    # A torch that adds a field to WriteResult or MetadataIndex gets its results sent as they are, not as rows.
    assert _compat._rows_hold_write_results()
