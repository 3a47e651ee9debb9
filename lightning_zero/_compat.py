"""Every private (or recently added) torch and Lightning API this package depends on, in one place.

Each is behind a small function or name here, whose docstring names the API and the versions that
have it, and each has one test in ``tests/test_compat.py``: a torch or Lightning upgrade that moves
one fails the test named for it, not a checkpoint at run time. Importing this module (the package
does, first) refuses versions that cannot work, naming the installed version and the minimum.

Versions were read from each release's sources (torch 2.4 to 2.15, Lightning 2.4 to 2.6) and the
supported range is measured by ``make test-matrix`` (``COMPATIBILITY.md``). Lower bounds:

- torch 2.9: ``sharded`` saves need :func:`save_planner_caches` (``_cached_metadata``, 2.8) and
  ``enable_plan_caching`` (2.7); loads need :func:`dcp_metadata_path` (2.9); S3 needs the fsspec
  storage options (2.7); :func:`crc32_in_torch_save` and the engine's ``device_types`` need 2.6.
- Lightning 2.5: Lightning 2.4's CLI cannot merge the demo's ``subclass_mode_model`` hyper-parameters.

Internals used in place, stable for many releases and tested here all the same: the ``ModelCheckpoint``
methods ``_lightning_fixes.py`` replaces by name (``_find_last_checkpoints``, ``_link_checkpoint``, ``setup``)
and its ``_fs`` (strategy.py). The engine's torch internals are in ``lightning_zero/engine/_compat.py``, which
imports no Lightning.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import pickle
import re
import warnings
from collections.abc import Callable
from typing import Any

import lightning
import torch

MIN_TORCH = "2.9"
MIN_LIGHTNING = "2.5"


def _release(version: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``."""
    match = re.match(r"\d+(\.\d+)*", version)
    if match is None:
        raise ValueError(f"not a version number: {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def require_supported_versions(torch_version: str | None = None, lightning_version: str | None = None) -> None:
    """Raise ImportError when the installed torch or Lightning is older than this package supports."""
    torch_version = torch.__version__ if torch_version is None else torch_version
    lightning_version = lightning.__version__ if lightning_version is None else lightning_version
    if _release(torch_version) < _release(MIN_TORCH):
        raise ImportError(
            f"lightning_zero needs torch >= {MIN_TORCH}; torch {torch_version} is installed. Its"
            " torch.distributed.checkpoint lacks what sharded checkpoints use (plan caching, per-rank"
            f" metadata paths, fsspec storage options). Upgrade with: pip install 'torch>={MIN_TORCH}'"
        )
    if _release(lightning_version) < _release(MIN_LIGHTNING):
        raise ImportError(
            f"lightning_zero needs lightning >= {MIN_LIGHTNING}; lightning {lightning_version} is installed."
            f" Upgrade with: pip install 'lightning>={MIN_LIGHTNING}'"
        )


require_supported_versions()

# Lightning: private names imported by the strategy (Lightning 2.5 and 2.6 have them: tested).
from lightning.fabric.strategies import _StrategyRegistry as StrategyRegistry  # noqa: E402
from lightning.pytorch.core.optimizer import _MockOptimizer as MockOptimizer  # noqa: E402
from lightning.pytorch.overrides.distributed import _sync_module_states as sync_module_states  # noqa: E402

__all__ = [
    "MIN_LIGHTNING", "MIN_TORCH", "NOT_RESUMABLE_WARNING", "MockOptimizer", "StrategyRegistry", "crc32_in_torch_save",
    "dcp_metadata_path", "element_size", "fsspec_storage_classes", "lightning_loader", "plain_checkpoint_load",
    "quiet_not_resumable_warning", "replace_inserted_sampler", "require_supported_versions", "save_planner_caches",
    "save_planner_kwargs", "sync_module_states", "update_dataloader",
]


# torch ------------------------------------------------------------------------------------------

def fsspec_storage_classes() -> tuple[type, type]:
    """DCP's ``(FsspecWriter, FsspecReader)``: ``torch.distributed.checkpoint.fsspec_filesystem`` where
    torch has it (the public module; torch 2.15 makes ``_fsspec_filesystem`` a deprecated alias of it),
    else the private ``torch.distributed.checkpoint._fsspec_filesystem`` (torch 2.9 to 2.14). Both take
    fsspec storage options as keyword arguments from torch 2.7."""
    try:
        from torch.distributed.checkpoint import fsspec_filesystem as module  # type: ignore[attr-defined]
    except ImportError:
        from torch.distributed.checkpoint import _fsspec_filesystem as module
    return module.FsspecWriter, module.FsspecReader


def save_planner_kwargs(plan_caching: bool) -> dict[str, Any]:
    """Keyword arguments of ``DefaultSavePlanner`` for DCP's cached save plans:
    ``enable_plan_caching`` (torch 2.7 and later). The cache is keyed by the planner attribute
    ``_cached_plans_key`` (same versions)."""
    return {"enable_plan_caching": plan_caching}


def save_planner_caches() -> tuple[dict[str, Any], ...]:
    """DCP's class-level save-plan caches, under ``_cached_plans_key``: ``SavePlanner._cached_save_plan``,
    ``_cached_all_plans``, ``_cached_global_plan``, ``_cached_metadata`` (torch 2.8 and later; the others
    2.7) and ``_cached_final_save_plan``."""
    from torch.distributed.checkpoint.planner import SavePlanner

    return (SavePlanner._cached_save_plan, SavePlanner._cached_all_plans, SavePlanner._cached_global_plan,
            SavePlanner._cached_metadata, SavePlanner._cached_final_save_plan)


def dcp_metadata_path(reader: Any, rank: int | None) -> Any:
    """``FileSystemReader._get_metadata_path(rank)``: the path of ``.metadata`` (``rank`` None) or of a
    rank's own metadata file (torch 2.9 and later). Readers here also override the private
    ``FileSystemReader._slice_file(file, sinfo)`` (the view of one item's bytes) and
    ``DefaultSavePlanner._dedup_save_plans(all_plans)`` (called by ``create_global_plan`` from torch 2.8)."""
    return reader._get_metadata_path(rank)


def torch_save_without_record_crcs(obj: Any, stream: Any) -> None:
    """``torch.save(obj, stream)`` whose zip records carry no CRC32, for this call only (the process-wide
    ``torch.serialization.set_crc32_options`` would change every other thread's saves too):
    ``torch._C.PyTorchFileWriter(stream, compute_crc32, storage_alignment)``,
    ``torch.serialization._get_storage_alignment`` and ``torch.serialization._save``, as ``torch.save`` itself opens
    and fills the writer in the torch versions the package supports (``make test-matrix`` runs this module's tests
    on each). ``torch.load`` reads such a file as any other; it checks no record CRC in either case ([Note: why
    our own checksums] in formats/integrity.py)."""
    writer = torch._C.PyTorchFileWriter(stream, False, storage_alignment())
    try:
        torch.serialization._save(obj, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    finally:  # as torch.save's writer context ends, failed or not
        writer.write_end_of_file()
        stream.flush()


def dcp_save_tensors(state_dict: dict[str, Any], storage_writer: Any, planner: Any, process_group: Any) -> None:
    """DCP's save protocol, as ``state_dict_saver._save_state_dict`` runs it (torch 2.4 to 2.15: ``_DistWrapper``'s
    ``reduce_scatter`` of the plans, then ``all_reduce`` of the write results into ``.metadata``), for a state dict
    that holds no ``Stateful`` object (tensors and flat chunks). Two steps of ``dcp.save`` are left out, both
    per-key work that a ``sharded`` save of thousands of flat keys paid on every save (BENCHMARKS.md):

    - the walk of the top-level values before the protocol (``_stateful_to_state_dict``), which checks each
      against the runtime ``Stateful`` protocol (whose ``isinstance`` collects the protocol's members every
      time) and wraps each in DCP's per-call logger;
    - the broadcast of the global ``.metadata`` to every rank at the end, pickled on the coordinator and
      unpickled on every rank: ``dcp.save`` returns it, the package never reads it. What is broadcast instead is
      whether the coordinator wrote it; a failure on any rank still fails every rank alike, as one
      ``CheckpointException``.

    And each rank's write results reach the coordinator as rows of plain values (:func:`_write_result_rows`),
    which pickle in C, instead of DCP's dataclasses, each pickled through Python-level ``__getstate__`` calls;
    the coordinator builds the same records from them for ``.metadata``.

    ``planner`` None: DCP's default planner. ``no_dist`` as ``save`` decides it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.utils import _DistWrapper

    planner = DefaultSavePlanner() if planner is None else planner
    no_dist = not (dist.is_available() and dist.is_initialized())
    dist_w = _DistWrapper(process_group, not no_dist, 0)
    global_metadata = None

    def local_step() -> Any:
        planner.set_up_planner(state_dict=state_dict, storage_meta=storage_writer.storage_meta(),
                               is_coordinator=dist_w.is_coordinator)
        if "kwargs" in inspect.signature(storage_writer.set_up_storage_writer).parameters:
            storage_writer.set_up_storage_writer(dist_w.is_coordinator, rank=dist_w.rank, use_collectives=True)
        else:
            storage_writer.set_up_storage_writer(dist_w.is_coordinator)
        return storage_writer.prepare_local_plan(planner.create_local_plan())

    def global_step(all_local_plans: list[Any]) -> list[Any]:
        nonlocal global_metadata
        all_local_plans, global_metadata = planner.create_global_plan(all_local_plans)
        return storage_writer.prepare_global_plan(all_local_plans)

    central_plan = dist_w.reduce_scatter("plan", local_step, global_step)

    def write_data() -> Any:
        writes = storage_writer.write_data(planner.finish_plan(central_plan), planner)
        writes.wait()
        return _write_result_rows(writes.value())

    def finish_checkpoint(all_results: list[Any]) -> bool:
        try:
            storage_writer.finish(metadata=global_metadata, results=[_write_results(rows) for rows in all_results])
        finally:
            # The records of this save's items, set on a ``.metadata`` DCP keeps cached for the next save, which
            # sets its own: dropped now rather than kept alive into the collector's old generation until then.
            global_metadata.storage_data = None
        return True

    dist_w.all_reduce("write", write_data, finish_checkpoint)


_RESULT_ROWS = "lightning_zero.write-result-rows"
_STORAGE_INFO_FIELDS = frozenset({"relative_path", "offset", "length", "transform_descriptors", "crc32"})


def _write_result_rows(results: list[Any]) -> Any:
    """DCP's ``WriteResult`` s of one rank as ``(marker, rows)``, a row of plain values each (``MetadataIndex``'s
    ``fqn``, ``offset``, ``index``; the size; ``filesystem._StorageInfo``'s ``relative_path``, ``offset``,
    ``length``; the package's ``crc32``); ``results`` as they are where any is not exactly such a record (another
    writer's storage data, stream transforms), or where this torch's records have fields a row leaves out."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    if not _rows_hold_write_results():
        return results
    rows = []
    for result in results:
        info, index = result.storage_data, result.index
        fields = getattr(info, "__dict__", None)
        if (type(result) is not WriteResult or type(info) is not _StorageInfo or info.transform_descriptors is not None
                or fields is None or not _STORAGE_INFO_FIELDS.issuperset(fields)):
            return results
        rows.append((index.fqn, None if index.offset is None else tuple(index.offset), index.index,
                     result.size_in_bytes, info.relative_path, info.offset, info.length, getattr(info, "crc32", None)))
    return _RESULT_ROWS, rows


@functools.cache
def _rows_hold_write_results() -> bool:
    """Whether ``WriteResult`` and ``MetadataIndex`` have exactly the fields a row carries (torch 2.4 to 2.15)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    return ({field.name for field in dataclasses.fields(WriteResult)} == {"index", "size_in_bytes", "storage_data"}
            and {field.name for field in dataclasses.fields(MetadataIndex)} == {"fqn", "offset", "index"})


def _write_results(value: Any) -> Any:
    """The ``WriteResult`` s :func:`_write_result_rows` made rows of, as DCP's writer made them (anything else as
    it is)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    if not (isinstance(value, tuple) and len(value) == 2 and value[0] == _RESULT_ROWS):
        return value
    results = []
    for fqn, offset, index, size, path, start, length, crc in value[1]:
        info = _StorageInfo(path, start, length)
        if crc is not None:
            info.crc32 = crc
        results.append(WriteResult(index=MetadataIndex(fqn, offset, index), size_in_bytes=size, storage_data=info))
    return results


def storage_alignment() -> int:
    """``torch.serialization._get_storage_alignment()``: the alignment of ``torch.save``'s data records
    (torch 2.5 and later)."""
    return int(torch.serialization._get_storage_alignment())


def dcp_writes_plain_files(writer: Any) -> bool:
    """Whether DCP file-system writer ``writer`` writes one data file per rank of ``torch.save`` items with no
    stream transforms (``_FileSystemWriter.single_file_per_rank``, ``.transforms.extensions`` and
    ``.serialization_format`` where the version has one, torch 2.6 and later): the files :mod:`~lightning_zero.checkpoint.dcp.items`
    writes in its place."""
    from torch.distributed.checkpoint import filesystem

    transforms = getattr(writer, "transforms", None)
    torch_save = getattr(getattr(filesystem, "SerializationFormat", None), "TORCH_SAVE", None)
    return (bool(getattr(writer, "single_file_per_rank", False)) and transforms is not None
            and not tuple(getattr(transforms, "extensions", (None,)))
            and getattr(writer, "serialization_format", torch_save) == torch_save)


def dcp_data_file_name(plan: Any, index: int) -> str:
    """The name DCP's file-system writer gives a rank's ``index``-th data file: ``plan.storage_data.prefix``
    (a ``_StoragePrefix``) + index + ``filesystem.DEFAULT_SUFFIX`` (torch 2.4 to 2.15)."""
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

    return f"{plan.storage_data.prefix}{index}{DEFAULT_SUFFIX}"


def dcp_storage_info_type() -> Any:
    """DCP's record of where an item is (``filesystem._StorageInfo``, torch 2.4 to 2.15): called with
    ``(relative_path, offset, length)`` as its writer makes it for an item written without stream transforms."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo


def crc32_in_torch_save() -> bool:
    """``torch.serialization.get_crc32_options()``: whether ``torch.save`` writes a CRC32 per record
    (torch 2.6 and later)."""
    return bool(torch.serialization.get_crc32_options())






def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``: ``torch._utils._element_size`` (torch 2.13 and 2.14 tested)."""
    return int(torch._utils._element_size(dtype))






# Lightning --------------------------------------------------------------------------------------

def lightning_loader() -> Any:
    """``lightning.pytorch.core.saving.pl_load``: the module attribute ``load_from_checkpoint`` opens
    files with (Lightning's ``cloud_io._load``; Lightning 2.5 and 2.6). Its ``weights_only`` default is
    ``False`` before Lightning 2.6 and ``None`` (torch's default) from 2.6."""
    from lightning.pytorch.core import saving

    return saving.pl_load


def _takes_weights_only(function: Any) -> bool:
    return "weights_only" in inspect.signature(function).parameters


def plain_checkpoint_load(io: Any, path: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
    """``TorchCheckpointIO.load_checkpoint``: its ``weights_only`` argument exists from Lightning 2.6,
    which passes it; Lightning 2.5 neither has nor passes it. ``None`` leaves it to the loader's default."""
    if weights_only is None:
        return io.load_checkpoint(path, map_location=map_location)
    if not _takes_weights_only(io.load_checkpoint):
        raise TypeError(
            f"weights_only={weights_only} needs lightning >= 2.6 (TorchCheckpointIO.load_checkpoint takes it from"
            f" 2.6); lightning {lightning.__version__} is installed. Upgrade with: pip install 'lightning>=2.6'"
        )
    return io.load_checkpoint(path, map_location=map_location, weights_only=weights_only)


def checkpoint_connector(trainer: Any) -> Any:
    """``Trainer._checkpoint_connector``: its ``resume_start(checkpoint_path, weights_only=None)`` loads the
    resumed checkpoint, and ``_ckpt_path``/``_loaded_checkpoint`` hold what it loaded (Lightning 2.5, 2.6)."""
    return trainer._checkpoint_connector


def persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module.named_buffers()`` without the buffers registered with ``persistent=False``: the buffers
    ``module.state_dict()`` holds, by the same names. ``Module._non_persistent_buffers_set`` (torch 1.6
    on) is what ``state_dict`` itself consults; walking it avoids ``state_dict()``, which reads every
    parameter (and so waits for the step's parameter gathers)."""
    out = []
    for prefix, sub in module.named_modules(remove_duplicate=True):
        skipped = sub._non_persistent_buffers_set
        for name, buffer in sub._buffers.items():
            if buffer is not None and name not in skipped:
                out.append((f"{prefix}.{name}" if prefix else name, buffer))
    return out


def restart_training_iterator(trainer: Any) -> None:
    """``trainer.fit_loop._data_fetcher`` (Lightning 2.0 to 2.6): ``FitLoop.setup_data`` creates the training
    loaders' iterators before ``on_train_start`` (a loader with workers reads its sampler at once); iterating
    the fetcher again makes them anew, from samplers a callback has moved since (lightning_zero/data.py)."""
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None:
        iter(fetcher)


def loop_counters(trainer: Any) -> dict[str, Any]:
    """The fit loop's step counters (Lightning 2.5, 2.6): ``epoch_loop.automatic_optimization.optim_progress``
    (``trainer.global_step`` is its optimizer steps), ``epoch_loop._batches_that_stepped`` (the loggers'
    step) and ``epoch_progress`` (``current_epoch``), for a heal ([Note: healing] in engine/fault_tolerance.py)."""
    loop = trainer.fit_loop
    optim_progress = loop.epoch_loop.automatic_optimization.optim_progress.state_dict()
    for tracker in ("total", "current"):  # read inside a step: its "ready" is not a step taken
        counts = optim_progress["optimizer"]["step"][tracker]
        counts["ready"] = counts["completed"]
    return {"optim_progress": optim_progress,
            "batches_that_stepped": loop.epoch_loop._batches_that_stepped,
            "epoch_progress": loop.epoch_progress.state_dict()}


def load_loop_counters(trainer: Any, counters: dict[str, Any], in_step: bool) -> None:
    """Put :func:`loop_counters` of a live peer (read between its steps) into this trainer. ``in_step``:
    it is inside its optimizer step, which Lightning counted as ready and counts completed afterwards."""
    loop = trainer.fit_loop
    progress = loop.epoch_loop.automatic_optimization.optim_progress
    progress.load_state_dict(counters["optim_progress"])
    if in_step:
        progress.optimizer.step.increment_ready()
    loop.epoch_loop._batches_that_stepped = counters["batches_that_stepped"]
    loop.epoch_progress.load_state_dict(counters["epoch_progress"])


def checkpoint_callback_state(callback: Any) -> dict[str, Any]:
    """A ``ModelCheckpoint``'s ``state_dict()`` with the two fields it keeps outside it and decides its next save by
    (Lightning 2.4 to 2.6): ``_last_global_step_saved`` (a step saved once is not saved again) and
    ``_last_checkpoint_saved`` (the file ``save_last="link"`` links to), for a heal."""
    return {"state": callback.state_dict(), "last_global_step_saved": callback._last_global_step_saved,
            "last_checkpoint_saved": callback._last_checkpoint_saved}


def load_checkpoint_callback_state(callback: Any, saved: dict[str, Any]) -> None:
    """Put :func:`checkpoint_callback_state` of a peer's callback into ``callback``."""
    callback.load_state_dict(saved["state"])
    callback._last_global_step_saved = saved["last_global_step_saved"]
    callback._last_checkpoint_saved = saved["last_checkpoint_saved"]


def mark_last_batch(trainer: Any, last: bool) -> None:
    """Whether the training batch in hand ends the epoch: ``fit_loop.epoch_loop.batch_progress.is_last_batch``
    (Lightning 2.5, 2.6), which the loop sets from its fetcher before ``on_train_batch_start`` and reads after the
    step to end the epoch (its validation and epoch-end hooks then run)."""
    trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = last


def discard_optimizer_step(trainer: Any) -> None:
    """Inside an optimizer step that will not be applied: neither ``trainer.global_step`` (counted ready
    before the step, completed after it) nor the loggers' step (``_batches_that_stepped``, counted after
    the batch) advance for it (Lightning 2.5, 2.6)."""
    loop = trainer.fit_loop.epoch_loop
    step = loop.automatic_optimization.optim_progress.optimizer.step
    for tracker in (step.total, step.current):
        tracker.ready -= 1
        tracker.completed -= 1
    loop._batches_that_stepped -= 1


def update_dataloader(loader: Any, sampler: Any) -> Any:
    """``loader`` made again with ``sampler``, as Fabric's ``setup_dataloaders`` makes it with its
    ``DistributedSampler``: ``lightning.fabric.utilities.data._update_dataloader`` (Lightning 2.4 to 2.6), which
    keeps the arguments a ``DataLoader`` subclass was made with."""
    from lightning.fabric.utilities.data import _update_dataloader

    return _update_dataloader(loader, sampler)


def replace_inserted_sampler(trainer: Any, replace: Callable[[Any, Any], Any | None]) -> None:
    """Give this trainer's training loaders ``replace(loader, sampler)`` (unless None) in place of the sampler
    Lightning inserts. With ``use_distributed_sampler=True`` a distributed run's loader whose sampler is a
    ``RandomSampler``/``SequentialSampler`` gets a ``DistributedSampler`` of the strategy's
    ``distributed_sampler_kwargs``, built in ``trainer._data_connector._resolve_sampler(dataloader, shuffle,
    mode)`` by ``_get_distributed_sampler`` (Lightning 2.5 and 2.6) and put in by ``_update_dataloader``. Only that
    sampler is offered: a loader's own sampler (a ``DistributedSampler`` too) comes back as ``loader.sampler``,
    any other one wrapped in a ``DistributedSamplerWrapper``, and neither is replaced. The connector's
    ``_resolve_sampler`` is wrapped as an attribute of this trainer's connector (the class stays Lightning's);
    calling this again replaces the earlier wrapper."""
    connector = trainer._data_connector
    connector._resolve_sampler = _ResolveSampler(connector, replace)


class _ResolveSampler:
    """``_DataConnector._resolve_sampler`` with the inserted training sampler replaced (a class, not a closure:
    a trainer a launcher pickles carries it)."""

    def __init__(self, connector: Any, replace: Callable[[Any, Any], Any | None]) -> None:
        self.resolve = type(connector)._resolve_sampler.__get__(connector)
        self.replace = replace

    def __call__(self, dataloader: Any, shuffle: bool, mode: Any = None) -> Any:
        from lightning.pytorch.trainer.states import RunningStage
        from torch.utils.data import DistributedSampler

        sampler = self.resolve(dataloader, shuffle, mode)
        if mode == RunningStage.TRAINING and type(sampler) is DistributedSampler and sampler is not dataloader.sampler:
            return self.replace(dataloader, sampler) or sampler
        return sampler


NOT_RESUMABLE_WARNING = ("You're resuming from a checkpoint that ended before the epoch ended and your dataloader is"
                         " not resumable.")
"""The start of the warning ``_TrainingEpochLoop.reset`` gives when a fit resumes in the middle of an epoch and a
training loader is not ``_Stateful`` (has no ``state_dict``/``load_state_dict``; Lightning 2.5 and 2.6)."""


def quiet_not_resumable_warning(trainer: Any, resumed_exactly: Callable[[], bool]) -> None:
    """Leave out :data:`NOT_RESUMABLE_WARNING` when ``resumed_exactly()``: a callback has put the training loaders'
    samplers where the checkpoint left them, which Lightning's check (``isinstance(loader, _Stateful)`` for every
    loader of ``trainer.fit_loop._combined_loader``, in ``trainer.fit_loop.epoch_loop.reset()``, after
    ``on_train_start``) cannot see. ``reset`` is wrapped as an attribute of this trainer's epoch loop, the filter
    held only while it runs; calling this again replaces the earlier wrapper."""
    epoch_loop = trainer.fit_loop.epoch_loop
    epoch_loop.reset = _QuietReset(epoch_loop, resumed_exactly)


class _QuietReset:
    """``_TrainingEpochLoop.reset`` without :data:`NOT_RESUMABLE_WARNING` while ``resumed_exactly()``.
    ``warnings.catch_warnings`` swaps the process's filters, so another thread's warning in that window meets the
    same filter: it leaves out this one message only."""

    def __init__(self, epoch_loop: Any, resumed_exactly: Callable[[], bool]) -> None:
        self.reset = type(epoch_loop).reset.__get__(epoch_loop)
        self.resumed_exactly = resumed_exactly

    def __call__(self) -> None:
        if not self.resumed_exactly():
            self.reset()
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=re.escape(NOT_RESUMABLE_WARNING))
            self.reset()


# jsonargparse ------------------------------------------------------------------------------------

MIN_JSONARGPARSE = "4.41"

# `${a.b}` that names a key from the root: a letter first, then names, dots and [index]; resolvers
# (`${oc.env:BUCKET}`) have a colon and relative references (`${.x}`) a leading dot, so neither matches.
_ABSOLUTE_INTERPOLATION = re.compile(r"\$\{([A-Za-z][A-Za-z0-9_.\[\]]*)\}")


def relative_interpolations(node: Any, path: tuple[str | int, ...] = ()) -> Any:
    """A copy of a loaded YAML document whose absolute ``${a.b}`` are rewritten to climb from where they
    stand to the document's root (``${....a.b}`` four keys down): OmegaConf reads a relative reference
    from the node it sits in, so the file means the same wherever the parser mounts it (``fit.`` under
    LightningCLI's subcommands)."""
    if isinstance(node, dict):
        return {key: relative_interpolations(value, (*path, key)) for key, value in node.items()}
    if isinstance(node, list):
        return [relative_interpolations(value, (*path, index)) for index, value in enumerate(node)]
    if isinstance(node, str):
        # `${.x}` is a key of the node holding the value, each further dot one node up: the value at
        # depth len(path) reaches the root with len(path) dots.
        return _ABSOLUTE_INTERPOLATION.sub(lambda match: "${" + "." * len(path) + match.group(1) + "}", node)
    return node


def omegaconf_plus_reads_from_the_file_root() -> None:
    """Make jsonargparse's ``"omegaconf+"`` parser mode read a config file's ``${trainer.x}`` from that
    file's root. The mode (jsonargparse 4.41 and later) resolves interpolations once the command line is
    applied, from the root parser, where LightningCLI's keys are ``fit.trainer.x``. jsonargparse 4.42 and
    later rewrite them with ``set_parsing_settings(omegaconf_absolute_to_relative_paths=True)``; 4.41
    (the newest litgpt 0.5.13 admits) lacks the setting, so the same rewrite is registered here as the
    mode's loader (``set_loader``, public since jsonargparse 4.0), before the parser registers its own
    (4.41's ``set_omegaconf_loader`` keeps a loader already set)."""
    import jsonargparse

    if "omegaconf_absolute_to_relative_paths" in inspect.signature(jsonargparse.set_parsing_settings).parameters:
        jsonargparse.set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
        return
    import yaml

    yaml_load = jsonargparse.get_loader("yaml")

    def load(value: str) -> Any:
        loaded = yaml_load(value)
        return relative_interpolations(loaded) if isinstance(loaded, dict) else loaded

    jsonargparse.set_loader("omegaconf+", load, (yaml.YAMLError,))
