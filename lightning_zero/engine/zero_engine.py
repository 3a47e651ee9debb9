"""ZeroEngine: shards a module's optimized parameters evenly and wires hooks and optimizers.

Usable without Lightning (Fabric or a plain loop)::

    engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters())], ZeroConfig(stage=2))
    opt = engine.optimizers[0]
    loss = model(x).sum(); loss.backward(); opt.step(); opt.zero_grad()
    engine.finish_param_gather()  # only before reading a parameter through an old reference

With ``overlap_param_gather`` (the default) ``opt.step()`` returns with the parameter
all-gathers still running; reads through the module wait for what they touch ([Note: guarded
parameter reads]). Call :meth:`ZeroEngine.close` when done: it finishes them and removes the hooks.

[Note: accumulation] Stage 2 reduce-scatters every micro-batch and adds the result to the
fp32 shard gradient, so a full gradient never outlives its bucket (memory is the point of
stage 2). Stage 1 holds full gradients anyway, so inside :meth:`ZeroEngine.no_sync` it lets
them accumulate locally and reduces once (all-reduce on gloo, reduce-scatter where native), on
the micro-batch that ends the window. Either way the result equals one big batch.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim import Optimizer

from lightning_zero.engine import collectives as comm
from lightning_zero.engine._compat import run_at_trace_time
from lightning_zero.engine.comm_pool import BufferPool
from lightning_zero.engine.grad_bucket import (
    GradBucket,
    OwnViews,
    PresenceCounts,
    ShardedParam,
    adopt_param_writes,
)
from lightning_zero.engine.grad_reducer import GradReducer
from lightning_zero.engine.optimizer import ZeroOptimizer, refuse_compiled_shape_aware_steps
from lightning_zero.engine.optimizer_kinds import optimizer_kind
from lightning_zero.engine.param_gather import ParamGatherer, compiled_read_traced
from lightning_zero.engine.sharding import HybridLayout, assign_buckets, check_shard_group_size

if TYPE_CHECKING:
    from lightning_zero.engine.fault_tolerance import ReplicaGroups

_MB = 1024 * 1024


@dataclass(frozen=True)
class ZeroConfig:
    """How the engine shards and communicates."""

    stage: Literal[1, 2] = 2
    """1: shard optimizer state, all-reduce gradients. 2: also shard gradients (reduce-scatter)."""
    bucket_size_mb: float | None = None
    """Gradient bucket capacity in MiB of the parameters' dtype; larger buckets mean fewer,
    bigger collectives, smaller ones start communicating earlier in backward. None: scale with
    the world size, up to a ceiling (:func:`default_bucket_numel`)."""
    overlap_communication: bool = True
    """Run reductions asynchronously while backward goes on."""
    overlap_param_gather: bool = True
    """Leave the parameter all-gathers of a step running into the next forward, where each
    module waits for its own buckets ([Note: gather overlap] in param_gather.py). False: every
    gather is finished before ``step`` returns."""
    reduce_dtype: torch.dtype | str | None = None
    """The dtype gradients are reduced in (e.g. ``torch.float32`` under bf16 parameters, as
    FSDP's ``MixedPrecisionPolicy.reduce_dtype``); a name such as ``"float32"`` is accepted (YAML).
    None: the parameters' dtype."""
    shard_group_size: int | None = None
    """Shard within consecutive groups of this many ranks and replicate across the groups
    ([Note: hybrid layout] in sharding.py): gradients are reduce-scattered within the shard group,
    then the shard alone is all-reduced across the replica group; parameters are all-gathered
    within the shard group. Must divide the world size. With ``num_nodes``, the number of devices
    per node is the natural choice (shard collectives stay on the node's fast links). None: the
    whole world (the flat engine)."""

    whole_step_group_mb: float | None = 1024.0
    """Shape-aware optimizers (Muon, Adafactor: [Note: whole-matrix step] in whole_step.py) hold
    full-size fp32 copies of the parameters they step during the step; this bounds them (gradient,
    master and state, about 12 bytes an element) by stepping the parameters a group at a time. None:
    all at once. Declared shape-aware optimizers are always stepped at once."""

    full_gradients: bool = False
    """Stage 1 only: after each step's reduction every parameter's ``.grad`` also holds the whole averaged
    gradient, as under DDP, for hooks and callbacks that read it (Lightning's ``grad_norm``, a custom
    ``configure_gradient_clipping``). The reduction is then an all-reduce, also where a native
    reduce-scatter exists (twice the bytes on NCCL), and the whole gradients stay until ``zero_grad``
    (DDP's memory for them). Stage 2 cannot keep them (its point is not to); both stages offer the
    norms (``ZeroEngine.grad_norms``) and clipping on the shards."""

    release_grad_shards: bool = True
    """``zero_grad()`` frees the fp32 gradient shards (``4 Psi / N`` bytes) until the next backward's first
    reduction takes them again, so between steps a rank holds what DeepSpeed's ZeRO-2 holds: parameters,
    master shards, optimizer state ([Note: gradient shards between steps] in grad_bucket.py). Free on
    CUDA (the caching allocator hands the block back); on CPU the new allocation can cost page faults,
    fewer with ``THP_MEM_ALLOC_ENABLE=1`` (BENCHMARKS.md measures both against the step). False keeps
    them allocated (zeroed), as ``zero_grad(set_to_none=False)`` does for one call."""

    def __post_init__(self) -> None:
        validate_stage(self.stage)
        if self.full_gradients and self.stage != 1:
            raise ValueError("full_gradients=True keeps whole gradients in param.grad, which only stage 1 holds;"
                             " stage 2 frees them bucket by bucket (that is its memory saving). Use stage=1, or read"
                             " gradient norms with ZeroLowLevelStrategy.grad_norm.")
        if self.full_gradients and self.shard_group_size is not None:
            raise ValueError("full_gradients=True is not supported with hybrid sharding (shard_group_size):"
                             " the shard group's rows are not the whole world's average until the replica hop.")
        if self.shard_group_size is not None:
            check_shard_group_size(self.shard_group_size)
        if self.whole_step_group_mb is not None and not self.whole_step_group_mb > 0:
            raise ValueError(f"whole_step_group_mb must be > 0 (or None: step shape-aware optimizers' parameters"
                             f" all at once), got {self.whole_step_group_mb}")
        if self.bucket_size_mb is not None and not self.bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be > 0 (or None to scale with the world size), got"
                             f" {self.bucket_size_mb}")
        object.__setattr__(self, "reduce_dtype", _parse_dtype(self.reduce_dtype))

    def bucket_numel(self, world_size: int, element_size: int) -> int:
        """Bucket capacity in elements of ``element_size`` bytes at ``world_size`` ranks."""
        if self.bucket_size_mb is None:
            return default_bucket_numel(world_size, element_size)
        return max(1, int(self.bucket_size_mb * _MB) // element_size)


DEFAULT_BUCKET_MB = 25.0
"""The bucket floor: DDP's default, fine-grained enough to overlap backward at small world sizes."""
MIN_CHUNK_NUMEL = 1_000_000
"""Elements per rank per bucket below which a reduce-scatter/all-gather step is latency-bound."""
MAX_DEFAULT_BUCKET_MB = 256.0
"""The default bucket's ceiling in bytes: the pool holds ``MAX_IN_FLIGHT`` buckets during backward
and the step's gathers, so this bounds that transient memory whatever the world size."""


def default_bucket_numel(world_size: int, element_size: int) -> int:
    """``max(25 MiB, min(1M elements x world_size, 256 MiB))``: each rank's chunk of a bucket stays
    at least 1M elements (Megatron: ``max(40M, 1M x dp)``), so a collective is not ``world_size``
    tiny latency-bound steps, until the bucket reaches 256 MiB (128 ranks in bf16, 64 in fp32).
    Beyond, the chunk shrinks instead of the pool's ``MAX_IN_FLIGHT`` buckets growing with the world
    (``bench/scale.py`` prints the pool per rank with and without the ceiling); a larger
    ``bucket_size_mb`` can be set explicitly."""
    floor = int(DEFAULT_BUCKET_MB * _MB) // element_size
    ceiling = int(MAX_DEFAULT_BUCKET_MB * _MB) // element_size
    return max(floor, min(MIN_CHUNK_NUMEL * world_size, ceiling))


def dtype_from_name(name: str) -> torch.dtype | None:
    """``torch.float32`` from ``"float32"`` or ``"torch.float32"``; None for a name that is not a dtype."""
    value = getattr(torch, name.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else None


def _parse_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        dtype = value
    else:
        dtype = dtype_from_name(str(value))
        if dtype is None:
            raise ValueError(f"reduce_dtype {value!r} is not a torch dtype; use e.g. 'float32' or 'bfloat16'.")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"reduce_dtype must be a floating-point dtype, got {dtype}; use e.g. torch.float32.")
    return dtype


def validate_stage(stage: object) -> None:
    if stage not in (1, 2) or isinstance(stage, bool):
        raise ValueError(
            f"ZeRO stage must be 1 (sharded optimizer state) or 2 (sharded optimizer state and"
            f" gradients), got {stage!r}. Stage 3 (sharded parameters) is FSDP's job: use"
            " lightning's FSDPStrategy for it."
        )


class ZeroEngine:
    """Owns the shards, buckets, hooks and wrapped optimizers of one module."""

    def __init__(self, module: nn.Module, optimizers: Sequence[Optimizer], config: ZeroConfig,
                 group: dist.ProcessGroup | None = None, replica_groups: ReplicaGroups | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ZeroEngine needs torch.distributed to be initialized (init_process_group).")
        self.config = config
        self.group = group  # data parallel: every rank (the broadcast, the found-inf flag)
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # Validated before the first collective, the same way on every rank.
        self.layout = HybridLayout(self.world_size, config.shard_group_size or self.world_size)
        self.shard_size = self.layout.shard_group_size
        self.shard_rank = self.layout.shard_rank(self.rank)
        _reject_sparse_modules(module)
        named = _optimized_params(module, optimizers)
        kinds = [optimizer_kind(opt, index) for index, opt in enumerate(optimizers)]  # [Note: optimizer kinds]
        refuse_compiled_shape_aware_steps(optimizers, kinds)
        _broadcast_module_states(module, group)
        # The shards are disjoint within ``shard_group``; ``replica_group`` holds this rank's copies.
        self.shard_group, self.replica_group = _hybrid_groups(group, self.layout)
        # Fault tolerance: the shards are replicated across replica groups, averaged through torchft
        # ([Note: one step across groups] in fault_tolerance.py), in place of an in-job replica group.
        self.replica_groups = replica_groups
        if replica_groups is not None:
            if self.layout.num_replicas > 1:
                raise ValueError("Fault tolerance replicates across replica groups (jobs): shard_group_size must be None"
                                 " (each group shards over all of its ranks).")
            if config.full_gradients:
                raise ValueError("Fault tolerance averages each rank's shard across replica groups: full_gradients=True"
                                 " (every rank's whole gradient) is not available with it.")
            if len(optimizers) != 1:
                raise ValueError(f"Fault tolerance commits one optimizer step at a time: the module has"
                                 f" {len(optimizers)} optimizers; use one (with several parameter groups).")

        self.device = _module_device(module, group)
        self._module = module
        self.gather_group = _gather_group(self.shard_group, config, self.shard_size, group, self.layout)
        self.optimizers: list[ZeroOptimizer] = []
        self.save_cache: dict[str, Any] = {}  # what saves keep from one to the next (drop_save_caches)
        self._build(named, optimizers, kinds)

    def _build(self, named: list[tuple[str, nn.Parameter]], optimizers: Sequence[Optimizer], kinds: list[str]) -> None:
        """Buckets, shards, hooks and guards for the optimized parameters ``named``; the optimizers are
        made (the first time) or bound again (:meth:`rebuild`). No collective: the layout is arithmetic,
        the same on every rank."""
        config = self.config
        # Launch order: reverse registration order, the usual order gradients arrive in.
        trainable = [(fqn, p) for fqn, p in reversed(named) if p.requires_grad]
        frozen = [(fqn, p) for fqn, p in named if not p.requires_grad]
        self.buckets: list[GradBucket] = []
        presence = PresenceCounts(p.device for _, p in trainable)
        for members in _group_by_dtype_and_device(trainable):
            capacity = config.bucket_numel(self.shard_size, members[0][1].element_size())
            for indices in assign_buckets([p.numel() for _, p in members], self.shard_size, capacity):
                self.buckets.append(GradBucket(len(self.buckets), [members[i] for i in indices], self.layout,
                                               self.rank, presence, reduce_dtype=config.reduce_dtype))
        for members in _group_by_dtype_and_device(frozen):
            self.buckets.append(GradBucket(len(self.buckets), members, self.layout, self.rank))
        self.sharded_params: dict[nn.Parameter, ShardedParam] = {
            sp.param: sp for bucket in self.buckets for sp in bucket.params
        }
        self.pool = BufferPool()
        self.gatherer = ParamGatherer(self.buckets, self.gather_group, self.pool, config.overlap_communication,
                                      background=config.overlap_param_gather and self.shard_size > 1)
        cross = self.replica_groups
        self.reducer = GradReducer(self.buckets, config.stage, self.shard_group, config.overlap_communication,
                                   self.pool, presence,
                                   before_first_reduction=self.finish_param_gather if cross is None
                                   else self._before_cross_group_reduction,
                                   replica_group=self.replica_group if cross is None else cross,
                                   full_gradients=config.full_gradients)
        if cross is not None:
            cross.bind(self.buckets)
        if self.optimizers:
            for zero_opt in self.optimizers:
                zero_opt.bind([self.sharded_params[p] for g in zero_opt.param_groups for p in g["params"]],
                              self.reducer, self.gatherer)
        else:
            self.optimizers = [
                ZeroOptimizer(
                    opt,
                    [self.sharded_params[p] for g in opt.param_groups for p in g["params"]],
                    self.shard_group,  # the global norm: replicas hold equal shards, each counts once
                    self.reducer,
                    self.gatherer,
                    self.device,
                    config.overlap_param_gather,
                    shape_aware=kind == "shape_aware",
                    whole_step_group_bytes=None if config.whole_step_group_mb is None
                    else int(config.whole_step_group_mb * _MB),
                    release_grad_shards=config.release_grad_shards,
                )
                for opt, kind in zip(optimizers, kinds, strict=True)
            ]
        for zero_opt in self.optimizers:
            zero_opt.groups_changed = self.rebuild
        self._guarded = _guard_parameter_reads(self._module, self.sharded_params, self.gatherer) \
            if config.overlap_param_gather else []

    @torch.no_grad()
    def grad_norms(self, norm_type: float = 2.0) -> dict[str, Tensor]:
        """(collective over the shard group) Each parameter's gradient norm, as one process would compute
        it from the whole averaged gradient, for the parameters some rank produced a gradient for.

        Neither stage keeps whole gradients in ``param.grad`` (stage 2 frees them bucket by bucket, stage
        1 moves them into the reduction buffers): the norm comes from every rank's shard, one small
        all-reduce. Read after backward and before the step (Lightning's ``on_before_optimizer_step``)."""
        self.gatherer.finish()
        self.reducer.resolve_presence()
        present = [sp for sp in self.sharded_params.values() if sp.has_grad]
        if not present:
            return {}
        if norm_type == math.inf:
            local = torch.stack([sp.grad_shard.abs().max() if sp.shard_numel else sp.grad_shard.new_zeros(())
                                 for sp in present]).float()
            norms = comm.all_reduce_(local, self.shard_group, dist.ReduceOp.MAX)
        else:
            local = torch.stack([sp.grad_shard.float().abs().pow(norm_type).sum() for sp in present])
            norms = comm.all_reduce_(local, self.shard_group).pow(1.0 / norm_type)
        return {sp.fqn: norm for sp, norm in zip(present, norms.unbind(0), strict=True)}

    def trainable_changed(self) -> bool:
        """Whether a parameter an optimizer holds was frozen or unfrozen since the buckets were built."""
        return any(sp.param.requires_grad != sp.bucket.communicates for sp in self.sharded_params.values())

    @torch.no_grad()
    def rebuild(self) -> None:
        """Build the buckets again for what the optimizers hold now and which parameters require grad,
        keeping every master shard and optimizer state (every rank alike, between steps).

        [Note: rebuilding] Which parameters communicate, in which bucket and order, is fixed when the
        buckets are built; fine-tuning callbacks change it during fit (BaseFinetuning unfreezes a backbone
        and adds it to the optimizer with ``add_param_group``). Each rank rebuilds from the same
        arithmetic, with no collective (the process groups stay); the masters and the optimizer state of
        the parameters held before move to their new shards (the same even split: the same shapes).
        Gradients accumulated and not yet stepped are dropped: Lightning calls these hooks between steps."""
        self.finish_param_gather()
        self.drop_save_caches()
        previous = dict(self.sharded_params)
        self.reducer.remove_hooks()
        _unguard_parameter_reads(self._guarded)
        self.pool.clear()
        inner = [opt.inner for opt in self.optimizers]
        named = _optimized_params(self._module, inner)
        self._build(named, inner, [])
        for param, sp in self.sharded_params.items():
            before = previous.get(param)
            if before is None:
                continue  # newly added: the master is the module's value, no state yet
            sp.master.copy_(before.master)
            sp.adopted_version = before.adopted_version
            sp.split_state_keys = before.split_state_keys
            for opt in self.optimizers:
                if before.master in opt.state:
                    opt.state[sp.master] = opt.state.pop(before.master)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The module's parameters by name, as ``module.named_parameters()`` gives them, without
        waiting for the step's parameter gathers ([Note: guarded parameter reads]): for what needs
        the parameter objects, not their gathered values (a checkpoint's sharded weights are the
        masters). Reading a sharded one's value needs ``finish_param_gather()``."""
        # nn.Module's own walk (dedup of tied weights, naming), reading each ``_parameters`` with
        # dict.items: the guarded dict's items() finishes every gather.
        return list(self._module._named_members(lambda module: dict.items(module._parameters)))

    @property
    def optimizer_shard_numel(self) -> int:
        """Real parameter elements whose master copy and optimizer state this rank holds
        (about 1/``shard_group_size`` of the model)."""
        return sum(opt.shard_numel for opt in self.optimizers)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.reducer.no_sync():
            yield

    def ensure_flushed(self) -> None:
        self.reducer.ensure_flushed()

    def _before_cross_group_reduction(self) -> None:
        self.finish_param_gather()
        assert self.replica_groups is not None
        self.replica_groups.before_reduction()

    def module_buffers(self) -> list[Tensor]:
        """The module's buffers (the same on every rank: broadcast before each forward)."""
        return list(self._module.buffers())

    def finish_param_gather(self) -> None:
        """Finish every pending parameter all-gather, so the model holds the updated weights.

        Reads through the module (attribute access, ``parameters()``, ``state_dict()``: see
        [Note: guarded parameter reads]), the next backward and the next step call this
        themselves; call it before reading a parameter through a reference taken before the
        step. Idempotent, and a cheap no-op when nothing is pending."""
        self.gatherer.finish()

    @torch.no_grad()
    def refresh_masters_from_params(self) -> None:
        """Re-read the master shards from the model (after the model's weights were loaded)."""
        self.finish_param_gather()  # a late gather must not overwrite the loaded weights
        for sp in self.sharded_params.values():
            sp.load_master_from(sp.param.detach())
            sp.adopted_version = sp.param._version

    @torch.no_grad()
    def adopt_module_writes(self, compare_values: bool = True) -> None:
        """Take weights written into the module's parameters into the master shards.

        [Note: the module is the truth] Between steps the module's parameters are what users,
        callbacks and Lightning read and write (a hook setting weights, ``load_state_dict``,
        StochasticWeightAveraging's transfer, EMA's copy); the masters are the engine's private,
        higher-precision copy. Every optimizer step first takes in-place writes into the masters
        (:meth:`ZeroOptimizer.adopt_module_writes`): the parameter's autograd version counter moves
        on ``copy_``/``load_state_dict``/in-place ops and not on the engine's own gathers (written
        through ``.data``), so nothing is done per step when nothing was written. Writes through
        ``.data`` leave the version as it was; they are found by comparing values
        (``compare_values=True``), which the strategy does where Lightning runs user code between
        steps (train start and end, after validation, before a save). Elements equal to the master
        in the parameter's dtype keep the master, so a bf16 model keeps its fp32 masters untouched.
        Frozen parameters are covered here (their masters are checkpointed).

        The caller makes sure no save is still copying the masters."""
        if compare_values or any(sp.param._version != sp.adopted_version for sp in self.sharded_params.values()):
            # A written parameter was read through its module, which finished its gather; the
            # others must hold the last gather before their values are compared.
            self.finish_param_gather()
        adopt_param_writes(self.sharded_params.values(), compare_values, self.save_cache.setdefault("views", OwnViews()))

    def broadcast_buffers(self) -> None:
        """(collective over the engine's group) Rank 0's buffers on every rank: DDP's ``broadcast_buffers``
        before each training forward, and a load's buffers."""
        comm.broadcast_from_first(list(self._module.buffers()), self.group)

    def publish_masters(self) -> None:
        """All-gather every master shard into the model (after the masters were loaded)."""
        for opt in self.optimizers:
            opt.gather_params(all_buckets=True)

    def grad_scaler(self, init_scale: float = 2.0**16, **kwargs: float) -> torch.amp.GradScaler:
        """A dynamic loss scaler for fp16 whose inf/NaN check is all-reduced over this engine's
        ranks, so all ranks skip a step together and back off the scale together."""
        return ShardScaler(device=self.device.type, init_scale=init_scale, process_group=self.group, **kwargs)

    def close(self) -> None:
        """Finish pending gathers, remove every hook and free the communication buffers."""
        self.finish_param_gather()
        self.drop_save_caches()
        self.reducer.remove_hooks()
        _unguard_parameter_reads(self._guarded)
        self._guarded = []
        self.pool.clear()
        self._destroy_own_groups()

    def drop_save_caches(self) -> None:
        """Let go of what saves keep from one to the next (tensors a load, a rebuild or teardown replaces)."""
        self.save_cache.clear()
        for opt in self.optimizers:
            opt.save_cache = None

    def _destroy_own_groups(self) -> None:
        """End the process groups this engine created (the gathers' group, the hybrid groups), once.

        A group left alive to interpreter exit is torn down by gloo's destructor there, with its
        worker threads, after Python has started finalizing: a finished run then sometimes died with
        "terminate called without an active exception". Repeated fits in one process would also
        accumulate one gather group per fit."""
        shared = {id(self.group)}
        for pg in dict.fromkeys([self.gather_group, self.shard_group, self.replica_group]):
            if pg is None or id(pg) in shared or pg == dist.GroupMember.NON_GROUP_MEMBER:
                continue
            if dist.is_initialized():
                dist.destroy_process_group(pg)
        # Nothing communicates on them any more: the engine keeps its state for a save after fit.
        self.gather_group = self.shard_group = self.replica_group = self.group
        self.gatherer.group = self.group


class ShardScaler(ShardedGradScaler):
    """FSDP's sharded loss scaler, unscaling the gradients a :class:`ZeroOptimizer` steps: its master shards.

    A scaler finds the gradients through ``optimizer.param_groups``, which show the module's parameters
    ([Note: wrapping the user's optimizer] in optimizer.py), whose ``.grad`` the engine does not keep;
    for the unscale (and its inf/NaN check) the masters are in the groups."""

    def unscale_(self, optimizer: Optimizer) -> None:
        swap = getattr(optimizer, "masters_in_groups", None)
        with swap() if swap is not None else contextlib.nullcontext():
            super().unscale_(optimizer)


def _optimized_params(module: nn.Module, optimizers: Sequence[Optimizer]) -> list[tuple[str, nn.Parameter]]:
    """The module's parameters that some optimizer holds, in registration order, validated."""
    names = {p: fqn for fqn, p in module.named_parameters()}  # tied weights appear once
    owner: dict[nn.Parameter, int] = {}
    for opt_index, opt in enumerate(optimizers):
        for group_index, group in enumerate(opt.param_groups):
            for p in group["params"]:
                if p not in names:
                    raise ValueError(
                        f"Optimizer {opt_index} ({type(opt).__name__}), param group {group_index}, holds a"
                        f" parameter of shape {tuple(p.shape)} that is not a parameter of the model."
                        " Build the optimizer over the model's own parameters (self.parameters())."
                    )
                if p in owner:
                    raise ValueError(
                        f"Parameter {names[p]!r} is in optimizer {owner[p]} and optimizer {opt_index}."
                        " Each parameter may belong to one optimizer only."
                    )
                if not p.is_contiguous():
                    raise ValueError(
                        f"Parameter {names[p]!r} is not contiguous; call .contiguous() on it before setup."
                    )
                owner[p] = opt_index
    return [(fqn, p) for p, fqn in names.items() if p in owner]


def _reject_sparse_modules(module: nn.Module) -> None:
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            raise ValueError(
                f"Module {name!r} produces sparse gradients (sparse=True), which ZeRO cannot shard evenly."
                " Construct it with sparse=False."
            )


def _group_by_dtype_and_device(
    named: list[tuple[str, nn.Parameter]],
) -> list[list[tuple[str, nn.Parameter]]]:
    groups: dict[tuple[torch.dtype, torch.device], list[tuple[str, nn.Parameter]]] = {}
    for fqn, p in named:
        groups.setdefault((p.dtype, p.device), []).append((fqn, p))
    return list(groups.values())


@torch.no_grad()
def _broadcast_module_states(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Start every rank from rank 0's parameters and buffers, as DDP does."""
    if dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=src, group=group)


def _module_device(module: nn.Module, group: dist.ProcessGroup | None) -> torch.device:
    """Where the engine's own small tensors go when no bucket says: the module's device, or the
    process group's for a module without tensors (never an assumed CPU)."""
    for tensor in [*module.parameters(), *module.buffers()]:
        return tensor.device
    return comm.group_device(group)


def _hybrid_groups(group: dist.ProcessGroup | None,
                   layout: HybridLayout) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(shard group, replica group) of this rank; ``(group, None)`` for the flat engine.

    ``new_group`` is collective over the default group: every rank creates every shard group,
    then every replica group, in the same order ([Note: hybrid layout] in sharding.py)."""
    if layout.is_flat:
        return group, None
    return _own_group(group, layout.shard_groups()), _own_group(group, layout.replica_groups())


def _own_group(group: dist.ProcessGroup | None, rank_lists: list[list[int]]) -> dist.ProcessGroup | None:
    """Create one process group per list of ``group`` ranks (every rank creates all); return this rank's."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    me = dist.get_rank(group)
    own = None
    for members in rank_lists:
        created = comm.new_group([ranks[r] for r in members], dist.get_backend(group))
        if me in members:
            own = created
    return own


def _gather_group(group: dist.ProcessGroup | None, config: ZeroConfig, world_size: int,
                  dp_group: dist.ProcessGroup | None = None,
                  layout: HybridLayout | None = None) -> dist.ProcessGroup | None:
    """The process group the parameter all-gathers run on ([Note: gather overlap] in param_gather.py).

    With ``overlap_param_gather`` the gathers are issued whenever a forward gets to them, which
    differs between ranks whose forwards differ (a skipped layer); any other collective on the
    same group in between (a ``sync_dist`` log, SyncBatchNorm) would then be matched against a
    gather on another rank. A group of the same ranks for the gathers alone keeps both sequences
    identical on every rank. ``new_group`` is collective over the default group: the engine is
    built on every rank, as the strategy does.
    """
    if not config.overlap_param_gather or world_size == 1:
        return group
    if layout is not None and not layout.is_flat:  # a copy of every shard group, made on every rank
        return _own_group(dp_group, layout.shard_groups())
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    return comm.new_group(ranks, dist.get_backend(group))


class _GuardedParameters(dict):  # type: ignore[type-arg]
    """A module's ``_parameters`` that finishes pending gathers before handing a parameter out.

    [Note: guarded parameter reads] Every way to a parameter through its module goes through
    this dict: ``module.weight`` (``nn.Module.__getattr__``: ``__getitem__``), ``parameters()``,
    ``named_parameters()``, ``state_dict()``, ``load_state_dict()``, ``to()`` (``items()``). An
    attribute read waits only for the bucket holding that parameter (and, being in order, the
    ones before it), so a forward waits exactly as far as it has got: this is the forward
    pre-hook of Megatron's ``overlap_param_gather`` at the finest grain, and it also
    covers reads no pre-hook sees (``nn.MultiheadAttention`` passing ``out_proj.weight`` to a
    functional call without calling ``out_proj``; a parameter of the LightningModule itself used
    in ``training_step``, which is not a ``forward``). Iterating finishes every gather. Only a
    reference taken before the step and read after it bypasses this: call
    :meth:`ZeroEngine.finish_param_gather` first (or set ``overlap_param_gather=False``).
    """

    __slots__ = ("_gatherer", "_positions")

    def __init__(self, params: dict[str, nn.Parameter | None], gatherer: ParamGatherer,
                 positions: dict[str, int]) -> None:
        super().__init__(params)
        self._gatherer = gatherer
        self._positions = positions  # name -> gather position of the parameter's bucket

    def __getitem__(self, name: str) -> nn.Parameter | None:
        if torch.compiler.is_compiling():  # nothing the graph would be guarded on: [Note: compiled reads]
            run_at_trace_time(compiled_read_traced)
            return dict.__getitem__(self, name)
        gatherer = self._gatherer
        if gatherer.pending:
            gatherer.wait_for(self._positions.get(name, -1))
        return dict.__getitem__(self, name)

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self else default

    def items(self) -> Any:
        self._gatherer.finish()
        return dict.items(self)

    def values(self) -> Any:
        self._gatherer.finish()
        return dict.values(self)

    def copy(self) -> dict[str, nn.Parameter | None]:
        self._gatherer.finish()
        return dict.copy(self)

    def __reduce__(self) -> Any:
        # A pickled or deep-copied module gets a plain dict with the finished values.
        return (dict, (self.copy(),))


def _guard_parameter_reads(module: nn.Module, sharded: dict[nn.Parameter, ShardedParam],
                           gatherer: ParamGatherer) -> list[nn.Module]:
    """Install :class:`_GuardedParameters` on every module holding a sharded parameter."""
    guarded = []
    for sub in module.modules():
        params = sub._parameters
        positions = {name: gatherer.positions[sharded[p].bucket] for name, p in params.items() if p in sharded}
        if positions and not isinstance(params, _GuardedParameters):
            sub.__dict__["_parameters"] = _GuardedParameters(params, gatherer, positions)
            guarded.append(sub)
    return guarded


def _unguard_parameter_reads(modules: list[nn.Module]) -> None:
    for sub in modules:
        params = sub._parameters
        if isinstance(params, _GuardedParameters):
            sub.__dict__["_parameters"] = dict.copy(params)
