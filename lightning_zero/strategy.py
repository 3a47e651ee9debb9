"""ZeroLowLevelStrategy: Lightning glue around :class:`~lightning_zero.engine.ZeroEngine`.

The strategy holds no sharding math and no storage code: it builds the engine at setup,
routes Lightning's hooks (backward sync, clipping, loss scaling) to it and hands its sharded
state to the checkpoint plugin.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
from collections.abc import Generator
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero._compat import MockOptimizer as _MockOptimizer
from lightning_zero._compat import StrategyRegistry as _StrategyRegistry
from lightning_zero._compat import sync_module_states as _sync_module_states
from lightning_zero._lightning_fixes import LaunchWithFixes
from lightning_zero.checkpoint import CheckpointMetrics, ZeroCheckpointIO, wait_for_staging
from lightning_zero.checkpoint.lightning import entry
from lightning_zero.data import keep_data_position
from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.fault_tolerance import FaultTolerance
from lightning_zero.engine.optimizer import ZeroOptimizer
from lightning_zero.strategy_phase import Lifecycle, Phase
from lightning_zero.trainer_fault_tolerance import TrainerReplicaGroups

_ALREADY_LOADED = "loaded by load_checkpoint"
"""``load_checkpoint``'s hand-off to ``load_model_state_dict`` when it put the weights in place itself (into the
engine, or the module when there is none)."""


class ZeroLowLevelStrategy(DDPStrategy):
    """ZeRO stage 1 or 2 data parallelism with evenly sharded optimizer state.

    Args:
        stage: 1 shards optimizer state (gradients all-reduced); 2 also shards gradients
            (reduce-scattered, full gradients freed bucket by bucket).
        bucket_size_mb: gradient bucket capacity in MiB; None scales it with the world size.
        overlap_communication: reduce buckets asynchronously while backward runs.
        overlap_param_gather: leave the parameter all-gathers running into the next forward.
        reduce_dtype: the dtype gradients are reduced in (a dtype or its name); None: the parameters'.
        shard_group_size: hybrid sharding: shard optimizer state (and stage 2 gradients) within
            consecutive groups of this many ranks and replicate across the groups; must divide the
            world size. With ``num_nodes``, the devices per node is the natural choice (one node
            per shard group: the shard collectives stay on the node's links, only 1/N of the
            gradient bytes cross nodes). None: shard over the whole world.
        broadcast_buffers: broadcast rank 0's buffers (BatchNorm statistics) before every training
            step, as DDP does by default; checkpoints always hold rank 0's buffers.
        nonfinite_loss: ``"raise"`` checks every training step's loss on every rank (one tiny
            all-gather, and a host sync on GPUs, per step) and stops all ranks together with a
            ``FloatingPointError`` naming the step and the ranks whose loss was NaN/inf, before
            backward spreads it into the weights; ``"skip"`` makes the same check and, instead of
            stopping, skips that step's update on every rank with a warning (the weights and the
            optimizer state stay as they were; the LR scheduler still steps); ``"ignore"`` (default)
            adds nothing to the step.
        full_gradients: stage 1 only: every parameter's ``.grad`` holds the whole averaged gradient after
            backward, as under DDP, for hooks that read it (``ZeroConfig.full_gradients``: an all-reduce,
            and the gradients kept until ``zero_grad``).
        release_grad_shards: ``zero_grad()`` frees the fp32 gradient shards until the next backward, so between
            steps a rank holds parameters, master shards and optimizer state only (``ZeroConfig.release_grad_shards``;
            False keeps them allocated, for CPU runs where taking them again costs page faults).
        whole_step_group_mb: shape-aware optimizers (Muon, Adafactor) step whole matrices gathered from the
            shards a group of at most this many MiB at a time (``ZeroConfig.whole_step_group_mb``; None: all at
            once). See docs/optimizers.md.
        exclude_frozen_parameters: leave parameters that do not require grad out of every checkpoint (a
            frozen pretrained base under adapters), as DeepSpeed's option of that name; loading such a
            checkpoint keeps the module's own values of the parameters it lacks (no ``strict_loading``
            error for them).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, timeout, start_method: as in Lightning's ``DDPStrategy``.
        fault_tolerance: a :class:`~lightning_zero.FaultTolerance`: this job is one replica group of a
            fault-tolerant job (torchft); a group lost costs the others one step ("Fault tolerance" guide).
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
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        broadcast_buffers: bool = True,
        nonfinite_loss: Literal["ignore", "raise", "skip"] = "ignore",
        exclude_frozen_parameters: bool = False,
        whole_step_group_mb: float | None = 1024.0,
        full_gradients: bool = False,
        release_grad_shards: bool = True,
        fault_tolerance: FaultTolerance | None = None,
    ) -> None:
        if nonfinite_loss not in ("ignore", "raise", "skip"):
            raise ValueError(f"nonfinite_loss must be 'ignore', 'raise' or 'skip', got {nonfinite_loss!r}.")
        # Validated before anything else so a bad stage fails at construction, on every rank.
        self.zero_config = ZeroConfig(stage, bucket_size_mb, overlap_communication, overlap_param_gather, reduce_dtype,
                                      shard_group_size, whole_step_group_mb=whole_step_group_mb,
                                      full_gradients=full_gradients, release_grad_shards=release_grad_shards)
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
        self.broadcast_buffers = broadcast_buffers
        self.nonfinite_loss = nonfinite_loss
        self.exclude_frozen_parameters = exclude_frozen_parameters
        self._engine: ZeroEngine | None = None
        self._lifecycle = Lifecycle()  # [Note: the strategy's phases] in strategy_phase.py
        self._module_meta: dict[str, Any] | None = None
        self._last_shard_numel: int | None = None
        # What load_checkpoint left for load_model_state_dict: the weights already in place (_ALREADY_LOADED),
        # the weights that wait for on_load_checkpoint, or nothing (Lightning loads them).
        self._weights_handoff: entry.PendingWeights | str | None = None
        if fault_tolerance is not None and not isinstance(fault_tolerance, FaultTolerance):
            raise TypeError(f"fault_tolerance must be a lightning_zero.FaultTolerance, got {type(fault_tolerance).__name__}.")
        self._fault_tolerance = fault_tolerance
        self._replica_groups: TrainerReplicaGroups | None = None  # from fit's setup to its teardown

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        assert self._launcher is not None
        self._launcher.launch = LaunchWithFixes(self._launcher)  # type: ignore[method-assign]

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        assert self.lightning_module is not None
        # Before the callbacks' setup and the restore of their state: [Note: the data position by default].
        # With fault tolerance, batches are split by committed steps across the replica groups.
        keep_data_position(self.lightning_module.trainer, self._data_split if self._fault_tolerance else None)

    def _data_split(self) -> tuple[int, int]:
        return self._replica_groups.data_split()  # type: ignore[union-attr]  # batches are fetched after setup

    @property
    def fault_tolerance(self) -> FaultTolerance | None:
        """The fault tolerance settings, with what the last optimizer step did (``committed``,
        ``participants``, ``heals``, ...); None without fault tolerance."""
        return self._fault_tolerance

    @property
    def stage(self) -> int:
        return self.zero_config.stage

    @property
    def engine(self) -> ZeroEngine:
        if self._engine is None:
            raise RuntimeError(
                "The ZeRO engine exists from the setup of `trainer.fit` until the next validate/test/predict or"
                " fit (it is kept after fit so that `trainer.save_checkpoint` can save the optimizer state)."
            )
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

    @property
    def _live(self) -> bool:
        """Fit's engine between its setup and teardown: hooks installed, steps run."""
        return self._engine is not None and self._lifecycle.fitting

    @override
    def setup(self, trainer: Trainer) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        resumed = self._lifecycle.phase is Phase.RESUMING
        self._lifecycle.enter(Phase.FITTING if fitting else Phase.IDLE, "setup")  # before a live engine is closed
        if not resumed:
            self._set_up_model(trainer)
        if isinstance(self.checkpoint_io, ZeroCheckpointIO):
            own_names_only = fitting and self._fault_tolerance is not None and self.is_global_zero  # rank 0 answers
            entry.link_of(self.checkpoint_io).count_claims_as_taken(trainer.checkpoint_callbacks, own_names_only)
            if fitting and not any(isinstance(c, CheckpointMetrics) for c in trainer.callbacks):
                # Each save's cost reaches the user's loggers without them asking (no collective).
                trainer.callbacks.append(CheckpointMetrics())
        self.setup_precision_plugin()

    def _set_up_model(self, trainer: Trainer) -> None:
        """The module on its device and in its precision, and for ``fit`` the optimizers and the engine:
        in ``setup``, or earlier when ``fit`` resumes ([Note: restore before on_fit_start])."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.model is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._release_engine()  # a previous fit's state: a new fit builds its own, evaluation needs none
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
        if fitting and all(isinstance(opt, _MockOptimizer) for opt in self.optimizers):
            # `configure_optimizers` returned None: Lightning runs the loop without an optimizer,
            # so nothing is sharded (nothing steps) and no engine is built.
            rank_zero_warn("`configure_optimizers` returned no optimizer: ZeroLowLevelStrategy trains nothing and"
                           " shards nothing; the module's weights stay as they are.")
            _sync_module_states(self.model)
        elif fitting:
            if self._replica_groups is not None:
                self._replica_groups.close()
            self._replica_groups = None if self._fault_tolerance is None else TrainerReplicaGroups(
                self._fault_tolerance, trainer, self.global_rank, self.world_size, self.root_device)
            self._engine = ZeroEngine(self.model, self.optimizers, self.zero_config, replica_groups=None
                                      if self._replica_groups is None else self._replica_groups.groups)
            # Once, now that dtypes are final and no gather is in flight: per save it would wait
            # for the step's overlapped gathers on the training thread (module_meta's docstring).
            self._module_meta = entry.module_meta(self.model)
            self.optimizers = list(self._engine.optimizers)
            self._route_precision_plugin()
            for optimizer in self._engine.optimizers:
                # The only mutation of checkpointed tensors: a save still staging must finish first.
                # After the closure, so staging overlaps training_step and backward (BENCHMARKS.md measures it).
                optimizer.register_pre_update_hook(self._wait_for_staging)
            if self._replica_groups is not None:
                self._replica_groups.serve(self._engine)
        else:
            self.optimizers = []
            self.lr_scheduler_configs = []
            _sync_module_states(self.model)
        if isinstance(self.checkpoint_io, ZeroCheckpointIO):
            # Saves coordinate in the background, also after validate/test; the local tier needs the node.
            entry.link_of(self.checkpoint_io).set_up(self.num_processes, node_rank=self.node_rank,
                                               local_rank=self.local_rank)

    def _wait_for_staging(self) -> None:
        """The staging fence: a save still copying the state finishes before it changes."""
        io = self.checkpoint_io
        if isinstance(io, ZeroCheckpointIO):
            entry.link_of(io).wait_for_staging()
        else:
            wait_for_staging()  # a save through the functional API, if any

    def _release_engine(self) -> None:
        if self._engine is not None:
            self._last_shard_numel = self._engine.optimizer_shard_numel
            self._engine.close()
            self._engine = None
            # Free the engine's buffers (and the collectives' references to them) now, while the
            # process groups live: gloo freeing them during interpreter shutdown can abort a
            # worker that finished its fit ("terminate called without an active exception").
            gc.collect()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self._live:
            assert self._engine is not None
            self._engine.broadcast_buffers()
        output = super().training_step(*args, **kwargs)
        if self.nonfinite_loss != "ignore" and self._live:
            output = self._check_finite_loss(output)
        return output

    def _check_finite_loss(self, output: Any) -> Any:
        """(collective, every rank) Raise on every rank if the loss of any rank is not finite, or,
        with ``nonfinite_loss="skip"``, hand back a zero loss and skip the step's update everywhere."""
        loss = output.get("loss") if isinstance(output, dict) else output
        value = float(loss.detach().float().sum()) if isinstance(loss, Tensor) else 0.0
        finite = torch.tensor([1.0 if math.isfinite(value) else 0.0], device=self.root_device)
        flags = [torch.empty_like(finite) for _ in range(self.world_size)]
        if self.world_size > 1:
            torch.distributed.all_gather(flags, finite)
        else:
            flags[0].copy_(finite)
        bad = [rank for rank, flag in enumerate(flags) if not flag.item()]
        if not bad:
            return output
        step = self.lightning_module.trainer.global_step if self.lightning_module is not None else "?"
        if self.nonfinite_loss == "skip":
            rank_zero_warn(f"The training loss is not finite at global step {step} on rank(s) {bad}: the update of"
                           " this step is skipped on every rank (ZeroLowLevelStrategy(nonfinite_loss='skip')).")
            for optimizer in self.engine.optimizers:
                optimizer.skip_next_update()
            # Backward still runs on every rank (its reductions must match), on a loss that gives every
            # parameter a zero gradient instead of spreading the NaN/inf.
            assert self.lightning_module is not None
            zero = sum((p.sum() * 0.0 for p in self.lightning_module.parameters() if p.requires_grad),
                       torch.zeros((), device=self.root_device))
            if isinstance(output, dict):
                return {**output, "loss": zero}
            return zero
        raise FloatingPointError(
            f"The training loss is not finite at global step {step} on rank(s) {bad} (this is rank"
            f" {self.global_rank}, loss {value}); every rank stops here, before backward puts NaN/inf into the"
            " weights. Lower the learning rate, clip gradients, check the batch, skip such steps with"
            " nonfinite_loss='skip', or resume from the last checkpoint. (ZeroLowLevelStrategy(nonfinite_loss='raise'))"
        )

    def _route_precision_plugin(self) -> None:
        """Make Lightning's clipping and fp16 loss scaling see all shards, not this rank's.

        [Note: clipping] Lightning's precision plugin clips the gradients of the optimizer's
        param-group parameters: the module's, whose gradients are in the engine's shards (stage 2 frees
        them bucket by bucket). The plugin instance is told to ask the optimizer instead: the norm over
        every rank's shards, and clipping by value (element-wise) on this rank's shard.
        """
        plugin = self.precision_plugin
        # Module-level functions (not closures): the Trainer, and its plugin, pickle after fit.
        plugin.clip_grad_by_norm = _clip_grad_by_global_norm  # type: ignore[method-assign]
        plugin.clip_grad_by_value = _clip_grad_by_value_on_shards  # type: ignore[method-assign]
        if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
            # All ranks must skip an overflowing step together: the found-inf flag is all-reduced.
            plugin.scaler = self.engine.grad_scaler(init_scale=plugin.scaler.get_scale())

    def grad_norm(self, norm_type: float | str = 2.0, group_separator: str = "/") -> dict[str, Tensor]:
        """Lightning's ``lightning.pytorch.utilities.grad_norm(module, norm_type)`` for the module this strategy
        trains: each parameter's gradient norm and their total, under the same keys, for logging from
        ``on_before_optimizer_step``. (collective: call it on every rank.)

        Lightning's own ``grad_norm`` reads ``param.grad``, which ZeRO does not keep (stage 2 holds this
        rank's shard of each gradient, stage 1 moves the gradients into its reduction buffers): it returns
        an empty dict here. This computes the norms from every rank's shard."""
        if not self._live:
            raise RuntimeError("ZeroLowLevelStrategy.grad_norm reads the gradient shards of a `fit` in progress (call"
                               " it from `on_before_optimizer_step`); no fit is running, so there is no gradient.")
        norm = float(norm_type)
        if norm <= 0:
            raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
        per_param = self.engine.grad_norms(norm)
        norms = {f"grad_{norm}_norm{group_separator}{name}": value for name, value in per_param.items()}
        if norms:
            norms[f"grad_{norm}_norm_total"] = torch.stack(list(per_param.values())).norm(norm)
        return norms

    def _adopt_module_writes(self, compare_values: bool = True) -> None:
        """Weights written into the module reach the masters ([Note: the module is the truth] in
        engine/zero_engine.py). Called where Lightning has just run user code between steps."""
        if self._engine is None:
            return
        self._wait_for_staging()  # a save still copying the masters finishes first
        self._engine.adopt_module_writes(compare_values)

    @override
    def on_train_start(self) -> None:
        # After the callbacks' and the module's on_fit_start/on_train_start (and on_load_checkpoint).
        self._adopt_module_writes()
        if self._replica_groups is not None:
            self._replica_groups.join()  # a group behind the others heals before its first forward
        super().on_train_start()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # After the callbacks' and the module's on_train_epoch_start/on_train_batch_start: where a
        # fine-tuning callback unfreezes a part of the model.
        if self._engine is not None and self._live and self._engine.trainable_changed():
            self._engine.rebuild()  # [Note: rebuilding] in engine/zero_engine.py
        if self._replica_groups is not None and self._live:
            self._replica_groups.before_batch()
        super().on_train_batch_start(batch, batch_idx)

    @override
    def on_validation_end(self) -> None:
        self._adopt_module_writes()
        super().on_validation_end()

    @override
    def on_train_end(self) -> None:
        self._adopt_module_writes()
        super().on_train_end()

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
        """False, as for DDP: Lightning restores the module and the callbacks before ``setup`` and
        ``on_fit_start``.

        [Note: restore before on_fit_start] Sharded state needs the engine, which ``setup`` builds; with
        the restore after ``setup`` (as DeepSpeed's strategy does) ``on_fit_start`` ran before any callback
        had its state back, and StochasticWeightAveraging and BaseFinetuning, which restore their schedulers
        and param groups there, broke on resume. So a resuming ``fit`` builds the module's device placement,
        precision, optimizers and engine inside :meth:`load_checkpoint` (:meth:`_set_up_model`), and
        ``setup`` does not build them again."""
        return False

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
        """(every rank) Hand this rank's sharded state to the checkpoint plugin.

        Works during and after ``fit`` (optimizer state included) and after ``validate``/``test``/
        ``predict`` or before any fit. A save without optimizer state (``save_weights_only``, or no
        optimizer exists) is the plain file DDP writes, whatever the mode. A save outside the
        training loop returns once committed, as nothing would finalize it later."""
        io = self.checkpoint_io
        module = self.lightning_module
        assert module is not None
        if self._engine is not None:
            # What the module holds now is what is saved. Values are compared unless the step's
            # gathers are still running (a save from on_train_batch_end): their parameters were
            # not read since, so only in-place writes can have happened.
            self._adopt_module_writes(compare_values=not self._engine.gatherer.pending)
        if self._replica_groups is not None and self._live and not self._replica_groups.writes_checkpoints():
            if isinstance(io, ZeroCheckpointIO):  # its name is this group's too: [Note: names under fault tolerance]
                entry.link_of(io).claim(filepath)
            return  # one replica group writes each checkpoint; this one goes on training
        with_optimizer = entry.holds_optimizer_state(checkpoint, self._engine)
        if isinstance(io, ZeroCheckpointIO):
            called = time.perf_counter()
            # Without optimizer state (save_weights_only, a save outside fit) the file DDP writes, in every mode
            # ([Note: model-only saves] in checkpoint/lightning/lightning_tree.py).
            with entry.link_of(io).building_a_save():  # [Note: the collector and a save's objects] in checkpoint/saver.py
                tree = (entry.build_tree(checkpoint, module, self._engine, io.mode, self._saved_meta())
                        if with_optimizer else entry.plain_tree(checkpoint, module, self._engine))
                io.save_checkpoint(tree, filepath, storage_options)
            if entry.holds_module_parameters(tree):
                # A full file holds the module's own parameters, which the hooks that run before the next
                # step may change in place (SWA puts its average in at train end): its copy ends here.
                # local/sharded hold the masters, which only the fenced update changes.
                entry.link_of(io).wait_for_staging()
            entry.link_of(io).note_blocked(time.perf_counter() - called)  # building the tree (and a full save's copy) included
            if not self._live:
                io.finalize()
            return
        # A plain CheckpointIO (TorchCheckpointIO, AsyncCheckpointIO) gets one full file from rank 0,
        # gathered on the training group, this thread; without optimizer state, Lightning's dict as it is.
        whole = (entry.gather_full_checkpoint(checkpoint, module, self._engine, self._saved_meta())
                 if with_optimizer else checkpoint)
        if self.is_global_zero:
            io.save_checkpoint(whole, filepath, storage_options=storage_options)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's ``state_dict()``, as under DDP: what ``on_save_checkpoint`` hooks see and edit.

        A save then holds what the hooks left ([Note: what a checkpoint holds] in checkpoint/lightning/lightning_tree.py):
        entries still holding the module's own tensors are written from the engine's exact fp32 masters.
        ``state_dict()`` finishes the step's overlapped parameter gathers first (a hook may read the
        values), so a step that saves gives up that overlap. ``exclude_frozen_parameters``: parameters
        that do not require grad are left out before the hooks run."""
        state_dict = super().lightning_module_state_dict()
        if self.exclude_frozen_parameters:
            module = self.lightning_module
            assert module is not None
            for name, param in module.named_parameters(remove_duplicate=False):
                if not param.requires_grad:
                    state_dict.pop(name, None)
        return state_dict

    def _saved_meta(self) -> dict[str, Any] | None:
        """The module metadata of this fit (None outside fit: computed at the save, nothing is in flight)."""
        return self._module_meta if self._engine is not None else None

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """(every rank) Read the mode from the checkpoint; in ``fit`` load the shards this rank owns at
        the current world size (optimizer state too), otherwise the whole weights into the module (any
        mode, any world size). Returns Lightning's part of the checkpoint.

        A damaged or incomplete ``last*`` checkpoint falls back, with a warning, to the newest
        complete checkpoint beside it; every rank agrees on which one loaded before any state is used.
        ``weights_only`` (``trainer.fit(..., weights_only=False)``): False unpickles any object the
        checkpoint's non-tensor state holds, for a file the caller trusts; None or True refuse them.
        """
        io = self.checkpoint_io
        zero_io = io if isinstance(io, ZeroCheckpointIO) else None
        module = self.lightning_module
        assert module is not None
        trainer = module.trainer
        if trainer.state.fn == TrainerFn.FITTING and not self._lifecycle.fitting:
            self._lifecycle.enter(Phase.RESUMING, "load_checkpoint")
            self._set_up_model(trainer)  # [Note: restore before on_fit_start]
        # A module that migrates checkpoints in on_load_checkpoint sees them before the weights are
        # applied, as under DDP ([Note: hook before weights] in checkpoint/lightning/hook_weights.py).
        hook_first = type(module).on_load_checkpoint is not LightningModule.on_load_checkpoint
        resume = entry.TrainerResume(
            strategy=self, module=module, engine=self._engine,
            options=zero_io.storage_options if zero_io is not None else {},
            strict=bool(getattr(module, "strict_loading", True)), may_lack=self._may_lack(module),
            hook_first=hook_first,
            # With ZeroCheckpointIO (whose setup made the coordination group), rank 0 reads the marker
            # and a sharded checkpoint's .metadata for every rank ([Note: shared metadata]).
            shared=zero_io is not None,
            # Lightning's argument (fit/validate/test/predict(..., weights_only=...)): None is torch's default, True.
            trusted=weights_only is not None and not weights_only,
        )
        self._weights_handoff = None
        result = resume.run(os.fspath(checkpoint_path), None if zero_io is None else entry.link_of(zero_io),
                            self.zero_config.shard_group_size)
        if self._engine is not None and not resume.pending:
            entry.publish(self._engine, module)  # collectives only once every rank has loaded
        if not hook_first:
            self._weights_handoff = _ALREADY_LOADED
        elif resume.pending:
            self._weights_handoff = resume.pending[0]
        return result

    def _may_lack(self, module: LightningModule) -> frozenset[str]:
        """Weights a checkpoint may lack without a ``strict_loading`` error: the frozen ones when they are
        left out of every checkpoint (``exclude_frozen_parameters``)."""
        if not self.exclude_frozen_parameters:
            return frozenset()
        return frozenset(name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        handoff, self._weights_handoff = self._weights_handoff, None
        if handoff is _ALREADY_LOADED:
            return  # already in the engine (and gathered into the model), or in the module, by `load_checkpoint`
        module = self.lightning_module
        assert module is not None
        if isinstance(handoff, entry.PendingWeights) and self._engine is not None:
            # After the module's on_load_checkpoint ([Note: hook before weights] in checkpoint/lightning/hook_weights.py).
            entry.apply_pending_weights(self._engine, module, handoff, checkpoint["state_dict"], strict,
                                        self._may_lack(module))
            entry.publish(self._engine, module)
            return
        entry.keep_own_values(module, checkpoint["state_dict"], "the checkpoint", strict, self._may_lack(module))
        super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self._replica_groups is not None and self._live and not self._replica_groups.writes_checkpoints():
            if isinstance(self.checkpoint_io, ZeroCheckpointIO):
                entry.link_of(self.checkpoint_io).unclaim(filepath)
            return  # the group that writes the checkpoints removes them (ModelCheckpoint's top-k runs in every group)
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

    @override
    def teardown(self) -> None:
        if self._engine is not None and self._live:
            # Hooks off, state kept: `trainer.save_checkpoint` after fit saves what the last step had.
            self._last_shard_numel = self._engine.optimizer_shard_numel
            self._engine.close()
        if self._lifecycle.fitting:
            self._lifecycle.enter(Phase.FITTED, "teardown")
        if self._replica_groups is not None:
            self._replica_groups.close()
            self._replica_groups = None
        super().teardown()  # the plugin's teardown finalizes the save in flight
        if isinstance(self.checkpoint_io, ZeroCheckpointIO):
            entry.link_of(self.checkpoint_io).release()  # its thread and group end with the run; a later save makes them again

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


def _clip_grad_by_value_on_shards(optimizer: Optimizer, clip_val: float) -> None:
    """Lightning's ``Precision.clip_grad_by_value``, on this rank's shards ([Note: clipping])."""
    _unwrap(optimizer).clip_grad_value_(clip_val)


def _clip_grad_by_global_norm(optimizer: Optimizer, clip_val: float) -> None:
    """Lightning's ``Precision.clip_grad_by_norm``, with the norm over every rank's shards
    ([Note: clipping])."""
    _unwrap(optimizer).clip_grad_norm_(clip_val)


def _unwrap(optimizer: Optimizer) -> ZeroOptimizer:
    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer._optimizer
    if not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(
            f"Expected an optimizer set up by ZeroLowLevelStrategy, got {type(optimizer).__name__}."
            " Optimizers must come from `configure_optimizers`."
        )
    return optimizer

