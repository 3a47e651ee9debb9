"""ZeroLowLevelStrategy: Lightning glue around :class:`~lightning_zero.engine.ZeroEngine`.

The strategy holds no sharding math and no storage code: it builds the engine at setup,
routes Lightning's hooks (backward sync, clipping, loss scaling) to it and hands its sharded
state to the checkpoint plugin.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Generator
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch import Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero._lightning_fixes import LaunchWithFixes
from lightning_zero.checkpoint import saver, storage
from lightning_zero.checkpoint import state as ckpt_state
from lightning_zero.checkpoint.plugin import TREE_TAG, ZeroCheckpointIO
from lightning_zero.checkpoint.storage import CheckpointCorruptError, CheckpointNotFoundError
from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.optimizer import ZeroOptimizer


class ZeroLowLevelStrategy(DDPStrategy):
    """ZeRO stage 1 or 2 data parallelism with evenly sharded optimizer state.

    Args:
        stage: 1 shards optimizer state (gradients all-reduced); 2 also shards gradients
            (reduce-scattered, full gradients freed bucket by bucket).
        bucket_size_mb: gradient bucket capacity in MiB; None scales it with the world size.
        overlap_communication: reduce buckets asynchronously while backward runs.
        overlap_param_gather: leave the parameter all-gathers running into the next forward.
        reduce_dtype: the dtype gradients are reduced in (a dtype or its name); None: the parameters'.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, timeout, start_method: as in Lightning's ``DDPStrategy``.
    """

    strategy_name = "zero_low_level"

    def __init__(
        self,
        stage: Literal[1, 2] = 2,
        bucket_size_mb: float | None = None,
        overlap_communication: bool = True,
        overlap_param_gather: bool = True,
        reduce_dtype: torch.dtype | str | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        # Validated before anything else so a bad stage fails at construction, on every rank.
        self.zero_config = ZeroConfig(stage, bucket_size_mb, overlap_communication, overlap_param_gather, reduce_dtype)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._engine: ZeroEngine | None = None
        self._loaded_by_strategy = False
        self._last_shard_numel: int | None = None

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        assert self._launcher is not None
        self._launcher.launch = LaunchWithFixes(self._launcher)  # type: ignore[method-assign]

    @property
    def stage(self) -> int:
        return self.zero_config.stage

    @property
    def engine(self) -> ZeroEngine:
        if self._engine is None:
            raise RuntimeError("The ZeRO engine exists only between `setup` and `teardown` of `trainer.fit`.")
        return self._engine

    @property
    def optimizer_shard_numel(self) -> int:
        """Real parameter elements whose fp32 master copy and optimizer state this rank holds
        (kept after ``fit`` ends, for inspection)."""
        if self._engine is not None:
            return self._engine.optimizer_shard_numel
        if self._last_shard_numel is None:
            raise RuntimeError("optimizer_shard_numel is known once `trainer.fit` has set the strategy up.")
        return self._last_shard_numel

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.model is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
            self._engine = ZeroEngine(self.model, self.optimizers, self.zero_config)
            self.optimizers = list(self._engine.optimizers)
            self._route_precision_plugin()
            if isinstance(self.checkpoint_io, ZeroCheckpointIO):
                saver.prepare()
            for optimizer in self._engine.optimizers:
                # The only mutation of checkpointed tensors: a save still staging must finish first.
                optimizer.register_step_pre_hook(lambda *_: saver.wait_for_staging())
        else:
            _sync_module_states(self.model)
        self.setup_precision_plugin()

    def _route_precision_plugin(self) -> None:
        """Make Lightning's clipping and fp16 loss scaling see all shards, not this rank's.

        [Note: clipping] Lightning's precision plugin clips with ``clip_grad_norm_`` over the
        optimizer's parameters, which here are shards: that norm is local and wrong. The plugin
        instance is told to ask the optimizer for the global norm instead; clipping by value is
        element-wise and already right on shards.
        """
        plugin = self.precision_plugin

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
            _unwrap(optimizer).clip_grad_norm_(clip_val)

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]
        if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
            # All ranks must skip an overflowing step together: the found-inf flag is all-reduced.
            plugin.scaler = self.engine.grad_scaler(init_scale=plugin.scaler.get_scale())

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        if self._engine is None:
            yield
            return
        with self._engine.no_sync():
            yield

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        pass

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if self._engine is not None:
            self._engine.ensure_flushed()

    # ---- checkpoints -----------------------------------------------------------------------

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = ZeroCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to receive sharded state

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # sharded optimizer state is restored in `load_checkpoint`

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        # Lightning's own gathering of optimizer state is bypassed: `save_checkpoint` takes the
        # shards straight from the engine, in the layout the checkpoint mode needs.
        return {}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """(every rank) Hand this rank's sharded state to the checkpoint plugin."""
        io = self.checkpoint_io
        if isinstance(io, ZeroCheckpointIO):
            io.save_checkpoint(self._checkpoint_tree(checkpoint, io.mode), filepath, storage_options)
            return
        # A plain CheckpointIO (TorchCheckpointIO, AsyncCheckpointIO) gets one full file from rank 0.
        tree = self._checkpoint_tree(checkpoint, "full")
        full = saver.gather_tree_to_rank0(tree, None)  # on the training group, this thread
        if self.is_global_zero:
            full.pop(TREE_TAG)
            io.save_checkpoint(full, filepath, storage_options=storage_options)

    def _checkpoint_tree(self, checkpoint: dict[str, Any], mode: str) -> dict[str, Any]:
        module = self.lightning_module
        assert module is not None
        trainer_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        with_optimizer = "optimizer_states" in checkpoint  # absent for save_weights_only
        if self._engine is None:
            raise RuntimeError("ZeroLowLevelStrategy saves checkpoints only while fitting (the engine holds the state).")
        if mode == "full":
            buffers = {name for name, _ in module.named_buffers()}
            state_dict = {k: v.clone() if k in buffers else v for k, v in checkpoint["state_dict"].items()}
            tree = {**trainer_state, "state_dict": state_dict}
            if with_optimizer:
                tree["optimizer_states"] = ckpt_state.full_optimizer_states(self._engine)
        else:
            tree = ckpt_state.zero_state_dict(self._engine, module)
            if not with_optimizer:
                tree.pop("optimizer")
            tree["trainer"] = _pack_object(trainer_state)
        tree[TREE_TAG] = mode
        return tree

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """(every rank) Read the mode from the checkpoint, load the shards this rank owns at the
        current world size, and return Lightning's part of the checkpoint.

        A damaged or incomplete ``last*`` checkpoint falls back, with a warning, to the newest
        complete checkpoint beside it (as SageMaker HyperPod's adapter does); every rank agrees
        on which one loaded before any state is used.
        """
        path = os.fspath(checkpoint_path)
        io = self.checkpoint_io
        options = io.storage_options if isinstance(io, ZeroCheckpointIO) else {}
        candidates = [path]
        if os.path.basename(path.rstrip("/")).startswith("last"):
            candidates += storage.newest_siblings(storage.resolve(path, options))
        first_error: Exception | None = None
        for candidate in candidates:
            error: Exception | None = None
            try:
                result = self._load_one(candidate, options)
            except (CheckpointCorruptError, CheckpointNotFoundError, CheckpointException) as exc:
                error = exc
            if self.reduce_boolean_decision(error is None, all=True):
                if self._engine is not None and self._loaded_by_strategy:
                    self._engine.publish_masters()  # collectives only once every rank has loaded
                if candidate != path:
                    reason = first_error or "it failed to load on another rank"
                    rank_zero_warn(f"Checkpoint {path!r} could not be loaded ({reason}); resumed from"
                                   f" {candidate!r}, the newest complete checkpoint beside it.")
                return result
            first_error = first_error or error
        if first_error is None:  # another rank failed; this one has nothing to report
            raise CheckpointCorruptError(f"Checkpoint {path!r} failed to load on another rank; see its error.")
        raise first_error

    def _load_one(self, path: str, options: dict[str, Any]) -> dict[str, Any]:
        """Load into this rank's shards; no collective on the training group (ranks may fail apart)."""
        self._loaded_by_strategy = False
        mode = saver.read_mode(path, options)
        module = self.lightning_module
        assert module is not None
        if mode == "full":
            content = saver.read_full(path, options)
            if self._engine is not None:
                ckpt_state.load_full_into_engine(self._engine, module, content)
                self._loaded_by_strategy = True
            return content
        if self._engine is None:
            raise ValueError(
                f"{path!r} is a {mode!r} checkpoint, which needs the ZeRO engine built by `trainer.fit`. To validate,"
                " test or predict from it, save with ZeroCheckpointIO(mode='full')."
            )
        keys = saver.saved_tensor_keys(path, options)
        for index, optimizer in enumerate(self._engine.optimizers):
            ckpt_state.materialize_optimizer_state(optimizer, ckpt_state.saved_optimizer_fqns(keys, index))
        tree = ckpt_state.zero_state_dict(self._engine, module, for_load=True)
        if not any(k.startswith("optimizer/") for k in keys):
            tree.pop("optimizer")
        objects = saver.load(tree, path, storage_options=options)
        for optimizer, saved in zip(self._engine.optimizers, objects.get("optimizer", [])):
            ckpt_state.apply_param_groups(optimizer, saved["param_groups"])
        self._loaded_by_strategy = True
        return {**_unpack_object(objects["trainer"]), "state_dict": module.state_dict()}

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if self._loaded_by_strategy:
            return  # already in the engine (and gathered into the model) by `load_checkpoint`
        super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

    @override
    def teardown(self) -> None:
        if self._engine is not None:
            self._last_shard_numel = self._engine.optimizer_shard_numel
            self._engine.close()
            self._engine = None
            # Free the engine's buffers (and the collectives' references to them) now, while the
            # process groups live: gloo freeing them during interpreter shutdown can abort a
            # worker that finished its fit ("terminate called without an active exception").
            gc.collect()
        super().teardown()

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


def _pack_object(obj: Any) -> bytes:
    """Lightning's loop/callback state as one blob, so tensors in it stay out of the sharded tree."""
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _unpack_object(blob: bytes) -> dict[str, Any]:
    import io
    import pickle

    try:
        return torch.load(io.BytesIO(blob), weights_only=True)
    except pickle.UnpicklingError as exc:
        # Hyper-parameters may hold arbitrary classes that weights_only refuses; the tensors of a
        # checkpoint are always loaded with weights_only=True, this metadata blob is the exception.
        rank_zero_warn(f"Loading the trainer state of a checkpoint with weights_only=False: {exc}")
        return torch.load(io.BytesIO(blob), weights_only=False)


def _unwrap(optimizer: Optimizer) -> ZeroOptimizer:
    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer._optimizer
    if not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(
            f"Expected an optimizer set up by ZeroLowLevelStrategy, got {type(optimizer).__name__}."
            " Optimizers must come from `configure_optimizers`."
        )
    return optimizer
