"""Checkpoint cases: train a ZeroEngine in a gloo group, save, load into a fresh one, compare; and
the Lightning runs (``make_trainer``, ``fit``) that the Trainer-level checkpoint tests share.

Functions here run inside ``run_distributed`` workers and Trainer ranks, so they live in an
importable module. The reference state is rebuilt from every rank's shards with plain
``all_gather_object`` and the even-split offsets, not through the checkpoint code under test.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from engine_cases import Net, global_batch, initial_model, make_optimizer
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_cases import NetModule, loader
from torch import Tensor, nn

from lightning_zero import ZeroConfig, ZeroEngine, ZeroLowLevelStrategy
from lightning_zero.checkpoint import FlatShard, ZeroCheckpointIO, async_save, engine_tree, load, save

MODES = ("local", "sharded", "full")
SAVED_AT_STEP = 2
TOTAL_STEPS = 4


def small_tree(value: float) -> dict[str, Any]:
    """A one-rank tree small enough to save in this process: a flat shard, a whole tensor, plain values."""
    return {
        "model": {"w": FlatShard(torch.full((10,), value), (10,), 0, 1), "b": torch.full((3,), value)},
        "meta": {"step": 7, "betas": [0.9, 0.99]},
    }


def small_tree_values(tree: dict[str, Any]) -> tuple[float, float]:
    """The one value each tensor of a :func:`small_tree` holds (``unique`` fails on a mix)."""
    return tree["model"]["w"].local.unique().item(), tree["model"]["b"].unique().item()


def build(rank: int, world_size: int, model: nn.Module | None = None, perturb: float = 0.0,
          shard_group_size: int | None = None) -> tuple[nn.Module, ZeroEngine]:
    """A ZeRO-2 engine over ``model`` (the engine cases' Net by default) with AdamW in two groups.

    ``perturb`` shifts every weight, so a load has to overwrite all of them to pass.
    """
    model = model if model is not None else initial_model()
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(perturb)
    engine = ZeroEngine(model, [make_optimizer("adamw", model)],
                        ZeroConfig(stage=2, bucket_size_mb=0.0005, shard_group_size=shard_group_size))
    return model, engine


def train(model: nn.Module, engine: ZeroEngine, steps: Iterable[int], rank: int, world_size: int) -> None:
    opt = engine.optimizers[0]
    for step in steps:
        opt.zero_grad()
        x, y = global_batch(step, 0, world_size)
        F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
        engine.ensure_flushed()
        opt.step()


def params(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def gather_full_state(engine: ZeroEngine) -> dict[str, Any]:
    """(collective) Master weights and optimizer state of every parameter as full tensors.

    ``{"master": {fqn: tensor}, "state": {fqn: {key: tensor}}, "lr": [...]}``; scalar state
    (Adam's ``step``) is checked to be the same on every rank.
    """
    opt = engine.optimizers[0]
    mine = {}
    for sp in engine.sharded_params.values():
        entry = {"master": sp.master.detach().clone()}
        entry.update({k: v.detach().clone() for k, v in opt.state.get(sp.master, {}).items()})
        mine[sp.fqn] = (sp.layout.start(sp.rank), tuple(sp.param.shape), entry)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    full: dict[str, Any] = {"master": {}, "state": {}, "lr": [g["lr"] for g in opt.param_groups]}
    for fqn, (_, shape, _) in mine.items():
        numel = torch.Size(shape).numel()
        keys = {k for rank_state in everyone for k in rank_state[fqn][2]}
        values: dict[str, Tensor] = {}
        for key in sorted(keys):
            pieces = [(start, entry[key]) for start, _, entry in (r[fqn] for r in everyone) if key in entry]
            if pieces[0][1].dim() == 0:  # per-parameter scalar (step): replicated, not sharded
                assert all(torch.equal(t, pieces[0][1]) for _, t in pieces), f"{fqn}/{key} differs between ranks"
                values[key] = pieces[0][1]
                continue
            flat = torch.full((numel,), float("nan"))
            for start, piece in pieces:
                flat[start:start + piece.numel()] = piece
            assert not flat.isnan().any(), f"{fqn}/{key}: the shards do not cover the tensor"
            values[key] = flat.reshape(shape)
        full["master"][fqn] = values.pop("master")
        if values:
            full["state"][fqn] = values
    return full


def load_into(engine: ZeroEngine, model: nn.Module, path: str, state_names: Iterable[str],
              storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load a checkpoint of any mode into a fresh engine the way the strategy does: create the
    optimizer state for the parameters that had some, fill the tree, restore the hyper-parameters,
    gather the masters into the model."""
    opt = engine.optimizers[0]
    engine_tree.materialize_optimizer_state(opt, set(state_names))
    tree = engine_tree.zero_state_dict(engine, model, for_load=True)
    content = load(tree, path, storage_options=storage_options)
    engine_tree.apply_param_groups(opt, content["optimizer"][0]["param_groups"])
    engine.publish_masters()
    return content


def round_trip(rank: int, world_size: int, root: str, modes: tuple[str, ...] = MODES,
               storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train, save at step 2 in every mode, go on to step 4 (the uninterrupted run); then for each
    mode load into a fresh engine (other weights, other lr), and train steps 2..4 again."""
    model, engine = build(rank, world_size)
    train(model, engine, range(SAVED_AT_STEP), rank, world_size)
    saved = gather_full_state(engine)
    for mode in modes:
        save(engine_tree.zero_state_dict(engine, model), f"{root}/{mode}.ckpt", mode=mode,
             storage_options=storage_options)
    train(model, engine, range(SAVED_AT_STEP, TOTAL_STEPS), rank, world_size)
    out: dict[str, Any] = {"saved": saved, "uninterrupted": params(model)}
    engine.close()
    for mode in modes:
        fresh_model, fresh = build(rank, world_size, perturb=1.0)
        for group in fresh.optimizers[0].param_groups:
            group["lr"] = 0.5
        load_into(fresh, fresh_model, f"{root}/{mode}.ckpt", saved["state"], storage_options)
        loaded = gather_full_state(fresh)
        loaded_params = params(fresh_model)
        train(fresh_model, fresh, range(SAVED_AT_STEP, TOTAL_STEPS), rank, world_size)
        out[mode] = {"loaded": loaded, "loaded_params": loaded_params, "resumed": params(fresh_model)}
        fresh.close()
    return out


def save_and_gather(rank: int, world_size: int, root: str, modes: tuple[str, ...] = ("sharded", "full"),
                    steps: int = 3, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train ``steps`` steps at this world size, save ``<root>/<mode>.ckpt`` in each mode, and
    return the full state that was saved."""
    model, engine = build(rank, world_size)
    train(model, engine, range(steps), rank, world_size)
    for mode in modes:
        save(engine_tree.zero_state_dict(engine, model), f"{root}/{mode}.ckpt", mode=mode,
             storage_options=storage_options)
    full = gather_full_state(engine)
    engine.close()
    return full


def load_and_gather(rank: int, world_size: int, paths: list[str], state_names: list[str],
                    extra_steps: int = 2, shard_group_size: int | None = None) -> dict[str, dict[str, Any]]:
    """For each path: load at this world size (and ``shard_group_size``) into a fresh engine; the
    full state it then holds, its model weights, and the weights after ``extra_steps`` more steps,
    or, when the load refuses the layout, ``{"error": <its text>}``."""
    out: dict[str, dict[str, Any]] = {}
    for path in paths:
        model, engine = build(rank, world_size, perturb=1.0, shard_group_size=shard_group_size)
        try:
            load_into(engine, model, path, state_names)
        except ValueError as exc:
            out[path] = {"error": str(exc)}
            engine.close()
            continue
        result = {"loaded": gather_full_state(engine), "params": params(model),
                  "shard_numel": engine.optimizer_shard_numel}
        train(model, engine, range(100, 100 + extra_steps), rank, world_size)
        result["after_steps"] = params(model)
        engine.close()
        out[path] = result
    return out


class Collectives:
    """Counts torch.distributed collectives per thread kind while installed.

    Patches the public names in ``torch.distributed`` and in ``distributed_c10d`` (which
    DCP and DeviceMesh call directly), so a collective cannot slip past through either.
    """

    NAMES = (
        "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
        "all_gather_object", "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor",
        "reduce_scatter_single", "reduce", "gather", "gather_object", "scatter", "scatter_object_list",
        "broadcast_object_list", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
        "new_group", "new_subgroups", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    )

    def __init__(self) -> None:
        self.main: list[str] = []
        self.background: list[str] = []
        self._originals: list[tuple[Any, str, Callable[..., Any]]] = []

    @contextmanager
    def counting(self) -> Iterator[Collectives]:
        from torch.distributed import distributed_c10d

        for namespace in (dist, distributed_c10d):
            for name in self.NAMES:
                original = getattr(namespace, name, None)
                if original is not None:
                    self._originals.append((namespace, name, original))
                    setattr(namespace, name, self._wrap(name, original))
        try:
            yield self
        finally:
            for namespace, name, original in reversed(self._originals):
                setattr(namespace, name, original)
            self._originals.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            main = threading.current_thread() is threading.main_thread()
            (self.main if main else self.background).append(name)
            return original(*args, **kwargs)

        return counted


class OtherNet(Net):
    """The engine cases' Net with one extra layer and one renamed: another model's checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(3, 3)
        self.tail = self.head
        del self.head

    def forward(self, x: Tensor) -> Tensor:  # never trained here
        raise NotImplementedError


def assert_same_state(actual: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    """Bit-identical master weights, optimizer state and learning rates (as gather_full_state builds them)."""
    assert actual["master"].keys() == expected["master"].keys(), where
    for fqn, value in expected["master"].items():
        assert torch.equal(actual["master"][fqn], value), f"{where}: master weight {fqn}"
    assert actual["state"].keys() == expected["state"].keys(), f"{where}: parameters with optimizer state"
    for fqn, entry in expected["state"].items():
        assert actual["state"][fqn].keys() == entry.keys(), f"{where}: state keys of {fqn}"
        for key, value in entry.items():
            assert torch.equal(actual["state"][fqn][key], value), f"{where}: {fqn}/{key}"
    assert actual["lr"] == expected["lr"], f"{where}: learning rates"


def local_save_collectives(rank: int, world_size: int, root: str) -> dict[str, list[str]]:
    """Collectives made while a ``local`` save runs, per thread kind.

    The first save of a process creates the gloo coordination group (``new_group`` is a
    collective, on the training thread, once): it is made before counting starts. Counted: the
    tree, ``async_save``, ``wait_for_staging`` and the blocking finalize.
    """
    from lightning_zero.checkpoint import async_save, maybe_finalize_async_calls, wait_for_staging

    model, engine = build(rank, world_size)
    train(model, engine, range(1), rank, world_size)
    save(engine_tree.zero_state_dict(engine, model), f"{root}/warm-up.ckpt", mode="local")
    counter = Collectives()
    with counter.counting():
        async_save(engine_tree.zero_state_dict(engine, model), f"{root}/counted.ckpt", mode="local")
        wait_for_staging()
        maybe_finalize_async_calls(blocking=True)
    engine.close()
    return {"main": counter.main, "background": counter.background}


# ---- Lightning runs -------------------------------------------------------------------------


def make_trainer(mode: str, dirpath: str | Path, max_epochs: int, *, start_method: str = "forkserver",
                 strategy: Any = None, storage_options: dict[str, Any] | None = None,
                 checkpointing: bool = True, callbacks: list[Any] | None = None, async_save: bool = True) -> Trainer:
    """2 CPU ranks of ZeRO-2 over ``loader(2, 1, 2)`` (2 steps an epoch), checkpointing every epoch
    and ``last`` to ``dirpath`` through ``ZeroCheckpointIO(mode)``; ``callbacks`` in place of that
    ModelCheckpoint."""
    return Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy or ZeroLowLevelStrategy(stage=2, start_method=start_method),  # type: ignore[arg-type]
        plugins=[ZeroCheckpointIO(mode=mode, storage_options=storage_options,  # type: ignore[arg-type]
                                  async_save=async_save)],
        callbacks=(callbacks if callbacks is not None
                   else [ModelCheckpoint(dirpath=str(dirpath), save_last=True)] if checkpointing else []),
        enable_checkpointing=checkpointing,
        max_epochs=max_epochs,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(dirpath) if "://" not in str(dirpath) else None,
    )


def fit(trainer: Trainer, ckpt_path: str | None = None, perturb: bool = False,
        world_size: int = 2) -> dict[str, Tensor]:
    """Fit a fresh NetModule (AdamW, StepLR every step) on ``world_size`` ranks; rank 0's weights afterwards.

    ``perturb`` shifts the fresh module's weights: a resumed run then matches the uninterrupted
    one only if the checkpoint was really loaded (Lightning merely warns when ``"last"`` finds
    nothing, and a 2-epoch run from scratch equals the uninterrupted run).
    """
    module = NetModule(scheduler=True)
    if perturb:
        with torch.no_grad():
            for p in module.parameters():
                p.add_(1.0)
    trainer.fit(module, loader(2, 1, world_size), ckpt_path=ckpt_path)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same_weights(actual: dict[str, Tensor], expected: dict[str, Tensor], where: str) -> None:
    assert actual.keys() == expected.keys(), where
    for name, value in expected.items():
        assert torch.equal(actual[name], value), f"{where}: {name} differs by {(actual[name] - value).abs().max()}"


class CountingStrategy(ZeroLowLevelStrategy):
    """Records, per rank and save, the collectives that ``save_checkpoint`` makes on the training
    thread, in ``<count_dir>/rank<r>.jsonl``. Lightning's own barrier in ``Trainer.save_checkpoint``
    is outside: the contract is about our save path."""

    def __init__(self, count_dir: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.count_dir = count_dir

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        counter = Collectives()
        with counter.counting():
            super().save_checkpoint(checkpoint, filepath, storage_options)
        with open(f"{self.count_dir}/rank{self.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"path": str(filepath), "main": counter.main}) + "\n")


def save_with_failing_rank(rank: int, world_size: int, root: str, failing_rank: int) -> dict[str, Any]:
    """Save ``last.ckpt`` (local mode), then save it again while ``failing_rank``'s disk is full.
    What each rank's finalize raised, and what ``last.ckpt`` holds afterwards."""
    import errno

    from lightning_zero.checkpoint import async_save, maybe_finalize_async_calls
    from lightning_zero.checkpoint.store import file_io

    path = f"{root}/last.ckpt"
    model, engine = build(rank, world_size)
    save(engine_tree.zero_state_dict(engine, model), path, mode="local")
    saved = gather_full_state(engine)
    train(model, engine, range(1), rank, world_size)
    real_write = file_io.write_file

    def full_disk(loc: Any, target: str, obj: Any, *args: Any) -> None:
        if rank == failing_rank:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(loc, target, obj, *args)

    file_io.write_file = full_disk
    try:
        async_save(engine_tree.zero_state_dict(engine, model), path, mode="local")
        error = None
        try:
            maybe_finalize_async_calls(blocking=True)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            error = f"{type(exc).__name__}: {exc}"
    finally:
        file_io.write_file = real_write
    fresh_model, fresh = build(rank, world_size, perturb=1.0)
    load_into(fresh, fresh_model, path, saved["state"])
    return {"error": error, "saved": saved, "loaded": gather_full_state(fresh)}


def repeated_sharded_saves(rank: int, world_size: int, root: str) -> tuple[int, bool]:
    """Two ``sharded`` saves of one tree structure, then both loaded back: (global plans the
    coordinator computed, whether both loads equal what was saved). [Note: cached save plans]"""
    from lightning_zero.checkpoint.dcp import adapter as dcp_adapter
    from lightning_zero.checkpoint.formats.tree import FlatShard
    from lightning_zero.engine.sharding import EvenShard

    planned = []
    original = dcp_adapter.FlatChunkSavePlanner._create_global_plan

    def counted(self: Any, all_plans: list[Any]) -> Any:
        planned.append(len(all_plans))
        return original(self, all_plans)

    dcp_adapter.FlatChunkSavePlanner._create_global_plan = counted  # type: ignore[method-assign]
    layout = EvenShard(10, world_size)

    def tree(value: float) -> dict[str, Any]:
        full = torch.arange(10, dtype=torch.float32) * value
        return {"w": FlatShard(full[layout.local_slice(rank)].clone(), (2, 5), rank, world_size),
                "b": torch.full((3,), value)}

    try:
        for name, value in (("a", 1.0), ("b", 2.0)):
            save(tree(value), f"{root}/{name}", mode="sharded")
        same = True
        for name, value in (("a", 1.0), ("b", 2.0)):
            target = tree(0.0)
            load(target, f"{root}/{name}")
            expected = tree(value)
            same &= torch.equal(target["w"].local, expected["w"].local) and torch.equal(target["b"], expected["b"])
    finally:
        dcp_adapter.FlatChunkSavePlanner._create_global_plan = original  # type: ignore[method-assign]
    return len(planned), same


def asymmetric_tree_saves(rank: int, world_size: int, root: str) -> list[str]:
    """Functional-API saves whose trees differ by rank (a tensor of its own on each rank); between the
    two saves only rank 1's own tensor changes dtype. Returns the dtypes ``.metadata`` records for
    ``own1`` in each save. [Note: cached save plans]"""
    import torch.distributed.checkpoint as dcp

    from lightning_zero.checkpoint.formats.tree import FlatShard
    from lightning_zero.engine.sharding import EvenShard

    layout = EvenShard(10, world_size)
    dtypes = []
    for name, own_dtype in (("a", torch.float32), ("b", torch.bfloat16)):
        state = {"w": FlatShard(torch.arange(10.0)[layout.local_slice(rank)].clone(), (10,), rank, world_size),
                 f"own{rank}": torch.ones(3, dtype=own_dtype if rank == 1 else torch.float32)}
        save(state, f"{root}/{name}", mode="sharded")
        dist.barrier()
        (metadata_dir,) = [p.parent for p in Path(root).glob(f"_zero_data/{name}/*/.metadata")]
        dtypes.append(str(dcp.FileSystemReader(str(metadata_dir)).read_metadata().state_dict_metadata["own1"]
                          .properties.dtype))
    return dtypes


@contextmanager
def metadata_opens(fail: bool = False) -> Iterator[list[str]]:
    """The DCP ``.metadata`` files this process opens for reading (local file systems) while inside;
    with ``fail``, each such open fails like an unreadable file."""
    import errno

    from torch.distributed.checkpoint.filesystem import FileSystem

    opened: list[str] = []
    original = FileSystem.create_stream

    @contextmanager
    def counted(self: Any, path: Any, mode: str) -> Iterator[Any]:
        if str(path).endswith(".metadata") and "r" in mode:
            opened.append(str(path))
            if fail:
                raise OSError(errno.EIO, "Input/output error", str(path))
        with original(self, path, mode) as stream:
            yield stream

    FileSystem.create_stream = counted  # type: ignore[method-assign]
    try:
        yield opened
    finally:
        FileSystem.create_stream = original  # type: ignore[method-assign]


def metadata_reads(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """A ``sharded`` checkpoint loaded through ``load`` and through the Trainer's resume
    (``load_zero_state_dict``), counting this rank's opens of ``.metadata`` for reading in each; then
    a load after rank 0 removed ``.metadata``. [Note: shared metadata]"""
    from lightning_zero.checkpoint import load_zero_state_dict
    from lightning_zero.checkpoint.store import writeback

    model, engine = build(rank, world_size)
    train(model, engine, range(SAVED_AT_STEP), rank, world_size)
    path = f"{root}/sharded.ckpt"
    save(engine_tree.zero_state_dict(engine, model), path, mode="sharded")
    saved = gather_full_state(engine)
    engine.close()
    out: dict[str, Any] = {"saved": saved}
    with metadata_opens() as opened:
        for kind in ("load", "resume"):
            fresh_model, fresh = build(rank, world_size, perturb=1.0)
            opened.clear()
            if kind == "load":
                load_into(fresh, fresh_model, path, saved["state"])
            else:
                load_zero_state_dict(fresh, fresh_model, path)
            out[kind] = {"reads": len(opened), "loaded": gather_full_state(fresh)}
            fresh.close()
    # A save still in flight when a load starts: the load finalizes it first (its background
    # collectives share the coordination group with the load's broadcast).

    model, engine = build(rank, world_size)
    train(model, engine, range(SAVED_AT_STEP + 1), rank, world_size)
    original = writeback.WritebackFileSystem.create_stream

    @contextmanager
    def slowly(self: Any, path: Any, mode: str) -> Iterator[Any]:
        # Rank 0 is still writing when the load starts while rank 1 already waits in the save's
        # gather of results: the two ranks would meet the group's collectives in different orders.
        if rank == 0:
            time.sleep(0.5)
        with original(self, path, mode) as stream:
            yield stream

    writeback.WritebackFileSystem.create_stream = slowly  # type: ignore[method-assign]
    try:
        async_save(engine_tree.zero_state_dict(engine, model), f"{root}/in-flight.ckpt", mode="sharded")
        in_flight = gather_full_state(engine)
        engine.close()
        fresh_model, fresh = build(rank, world_size, perturb=1.0)
        load_zero_state_dict(fresh, fresh_model, path)
    finally:
        writeback.WritebackFileSystem.create_stream = original  # type: ignore[method-assign]
    out["in_flight"] = {"loaded": gather_full_state(fresh), "saved": in_flight}
    fresh.close()
    fresh_model, fresh = build(rank, world_size, perturb=1.0)
    load_zero_state_dict(fresh, fresh_model, f"{root}/in-flight.ckpt")
    out["in_flight"]["loaded_later"] = gather_full_state(fresh)
    fresh.close()
    # Only one rank cannot read .metadata: the coordinator (every rank fails with its error), or
    # another rank (it never reads it: the load succeeds).
    for failing in (0, 1):
        with metadata_opens(fail=rank == failing) as opened:
            out[f"unreadable_on_{failing}"] = resume_outcome(rank, world_size, path)
        out[f"unreadable_on_{failing}"]["opens"] = len(opened)
    dist.barrier()
    if rank == 0:
        (metadata,) = Path(root).glob("_zero_data/sharded.ckpt/*/.metadata")
        metadata.unlink()
    dist.barrier()
    out["missing"] = resume_outcome(rank, world_size, path)
    return out


def resume_outcome(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """A fresh engine resumed from ``path`` (``load_zero_state_dict``): the error (its text and notes)
    or the state loaded, and whether a failed load left the model's weights untouched."""
    from lightning_zero.checkpoint import load_zero_state_dict

    model, engine = build(rank, world_size, perturb=1.0)
    before = params(model)
    try:
        load_zero_state_dict(engine, model, path)
    except Exception as exc:  # noqa: BLE001 - the error under test
        outcome: dict[str, Any] = {"error": f"{type(exc).__name__}: {exc}", "notes": getattr(exc, "__notes__", [])}
    else:
        outcome = {"error": None, "loaded": gather_full_state(engine)}
    outcome["untouched"] = all(torch.equal(before[n], p) for n, p in params(model).items())
    engine.close()
    return outcome


def load_with_options(rank: int, world_size: int, path: str, state_names: list[str],
                      storage_options: dict[str, Any]) -> dict[str, Any]:
    """Load ``path`` into a fresh engine through ``storage_options``; the full state it then holds."""
    model, engine = build(rank, world_size, perturb=1.0)
    load_into(engine, model, path, state_names, storage_options)
    loaded = gather_full_state(engine)
    engine.close()
    return loaded
