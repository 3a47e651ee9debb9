"""ZeroEngine: shards a module's optimized parameters evenly and wires hooks and optimizers.

Usable without Lightning (Fabric or a plain loop)::

    engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters())], ZeroConfig(stage=2))
    opt = engine.optimizers[0]
    loss = model(x).sum(); loss.backward(); opt.step(); opt.zero_grad()

[Note: accumulation] Stage 2 reduce-scatters every micro-batch and adds the result to the
fp32 shard gradient, so a full gradient never outlives its bucket (memory is the point of
stage 2). Stage 1 holds full gradients anyway, so inside :meth:`ZeroEngine.no_sync` it lets
them accumulate locally and all-reduces once, on the micro-batch that ends the window.
Either way the result equals one big batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_zero.buckets import GradBucket, GradReducer, ShardedParam
from lightning_zero.optimizer import ZeroOptimizer
from lightning_zero.sharding import assign_buckets

_MB = 1024 * 1024


@dataclass(frozen=True)
class ZeroConfig:
    """How the engine shards and communicates."""

    stage: Literal[1, 2] = 2
    """1: shard optimizer state, all-reduce gradients. 2: also shard gradients (reduce-scatter)."""
    bucket_size_mb: float = 25.0
    """Gradient bucket capacity in MiB of the parameters' dtype; larger buckets mean fewer,
    bigger collectives, smaller ones start communicating earlier in backward."""
    overlap_communication: bool = True
    """Run reductions asynchronously while backward goes on."""

    def __post_init__(self) -> None:
        validate_stage(self.stage)
        if not self.bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be > 0, got {self.bucket_size_mb}")


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
                 group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ZeroEngine needs torch.distributed to be initialized (init_process_group).")
        self.config = config
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        _reject_sparse_modules(module)
        named = _optimized_params(module, optimizers)
        _broadcast_module_states(module, group)

        # Launch order: reverse registration order, the usual order gradients arrive in.
        trainable = [(fqn, p) for fqn, p in reversed(named) if p.requires_grad]
        frozen = [(fqn, p) for fqn, p in named if not p.requires_grad]
        self.buckets: list[GradBucket] = []
        for members in _group_by_dtype_and_device(trainable):
            capacity = max(1, int(config.bucket_size_mb * _MB) // members[0][1].element_size())
            for indices in assign_buckets([p.numel() for _, p in members], self.world_size, capacity):
                self.buckets.append(GradBucket(len(self.buckets), [members[i] for i in indices],
                                               self.world_size, self.rank))
        for members in _group_by_dtype_and_device(frozen):
            self.buckets.append(GradBucket(len(self.buckets), members, self.world_size, self.rank,
                                           communicates=False))
        self.sharded_params: dict[nn.Parameter, ShardedParam] = {
            sp.param: sp for bucket in self.buckets for sp in bucket.params
        }
        self.reducer = GradReducer(self.buckets, config.stage, group, config.overlap_communication)
        self.optimizers = [
            ZeroOptimizer(
                opt,
                [self.sharded_params[p] for g in opt.param_groups for p in g["params"]],
                group,
                config.overlap_communication,
            )
            for opt in optimizers
        ]

    @property
    def optimizer_shard_numel(self) -> int:
        """Real parameter elements whose master copy and optimizer state this rank holds."""
        return sum(opt.shard_numel for opt in self.optimizers)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.reducer.no_sync():
            yield

    def ensure_flushed(self) -> None:
        self.reducer.ensure_flushed()

    @torch.no_grad()
    def refresh_masters_from_params(self) -> None:
        """Re-read the master shards from the model (after the model's weights were loaded)."""
        for sp in self.sharded_params.values():
            sp.load_master_from(sp.param.detach())

    def publish_masters(self) -> None:
        """All-gather every master shard into the model (after the masters were loaded)."""
        for opt in self.optimizers:
            opt.gather_params(all_buckets=True)

    def grad_scaler(self, init_scale: float = 2.0**16, **kwargs: float) -> torch.amp.GradScaler:
        """A dynamic loss scaler for fp16 whose inf/NaN check is all-reduced over this engine's
        ranks, so all ranks skip a step together and back off the scale together."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        device = self.buckets[0].device.type if self.buckets else "cpu"
        return ShardedGradScaler(device=device, init_scale=init_scale, process_group=self.group, **kwargs)

    def close(self) -> None:
        self.reducer.remove_hooks()


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
