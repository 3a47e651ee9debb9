"""ZeroLowLevelStrategy: Lightning glue around :class:`~lightning_zero.engine.ZeroEngine`.

The strategy holds no sharding math and no storage code: it builds the engine at setup,
routes Lightning's hooks (backward sync, clipping, loss scaling) to it and hands its sharded
state to the checkpoint plugin.
"""

from __future__ import annotations

import contextlib
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
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.optimizer import ZeroOptimizer


class ZeroLowLevelStrategy(DDPStrategy):
    """ZeRO stage 1 or 2 data parallelism with evenly sharded optimizer state.

    Args:
        stage: 1 shards optimizer state (gradients all-reduced); 2 also shards gradients
            (reduce-scattered, full gradients freed bucket by bucket).
        bucket_size_mb: gradient bucket capacity in MiB.
        overlap_communication: reduce buckets asynchronously while backward runs.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, timeout, start_method: as in Lightning's ``DDPStrategy``.
    """

    strategy_name = "zero_low_level"

    def __init__(
        self,
        stage: Literal[1, 2] = 2,
        bucket_size_mb: float = 25.0,
        overlap_communication: bool = True,
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
        self.zero_config = ZeroConfig(stage, bucket_size_mb, overlap_communication)
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
        """Real parameter elements whose fp32 master copy and optimizer state this rank holds."""
        return self.engine.optimizer_shard_numel

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

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
        return _unwrap(optimizer).state_dict()

    @override
    def teardown(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
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


def _unwrap(optimizer: Optimizer) -> ZeroOptimizer:
    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer._optimizer
    if not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(
            f"Expected an optimizer set up by ZeroLowLevelStrategy, got {type(optimizer).__name__}."
            " Optimizers must come from `configure_optimizers`."
        )
    return optimizer
