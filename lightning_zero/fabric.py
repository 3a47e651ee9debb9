"""ZeroLowLevelStrategy for Lightning Fabric: the same engine and checkpoints as the Trainer's strategy.

``Fabric(strategy="zero2")`` (or ``"zero1"``, or an instance of :class:`ZeroLowLevelStrategy` with options)
shards a Fabric loop's optimizer state, and with stage 2 its gradients, exactly as the Trainer's
:class:`lightning_zero.ZeroLowLevelStrategy` does: the glue here builds a
:class:`~lightning_zero.engine.ZeroEngine` per module in ``fabric.setup`` and routes Fabric's verbs to it
(``backward``, ``clip_gradients``, ``no_backward_sync``, the optimizer step and its loss scaler).
``fabric.save``/``fabric.load`` go through the public functions of :mod:`lightning_zero.checkpoint`, in
the checkpoint plugin's mode (``Fabric(plugins=[ZeroCheckpointIO(mode=..., async_save=...)])``).

The strategy holds no sharding math and no checkpoint format of its own: a save writes
:func:`~lightning_zero.checkpoint.lightning.fabric_tree.fabric_tree` ([Note: Fabric's layout] there: in ``full``
mode the one file Fabric's DDP writes, ``torch.load(path)["model"]`` the module's ``state_dict``; in
``local``/``sharded`` mode the engine's tree), and a load is
:func:`~lightning_zero.checkpoint.load_zero_state_dict`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import lightning
import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import MixedPrecision
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_zero._compat import StrategyRegistry as _StrategyRegistry
from lightning_zero.checkpoint import (
    ZeroCheckpointIO,
    async_save,
    load_weights,
    load_zero_state_dict,
    read_lightning_checkpoint,
    save,
    wait_for_staging,
    zero_state_dict,
)
from lightning_zero.checkpoint.lightning.entry import (
    fabric_tree,
    link_of,
    plain_fabric_tree,
    to_fabric_layout,
)
from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine import collectives as comm
from lightning_zero.engine.fault_tolerance import (
    FaultTolerance,
    ReplicaGroups,
    engine_state,
    load_engine_state,
)
from lightning_zero.engine.optimizer import ZeroOptimizer
from lightning_zero.fabric_fault_tolerance import FabricDataPosition

VERSION_KEY = "pytorch-lightning_version"
"""Stamped into every save, as Lightning stamps its checkpoints: the Trainer reads a checkpoint only with it."""
_LIGHTNING_OWN = ("state_dict", "optimizer_states", "lightning_zero_masters", "lightning_zero_meta", VERSION_KEY)
"""Keys of a loaded checkpoint that are the module's and the optimizers' (filled in place), never remainder."""


class ZeroLowLevelStrategy(DDPStrategy):
    """ZeRO stage 1 or 2 for Lightning Fabric, with evenly sharded optimizer state.

    Args:
        stage, bucket_size_mb, overlap_communication, overlap_param_gather, reduce_dtype, shard_group_size,
        whole_step_group_mb, full_gradients, release_grad_shards: as in :class:`lightning_zero.ZeroLowLevelStrategy`
            (:class:`~lightning_zero.engine.ZeroConfig`).
        broadcast_buffers: broadcast rank 0's buffers (BatchNorm statistics) before a forward with gradients,
            once per accumulation window, as DDP does by default; never in a forward without gradients, and
            whatever the module's ``training`` flag ([Note: no collective on rank-local state]); checkpoints
            always hold rank 0's.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision, process_group_backend,
        timeout, start_method: as in Fabric's ``DDPStrategy``. ``checkpoint_io`` (or
        ``Fabric(plugins=[ZeroCheckpointIO(...)])``) chooses the mode of ``fabric.save`` (``local``,
        ``sharded``, ``full``), whether it returns before the write (``async_save``) and the fsspec
        ``storage_options``; the default is ``ZeroCheckpointIO(mode="full")`` (asynchronous): with the one-line
        change from ``"ddp"`` or litgpt's FSDP (``state_dict_type="full"``) to ``"zero2"``, ``fabric.save`` writes
        the one file those write, which ``torch.load(path)["model"]`` and tools such as litgpt's read; pass
        ``ZeroCheckpointIO(mode="sharded")`` for saves that every rank writes in parallel and any world size
        reshards.
        fault_tolerance: a :class:`~lightning_zero.FaultTolerance`: this job is one replica group of a
            fault-tolerant job; ``optimizer.step()`` applies only committed steps, and
            ``fabric.strategy.fault_tolerance.steps`` counts the job's committed steps (stop the loop by it). A
            group behind the others heals in ``fabric.setup``. ``fabric.setup_dataloaders`` gives a loader whose
            sampler is a ``DistributedSampler`` an ``EpochReplicaGroupSampler`` ([Note: Fabric's epoch] in
            fabric_fault_tolerance.py).

    A save still in flight is finished by the next ``fabric.save``, by ``fabric.load`` and by
    :meth:`teardown`, which also ends the saver's thread and coordination group (Fabric does not call it:
    call ``fabric.strategy.teardown()`` at the end of the loop).
    """

    strategy_name = "zero_low_level"

    def __init__(
        self,
        stage: Literal[1, 2] = 2,
        bucket_size_mb: float | None = None,
        overlap_communication: bool = True,
        overlap_param_gather: bool = True,
        reduce_dtype: torch.dtype | str | None = None,
        shard_group_size: int | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        broadcast_buffers: bool = True,
        whole_step_group_mb: float | None = 1024.0,
        full_gradients: bool = False,
        release_grad_shards: bool = True,
        fault_tolerance: FaultTolerance | None = None,
    ) -> None:
        # Validated before anything else so a bad option fails at construction, on every rank.
        self.zero_config = ZeroConfig(stage, bucket_size_mb, overlap_communication, overlap_param_gather, reduce_dtype,
                                      shard_group_size, whole_step_group_mb=whole_step_group_mb,
                                      full_gradients=full_gradients, release_grad_shards=release_grad_shards)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.broadcast_buffers = broadcast_buffers
        self._engines: dict[nn.Module, ZeroEngine] = {}
        """The module each engine trains (the module ``fabric.setup`` returned, unwrapped) -> its engine."""
        self._set_up_modules: list[nn.Module] = []
        """Modules set up without optimizers (``setup_module``), waiting for ``setup_optimizers``."""
        self._meta: dict[nn.Module, dict[str, Any]] = {}
        self._hooks: list[Any] = []
        self._skipping_sync = False  # inside ``fabric.no_backward_sync(model)``
        if fault_tolerance is not None and not isinstance(fault_tolerance, FaultTolerance):
            raise TypeError(f"fault_tolerance must be a lightning_zero.FaultTolerance, got {type(fault_tolerance).__name__}.")
        self._fault_tolerance = fault_tolerance
        self._replica_groups: ReplicaGroups | None = None
        self._data_position = FabricDataPosition() if fault_tolerance is not None else None
        self._backward_sync_control = _ZeroBackwardSyncControl(self)

    @property
    def stage(self) -> int:
        return self.zero_config.stage

    @property
    def engines(self) -> list[ZeroEngine]:
        """One engine per module set up with optimizers, in setup order."""
        return list(self._engines.values())

    @property
    def optimizer_shard_numel(self) -> int:
        """Real parameter elements whose fp32 master copy and optimizer state this rank holds, summed over
        every module's optimizers (how the balance is seen)."""
        return sum(engine.optimizer_shard_numel for engine in self._engines.values())

    # ---- setup -----------------------------------------------------------------------------

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], *scheduler: Any
    ) -> tuple[Any, ...]:
        """(every rank) Build the engine for ``module`` and its optimizers: every parameter they hold is
        sharded; the optimizers returned are the engine's (the user's optimizer stepping the fp32 master
        shards; a scheduler made on the user's optimizer keeps working). The module is not wrapped.

        Lightning 2.6's Fabric passes the scheduler and takes three values back; 2.5's passes none and takes
        two: what was passed comes back, so one signature serves both."""
        self._check_new(module)
        return module, list(self._build_engine(module, optimizers).optimizers), *scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """(every rank) Rank 0's weights and buffers on every rank, as DDP's wrapper does; the engine is built
        by ``fabric.setup_optimizers`` (or never, for inference)."""
        self._check_new(module)
        _broadcast_state(module)
        self._set_up_modules.append(module)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """(every rank) The engine for the module ``setup_module`` set up whose parameters ``optimizer`` holds.

        A module's optimizers are sharded together, so they are set up in one call:
        ``fabric.setup(model, opt_a, opt_b)``."""
        held = {p for group in optimizer.param_groups for p in group["params"]}
        owners = [m for m in self._set_up_modules if any(p in held for p in m.parameters())]
        if not owners:
            trained = [m for m in self._engines if any(p in held for p in m.parameters())]
            if trained:
                raise RuntimeError(
                    "ZeroLowLevelStrategy shards all optimizers of a module together, and this module's engine was"
                    " already built by an earlier `setup_optimizers` call. Set up every optimizer of a module in one"
                    " call: `fabric.setup(model, opt_a, opt_b)` (or `fabric.setup_module(model)` then"
                    " `fabric.setup_optimizers(opt_a)` with a single optimizer)."
                )
            raise RuntimeError("The optimizer holds no parameter of a module set up with `fabric.setup_module(model)`:"
                               " set up the module first, then create its optimizer and set it up.")
        if len(owners) > 1:
            raise RuntimeError("The optimizer holds parameters of several modules set up with `fabric.setup_module`;"
                               " ZeroLowLevelStrategy shards one module per engine: use one optimizer per module.")
        module = owners[0]
        self._set_up_modules.remove(module)
        return self._build_engine(module, [optimizer]).optimizers[0]

    def _check_new(self, module: nn.Module) -> None:
        if module in self._engines or module in self._set_up_modules:
            raise ValueError("This module was already set up by ZeroLowLevelStrategy; set up each module once.")

    def _build_engine(self, module: nn.Module, optimizers: list[Optimizer]) -> ZeroEngine:
        if not optimizers:
            raise ValueError("ZeroLowLevelStrategy needs at least one optimizer to shard: `fabric.setup(model, optimizer)`.")
        groups = self._join_replica_groups()
        # broadcasts rank 0's weights and buffers
        engine = ZeroEngine(module, optimizers, self.zero_config, replica_groups=groups)
        self._engines[module] = engine
        io = self.checkpoint_io
        if isinstance(io, ZeroCheckpointIO) and len(self._engines) == 1:
            # The first engine since teardown: the group background saves coordinate over, made now on every
            # rank, so that no save makes a collective on the training thread for it.
            link_of(io).set_up(self.num_processes)
        # Once, now that dtypes are final and no gather is in flight (a save would otherwise wait for the
        # step's overlapped gathers: zero_state_dict's ``meta`` argument).
        self._meta[module] = zero_state_dict(engine, module)["meta"]
        for optimizer in engine.optimizers:
            # The only mutation of checkpointed tensors: an asynchronous save still copying them finishes first.
            optimizer.register_pre_update_hook(wait_for_staging)
        if groups is not None:
            groups.register_state("engine", lambda: engine_state(engine), lambda state: load_engine_state(engine, state))
            assert self._data_position is not None
            self._data_position.serve(groups)
            for optimizer in engine.optimizers:
                optimizer.register_pre_update_hook(functools.partial(groups.decide, optimizer))
            groups.join()  # a group behind the others heals now, before its first forward
        self._route_loss_scaler(engine)
        if self.broadcast_buffers and any(True for _ in module.buffers()):
            broadcast = _BufferBroadcast(self, engine)
            self._hooks += [module.register_forward_pre_hook(broadcast.before_forward),
                            module.register_forward_hook(broadcast.after_forward)]
        return engine

    @property
    def fault_tolerance(self) -> FaultTolerance | None:
        """The fault tolerance settings, with what the last ``optimizer.step()`` did (``committed``, ...)."""
        return self._fault_tolerance

    @override
    def process_dataloader(self, dataloader: DataLoader) -> DataLoader:
        """With fault tolerance, a ``DistributedSampler`` becomes an ``EpochReplicaGroupSampler`` of its settings: every
        sample of an epoch once across the replica groups, however they come and go."""
        return dataloader if self._data_position is None else self._data_position.adopt(dataloader)

    def _join_replica_groups(self) -> ReplicaGroups | None:
        if self._fault_tolerance is None:
            return None
        if self._replica_groups is not None:
            raise ValueError("Fault tolerance commits one optimizer step at a time: set up one module with its"
                             " optimizer under it.")
        self._replica_groups = ReplicaGroups(self._fault_tolerance, self.global_rank, self.world_size, self.root_device)
        return self._replica_groups

    def _route_loss_scaler(self, engine: ZeroEngine) -> None:
        """fp16 (``16-mixed``): the precision plugin's scaler unscales the master shards and all-reduces its
        inf/NaN flag, so every rank skips an overflowing step together and backs off together."""
        precision = self.precision
        if isinstance(precision, MixedPrecision) and precision.scaler is not None:
            if len(self._engines) > 1:
                raise RuntimeError("16-mixed with several modules set up by ZeroLowLevelStrategy is not supported:"
                                   " their engines would share one loss scaler. Use bf16-mixed, or one module.")
            precision.scaler = engine.grad_scaler(init_scale=precision.scaler.get_scale())

    # ---- training --------------------------------------------------------------------------

    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        super().backward(tensor, module, *args, **kwargs)
        for engine in self._engines.values():
            # A rank on which no parameter got a gradient still joins the others' reductions.
            engine.ensure_flushed()

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        """(collective) Clip the optimizer's gradients by their norm over every rank's shards, as
        ``torch.nn.utils.clip_grad_norm_`` does on one process; returns that norm."""
        self.precision.unscale_gradients(optimizer)
        total = _zero_optimizer(optimizer).clip_grad_norm_(float(max_norm), float(norm_type))
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it"
                " cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway,"
                " set `error_if_nonfinite=False`"
            )
        return total

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Clip this rank's gradient shards element-wise (the same as clipping the whole gradients)."""
        self.precision.unscale_gradients(optimizer)
        _zero_optimizer(optimizer).clip_grad_value_(float(clip_val))

    def engine_of(self, module: nn.Module) -> ZeroEngine:
        engine = self._engines.get(_unwrap_module(module))
        if engine is None:
            raise TypeError(f"{type(module).__name__} was not set up with an optimizer by ZeroLowLevelStrategy:"
                            " `model, optimizer = fabric.setup(model, optimizer)`.")
        return engine

    # ---- checkpoints -----------------------------------------------------------------------

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            # The file Fabric programs written for DDP read back (see the class docstring).
            self._checkpoint_io = ZeroCheckpointIO(mode="full")
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    def _zero_io(self) -> ZeroCheckpointIO:
        io = self.checkpoint_io
        if not isinstance(io, ZeroCheckpointIO):
            raise TypeError(f"ZeroLowLevelStrategy saves and loads through ZeroCheckpointIO, got {type(io).__name__}:"
                            " pass `Fabric(plugins=[ZeroCheckpointIO(mode=...)])` or leave the default.")
        return io

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """(every rank) ``state`` holds one module set up with its optimizers (``"model": model``), any of them
        (``"optimizer": optimizer``; in ``local``/``sharded`` mode one brings the state of every optimizer of the
        module, in ``full`` mode each is written under its own key; with none, the plain file Fabric's DDP writes, in every mode) and any other values, which go into the checkpoint as they are (objects
        with ``state_dict()``: their state dict).

        In ``full`` mode the file is the one Fabric's DDP writes (the state's keys at the top, ``ckpt["model"]``
        the module's ``state_dict()``, ``ckpt["optimizer"]`` the optimizer's per-parameter state), plus the
        fp32 masters of parameters kept in a lower precision ([Note: Fabric's layout] in checkpoint/lightning/fabric_tree.py).
        The module's exact fp32 masters and the optimizers' sharded state are written in the plugin's mode;
        ``filter={"model": fn}`` keeps the weights and buffers for which ``fn(name, tensor)`` is true. With
        ``async_save`` the call returns once the save is queued; the tensors are copied before the next
        optimizer update."""
        called = time.perf_counter()
        io = self._zero_io()
        filter = filter or {}
        module_key, module, engine = self._split_state(state)
        if engine is None:
            engine = self.engine_of(module)  # a module set up without optimizers is saved by its owner's loop
        if set(filter) - {module_key}:
            raise ValueError(f"fabric.save(filter=...) filters the module's weights (key {module_key!r}) with"
                             f" ZeroLowLevelStrategy; got filters for {sorted(set(filter) - {module_key})}.")
        index = {id(opt): i for i, opt in enumerate(engine.optimizers)}
        saved_optimizers = {key: index[id(value)] for key, value in state.items() if isinstance(value, Optimizer)}
        rest = {key: value.state_dict() if _is_stateful(value) else value for key, value in state.items()
                if key != module_key and key not in saved_optimizers}
        rest = {VERSION_KEY: lightning.__version__, **rest}
        blob = _to_blob(rest)  # refuses what would not load back
        wait_for_staging()  # a save still copying the masters finishes before they are written again
        engine.adopt_module_writes()  # weights written into the module are what is saved
        with link_of(io).building_a_save():  # [Note: the collector and a save's objects] in checkpoint/saver.py
            options = {**io.storage_options, **(storage_options or {})}
            write = async_save if io.async_save else save
            if not saved_optimizers:
                # No optimizer state: the file Fabric's DDP writes, in every mode ([Note: model-only saves] in
                # checkpoint/lightning/lightning_tree.py): the state as given, the module as its state_dict().
                # The state's keys in the caller's order, each value as ``rest`` converted it (the module's is replaced).
                tree = plain_fabric_tree({key: rest.get(key) for key in state}, module_key, module, engine,
                                         keep=filter.get(module_key))
                write(tree, os.fspath(path), mode="full", storage_options=options, plain=True)
                if io.async_save:
                    link_of(io).note_blocked(time.perf_counter() - called)
                return
            # [Note: Fabric's layout] in checkpoint/lightning/fabric_tree.py: a full file is what Fabric's DDP writes.
            tree = fabric_tree(rest, module_key, saved_optimizers, module, engine, io.mode,
                               self._meta[module], blob, keep=filter.get(module_key))
            # Lightning's fields, where readers of its files look for them (and each save's figures take the step).
            fields = {k: v for k, v in rest.items() if k in ("epoch", "global_step") and isinstance(v, int)}
            write(tree, os.fspath(path), mode=io.mode, storage_options=options, marker_fields=fields)
            if io.async_save:
                link_of(io).note_blocked(time.perf_counter() - called)  # the save's figures count building the tree too

    def _split_state(self, state: dict[str, Any]) -> tuple[str, nn.Module, ZeroEngine | None]:
        """The key, module and engine (None: a module set up without optimizers) of the one module in ``state``;
        the same checks on every rank, before any collective."""
        modules = [(key, _unwrap_module(value)) for key, value in state.items() if isinstance(value, nn.Module)]
        if len(modules) != 1:
            raise ValueError(f"fabric.save/load with ZeroLowLevelStrategy takes exactly one module in `state` (got"
                             f" {len(modules)}: {[k for k, _ in modules]}); save each module in its own checkpoint.")
        key, module = modules[0]
        has_optimizers = any(isinstance(value, Optimizer) for value in state.values())
        engine = self.engine_of(module) if has_optimizers else self._engines.get(module)
        own = set(map(id, engine.optimizers)) if engine is not None else set()
        for name, value in state.items():
            if isinstance(value, Optimizer) and id(value) not in own:
                raise ValueError(f"state[{name!r}] is not an optimizer of state[{key!r}] set up by ZeroLowLevelStrategy"
                                 " (`model, optimizer = fabric.setup(model, optimizer)`).")
        return key, module, engine

    @override
    def load_checkpoint(self, path: Any, state: nn.Module | Optimizer | dict[str, Any] | None = None,
                        strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        """(every rank) Restore ``state`` in place from a checkpoint of any mode (``sharded`` and ``full`` at any
        world size, ``local`` at its own), written by ``fabric.save`` or by the Trainer; returns what it did
        not restore. The module gets the exact masters (and, with its optimizers in ``state``, their sharded
        state and hyper-parameters); other keys are set, or ``load_state_dict``-ed for objects that have it.

        ``state`` a module (``fabric.load_raw``): its weights, from any checkpoint of this package or a file
        holding a plain ``state_dict``. None: the whole checkpoint, in the layout ``fabric.save`` was given
        (Lightning's for a Trainer checkpoint). ``weights_only=False``: the caller trusts the file, whose
        non-tensor values may then hold any object (None or True refuse them)."""
        io = self._zero_io()
        url = os.fspath(path)
        options = io.storage_options
        trusted = weights_only is not None and not weights_only
        if not state:
            return to_fabric_layout(read_lightning_checkpoint(url, options, weights_only=not trusted))
        if isinstance(state, Optimizer):
            raise NotImplementedError("fabric.load_raw(path, optimizer) is not supported by ZeroLowLevelStrategy: its"
                                      " optimizer state is sharded. Load it with the module: fabric.load(path,"
                                      " {'model': model, 'optimizer': optimizer}).")
        if isinstance(state, nn.Module):
            self._load_weights(state, url, options, strict, weights_only=not trusted)
            return {}
        module_key, module, engine = self._split_state(state)
        optimizer_keys = [key for key, value in state.items() if isinstance(value, Optimizer)]
        if engine is None:  # set up without optimizers (inference): the weights, from any mode
            content = self._load_weights(module, url, options, strict, weights_only=not trusted, module_key=module_key)
        else:
            # A file another strategy's fabric.save wrote (Fabric's DDP) records no keys: the state's say them.
            index = {id(opt): i for i, opt in enumerate(engine.optimizers)}
            ordered = sorted(optimizer_keys, key=lambda key: index[id(state[key])])
            content = self._load_module(engine, module, url, options, with_optimizers=bool(optimizer_keys),
                                        strict=strict, weights_only=not trusted,
                                        fabric_keys={"module": module_key, "optimizers": ordered})
        for key in _LIGHTNING_OWN:
            content.pop(key, None)
        rest = {k: v for k, v in state.items() if k != module_key and k not in optimizer_keys}
        missing = [k for k in rest if k not in content]
        if strict and missing:
            raise KeyError(f"The requested state contains a key {missing[0]!r} that does not exist in the loaded"
                           f" checkpoint {url!r}. To disable strict loading, set `strict=False`.")
        for key, obj in rest.items():
            if key not in content:
                continue
            if _is_stateful(obj):
                obj.load_state_dict(content.pop(key))
            else:
                state[key] = content.pop(key)
        return content

    def _load_weights(self, module: nn.Module, url: str, options: dict[str, Any], strict: bool,
                      weights_only: bool = True, module_key: str | None = None) -> dict[str, Any]:
        """The weights of any checkpoint of this package, or of a file holding a plain ``state_dict``
        (``fabric.load_raw(path, module)``); returns the checkpoint's other content. A module trained by an
        engine gets the exact masters (its optimizers keep their state)."""
        module = _unwrap_module(module)
        engine = self._engines.get(module)
        if engine is not None:
            keys = {"module": module_key, "optimizers": []} if module_key is not None else None
            return self._load_module(engine, module, url, options, with_optimizers=False, weights_only=weights_only,
                                     fabric_keys=keys)
        content = read_lightning_checkpoint(url, options, optimizer=False, weights_only=weights_only)
        if "state_dict" in content:
            return load_weights(module, url, options, strict=strict, weights_only=weights_only)
        if module_key is not None and isinstance(content.get(module_key), dict):  # another strategy's fabric.save
            rest = {k: v for k, v in content.items() if k != module_key}
            content = content[module_key]
        else:  # a plain ``torch.save(model.state_dict())`` file
            rest = {}
        with torch.no_grad():
            module.load_state_dict(content, strict=strict)
        return rest

    @staticmethod
    def _load_module(engine: ZeroEngine, module: nn.Module, url: str, options: dict[str, Any],
                     with_optimizers: bool, strict: bool = True, weights_only: bool = True,
                     fabric_keys: dict[str, Any] | None = None) -> dict[str, Any]:
        """(every rank) The masters, buffers and, ``with_optimizers``, the optimizers' state from ``url``;
        returns the checkpoint's other content."""
        wait_for_staging()  # a save still copying the masters finishes before they are overwritten
        kept = [] if with_optimizers else [copy.deepcopy(opt.state_dict()) for opt in engine.optimizers]
        content = dict(load_zero_state_dict(engine, module, url, storage_options=options, strict=strict,
                                            weights_only=weights_only, fabric_keys=fabric_keys))
        for opt, state in zip(engine.optimizers, kept, strict=False):
            opt.load_state_dict(state)  # only the weights were asked for: the optimizers stay as they were
        return content

    @override
    def teardown(self) -> None:
        """Finish the save in flight and close the engines (their hooks and process groups)."""
        for engine in self._engines.values():
            engine.close()
        if self._replica_groups is not None:
            self._replica_groups.close()
            self._replica_groups = None
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._engines.clear()
        self._set_up_modules.clear()
        super().teardown()  # the checkpoint plugin's teardown finalizes the save in flight
        io = self.checkpoint_io
        if isinstance(io, ZeroCheckpointIO):
            link_of(io).release()  # its thread and coordination group end with the loop; a later save makes them again

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        entries = (
            ("zero1", 1, "ZeRO stage 1: evenly sharded optimizer state, all-reduced gradients"),
            ("zero2", 2, "ZeRO stage 2: evenly sharded optimizer state and gradients"),
            ("zero_low_level", 2, "ZeRO stage 2 (alias of 'zero2')"),
        )
        for name, stage, description in entries:
            strategy_registry.register(name, cls, description=description, stage=stage, override=True)


def register_fabric_strategies() -> None:
    """``Fabric(strategy="zero1" | "zero2" | "zero_low_level")``: done on ``import lightning_zero``."""
    ZeroLowLevelStrategy.register_strategies(STRATEGY_REGISTRY)


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: gradient accumulation through the engine's ``no_sync``
    ([Note: accumulation] in engine/zero_engine.py: exact for both stages; stage 2 still reduce-scatters each micro-batch,
    so that no whole gradient outlives its bucket)."""

    def __init__(self, strategy: ZeroLowLevelStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        return _no_sync(self._strategy, self._strategy.engine_of(module))


@contextlib.contextmanager
def _no_sync(strategy: ZeroLowLevelStrategy, engine: ZeroEngine) -> Iterator[None]:
    skipping, strategy._skipping_sync = strategy._skipping_sync, True
    try:
        with engine.no_sync():
            yield
    finally:
        strategy._skipping_sync = skipping


class _BufferBroadcast:
    """Rank 0's buffers on every rank before a forward with gradients, when DDP's wrapper would broadcast them:
    on the first such forward and after a forward with gradients outside ``no_backward_sync`` (so once per
    accumulation window, at its first micro-batch).

    [Note: no collective on rank-local state] Whether a rank joins the broadcast depends only on what every
    rank of a data-parallel loop does alike: a forward with gradients (a backward, itself collective, follows
    it on every rank) and ``no_backward_sync``. Not on ``module.training`` (a rank-0-only sample generation
    that returns early leaves rank 0 in ``eval()``), and not on forwards without gradients (generation or
    evaluation on some ranks only): those neither broadcast nor move the schedule. DDP's wrapper decides by
    its previous forward, whatever it was, so a no-grad forward on one rank desynchronises it; here it cannot.
    A no-grad forward therefore sees this rank's own buffers, as the Trainer strategy's evaluation does."""

    def __init__(self, strategy: ZeroLowLevelStrategy, engine: ZeroEngine) -> None:
        self.strategy = strategy
        self.engine = engine
        self.due = True

    def before_forward(self, module: nn.Module, args: Any) -> None:
        if self.due and torch.is_grad_enabled():
            self.engine.broadcast_buffers()  # (collective)

    def after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            self.due = not self.strategy._skipping_sync


def _unwrap_module(module: nn.Module) -> nn.Module:
    """The module ``fabric.setup`` set up, from Fabric's wrapper or a compiled module."""
    module = getattr(module, "_forward_module", module)
    return getattr(module, "_orig_mod", module)


def _zero_optimizer(optimizer: Optimizer) -> ZeroOptimizer:
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # Fabric's wrapper
    if not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(f"Expected an optimizer set up by ZeroLowLevelStrategy, got {type(optimizer).__name__}:"
                        " `model, optimizer = fabric.setup(model, optimizer)`.")
    return optimizer


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)) \
        and not isinstance(value, (nn.Module, Optimizer, Tensor))


def _to_blob(values: dict[str, Any]) -> bytes:
    """The non-tensor part of ``state`` in the format the Trainer's checkpoints keep Lightning's loops in: one
    ``torch.save`` blob, read back with ``weights_only=True`` (plain values, containers and tensors only).

    Refused here, on every rank, before any collective: a value that would not load back."""
    buffer = io.BytesIO()
    try:
        torch.save(values, buffer)
        blob = buffer.getvalue()
        _from_blob(blob)
    except Exception as exc:
        raise TypeError(
            "fabric.save: the state's values other than the module and its optimizers must be tensors, containers"
            f" and plain values (checkpoints are read with weights_only=True); this one would not load back: {exc}"
        ) from None
    return blob


def _broadcast_state(module: nn.Module) -> None:
    """(collective) Rank 0's parameters and buffers on every rank."""
    with torch.no_grad():
        comm.broadcast_from_first([*module.parameters(), *module.buffers()])


def _from_blob(blob: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)

