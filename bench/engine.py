"""Engine benchmark: ZeRO-1/ZeRO-2 against DDP, DDP + ZeroRedundancyOptimizer and FSDP SHARD_GRAD_OP.

Every method trains the same GPT-style model on the same global batches with AdamW, side by
side in one run, on CPU processes over gloo (127.0.0.1). Per method and world size it reports
the median step time, the optimizer-state bytes each rank holds (and their balance over ranks),
the gradient bytes each rank holds after backward, and the loss after the last step (equal
losses show the methods computed the same thing). It then prints PASS/FAIL against the targets
and, computed from the layout rules rather than measured, the balance at 8 ranks.

Our engine is driven directly (``ZeroEngine`` and the loop the Lightning strategy runs:
forward, backward, ``engine.ensure_flushed()``, ``opt.step()``, ``opt.zero_grad()``), and the
baselines are the plain PyTorch wrappers behind Lightning's ``ddp`` and
``FSDPStrategy(sharding_strategy="SHARD_GRAD_OP")``, so the numbers measure the engines and not
Lightning's training loop.

[Note: interleaving] All methods live in the same processes and take turns (a "round" is
one turn of each, in an order rotated every round). A load spike from another process on a shared
2-core machine then lands on all methods alike, and the step-time ratios are taken within a round
before the median, which is far steadier than timing each method in its own long block of steps.

[Note: honest turns] A turn is a few consecutive steps of one method, timed as one block, and it
ends with the work those steps left running: our engine's overlapped parameter gathers run on a
thread into the next forward, so a turn of one step would either bill them to the next method (they
run while it is timed) or never overlap them. Within a turn each gather overlaps the next step's
forward, as in training; the last one is finished (``Method.finish``) inside the timed block. A
method that still has background work after its turn is counted, and the report fails it.

Usage::

    .venv/bin/python bench/engine.py                      # world sizes 2 and 4 (make bench)
    .venv/bin/python bench/engine.py --quick              # small model, few rounds: a smoke run
    .venv/bin/python bench/engine.py --world-sizes 2 --rounds 20 --methods ddp zero2

The markdown report goes to stdout and to ``bench/out/engine.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import (
    BACKEND,
    PeakRSS,
    describe_machine,
    file_backed_bytes,
    held_bytes,
    load_average,
    muon_with_adamw,
    release_free_memory,
    run_on_ranks,
)
from torch import Tensor, nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import AdamW, Optimizer

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.comm_pool import MAX_IN_FLIGHT
from lightning_zero.engine.sharding import EvenShard

OUT_DIR = Path(__file__).resolve().parent / "out"
METHODS = ("ddp", "zero1", "zero2", "ddp+zero_redundancy", "fsdp_shard_grad_op")
HYBRID_SHARD_GROUP_SIZE = 2
HYBRID = f"zero2_hybrid{HYBRID_SHARD_GROUP_SIZE}"
"""ZeRO-2 sharded within groups of 2 ranks, replicated across them (``shard_group_size=2``)."""
GRADS_KEPT = "zero2_grads_kept"
"""ZeRO-2 with ``release_grad_shards=False``: the gradient shards stay allocated between steps (an
A/B row, only with ``--methods``: what freeing them costs in step time, [Note: gradient shards
between steps] in engine/grad_bucket.py)."""


def methods_for(world_size: int, selected: Sequence[str] = (), peers: bool = False) -> tuple[str, ...]:
    """The hybrid row only where it differs from flat zero2: 2+ shard groups of 2 (world size 4: 2 x 2).
    ``selected``: only these (all when empty); ``peers``: with DeepSpeed's rows."""
    hybrid = world_size > HYBRID_SHARD_GROUP_SIZE and world_size % HYBRID_SHARD_GROUP_SIZE == 0
    names = METHODS + ((HYBRID,) if hybrid else ()) + ((GRADS_KEPT,) if GRADS_KEPT in selected else ()) \
        + (PEERS if peers else ())
    return tuple(n for n in names if not selected or n in selected)
PHASES = ("forward", "backward", "step", "zero_grad", "drain")
"""Per step; *drain*: finishing, at the end of a turn, what the turn's steps left running."""
MIB = 1024 * 1024

# The targets. Every check below uses these names, so the printed report and the code agree.
STATE_VS_EVEN_SHARE_TOLERANCE = 0.01
MAX_BALANCE = 1.001
MAX_ZERO2_VS_DDP = 1.04
GATHER_PEAK_SLACK_MIB = 2
"""Beyond the pool's slots: the gathers' inputs (a bf16 copy of the shard) and the allocator's rounding."""
MAX_RESIDENT_VS_FORMULA = 1.1
"""zero1/zero2: resident per rank between steps over the ZeRO paper's model-state formula."""


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_heads = config.n_heads
        self.ln_attn = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.attn_out = nn.Linear(d, d)
        self.ln_mlp = nn.LayerNorm(d)
        self.mlp_in = nn.Linear(d, 4 * d)
        self.mlp_out = nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, d = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).split(d, dim=2)
        q, k, v = (t.view(batch, seq, self.n_heads, d // self.n_heads).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(attn.transpose(1, 2).reshape(batch, seq, d))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.ln_mlp(x))))


class GPT(nn.Module):
    """Token and position embeddings, transformer blocks, final LayerNorm, tied LM head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_final = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # Tied as in GPT-2: one parameter used twice, which every method must handle.
        self.lm_head.weight = self.token_embedding.weight
        # GPT-2's initialization; with PyTorch's N(0, 1) embeddings the tied head would start
        # with logits of std ~sqrt(d_model) and a loss far above log(vocab).
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_final(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_model(config: GPTConfig, seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


@dataclass(frozen=True)
class BenchSettings:
    model: GPTConfig
    batch_size: int
    """Sequences per rank per step."""
    warmup_rounds: int
    timed_rounds: int
    """Rounds of one turn per method; see [Note: interleaving]."""
    steps_per_turn: int
    """Consecutive steps of one method, timed as one block with what they leave running ([Note: honest turns])."""
    bucket_size_mb: float
    """Our engine's bucket capacity (25: its floor, DDP's default)."""
    methods: tuple[str, ...] = ()
    """The methods to run (DDP always among them); empty: all."""
    peers: bool = False
    """Add DeepSpeed ZeRO-1/2 (installed by ``make bench-peers``)."""
    lr: float = 1e-3
    weight_decay: float = 0.1
    seed: int = 1234
    optimizer: Literal["adamw", "muon"] = "adamw"
    """``muon``: Muon for the blocks' matrices and AdamW for the rest (``_common.muon_with_adamw``), in the
    methods that take it (``MUON_METHODS``); the AdamW-formula targets are then left out."""


FULL = BenchSettings(
    model=GPTConfig(vocab_size=8192, seq_len=64, d_model=384, n_layers=4, n_heads=6),
    batch_size=2, warmup_rounds=1, timed_rounds=12, steps_per_turn=3, bucket_size_mb=25.0,
)
QUICK = BenchSettings(
    model=GPTConfig(vocab_size=2048, seq_len=32, d_model=128, n_layers=2, n_heads=4),
    batch_size=2, warmup_rounds=1, timed_rounds=4, steps_per_turn=2, bucket_size_mb=25.0,
)


MUON_METHODS = ("ddp", "zero1", "zero2", HYBRID)
"""The methods ``--optimizer muon`` runs: the others split or partition parameters in ways Muon cannot
step (FSDP's flat parameters, DeepSpeed's flat partitions) or take one optimizer class."""


def make_optimizers(model: GPT, settings: BenchSettings) -> list[Optimizer]:
    if settings.optimizer == "muon":
        return muon_with_adamw(model)
    return [AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)]


class OptimizerSet:
    """Several optimizers stepped as one (Muon and AdamW), with the verbs ``Method`` calls."""

    def __init__(self, optimizers: Sequence[Any]) -> None:
        self.optimizers = list(optimizers)

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def state(self) -> dict[Any, Any]:
        return {key: value for optimizer in self.optimizers for key, value in optimizer.state.items()}


def tensor_bytes(tensors: Sequence[Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Every tensor in ``optimizer.state`` (AdamW: exp_avg, exp_avg_sq and the step counter)."""
    return tensor_bytes([v for state in optimizer.state.values() for v in state.values() if isinstance(v, Tensor)])


def unsharded_state_bytes(model: nn.Module, with_master: bool) -> int:
    """What one process running AdamW over the whole model holds: two fp32 moments and a
    float32 step tensor per parameter, plus an fp32 master copy for methods that keep one."""
    params = list(model.parameters())  # tied weights appear once
    numel = sum(p.numel() for p in params)
    step_bytes = torch.zeros((), dtype=torch.float32).element_size() * len(params)
    return 2 * 4 * numel + step_bytes + (4 * numel if with_master else 0)


class Method:
    """A training method wrapped around a fresh model: the loop calls the same verbs on each."""

    name: str
    keeps_fp32_master = False

    def __init__(self, module: nn.Module, optimizer: Optimizer | OptimizerSet) -> None:
        self.module = module
        self.optimizer = optimizer

    def flush(self) -> None:
        """Called right after ``backward`` (our engine's reductions are waited for here)."""

    def backward(self, loss: Tensor) -> None:
        loss.backward()
        self.flush()

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def finish(self) -> None:
        """Complete work the steps left running (our overlapped gathers): at the end of each timed
        turn ([Note: honest turns]) and before memory is measured."""

    def background_work(self) -> bool:
        """Whether work this method started is still running (its turn must not end so)."""
        return False

    def gather_peak(self) -> int:
        """Peak RSS growth of the step's parameter all-gathers alone (0 where there are none)."""
        return 0

    def pool_bytes(self) -> int:
        """Communication buffers held during backward and the step (our engine's pool)."""
        return 0

    def state_bytes(self) -> int:
        return optimizer_state_bytes(self.optimizer)

    def master_bytes(self) -> int:
        return 0

    def grad_bytes(self) -> int:
        return tensor_bytes([p.grad for p in self.module.parameters()])

    def shard_numel(self) -> int:
        """Parameter elements whose optimizer state this rank holds."""
        return sum(p.numel() for p in self.optimizer.state)


class ZeroMethod(Method):
    keeps_fp32_master = True

    def __init__(self, model: GPT, settings: BenchSettings, stage: int, shard_group_size: int | None = None,
                 keep_grads: bool = False) -> None:
        self.name = GRADS_KEPT if keep_grads else f"zero{stage}" + (f"_hybrid{shard_group_size}" if shard_group_size else "")
        config = ZeroConfig(stage=stage, bucket_size_mb=settings.bucket_size_mb, overlap_communication=True,
                            overlap_param_gather=True, shard_group_size=shard_group_size,
                            release_grad_shards=not keep_grads)
        self.engine = ZeroEngine(model, make_optimizers(model, settings), config)
        optimizers = self.engine.optimizers
        super().__init__(model, optimizers[0] if len(optimizers) == 1 else OptimizerSet(optimizers))

    def flush(self) -> None:
        self.engine.ensure_flushed()

    def finish(self) -> None:
        self.engine.finish_param_gather()

    def background_work(self) -> bool:
        gatherer = self.engine.gatherer
        thread = gatherer._thread  # the CPU gather program ([Note: gather overlap] in engine/param_gather.py)
        return gatherer.pending or (thread is not None and thread.is_alive())

    def gather_peak(self) -> int:
        # The same bucketed, bounded gathers the step runs, on their own: the step's peak also
        # holds the inner AdamW's temporaries (torch's foreach path allocates shard-sized ones).
        release_free_memory()
        with PeakRSS() as peak:
            self.engine.publish_masters()
        return peak.growth

    def pool_bytes(self) -> int:
        return self.engine.pool.high_water_bytes

    def master_bytes(self) -> int:
        # The allocated flat buffers, padding included: that is what the rank holds.
        return tensor_bytes([b.master_shard for b in self.engine.buckets])

    def state_bytes(self) -> int:
        return optimizer_state_bytes(self.optimizer) + self.master_bytes()

    def grad_bytes(self) -> int:
        # fp32 shard gradients (padding included) plus any full gradient still alive.
        return tensor_bytes([b.grad_shard for b in self.engine.buckets if b.holds_grad_shard]) + super().grad_bytes()

    def shard_numel(self) -> int:
        return self.engine.optimizer_shard_numel


class DDPMethod(Method):
    name = "ddp"

    def __init__(self, model: GPT, settings: BenchSettings) -> None:
        optimizers = make_optimizers(model, settings)
        super().__init__(DDP(model), optimizers[0] if len(optimizers) == 1 else OptimizerSet(optimizers))


class ZeroRedundancyMethod(Method):
    name = "ddp+zero_redundancy"

    def __init__(self, model: GPT, settings: BenchSettings) -> None:
        ddp = DDP(model)
        optimizer = ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=AdamW, lr=settings.lr, weight_decay=settings.weight_decay
        )
        super().__init__(ddp, optimizer)
        self.zero_redundancy = optimizer

    def state_bytes(self) -> int:
        # The local optimizer holds this rank's partition; the wrapper's own `state` is filled
        # only by consolidate_state_dict.
        return optimizer_state_bytes(self.zero_redundancy.optim)

    def shard_numel(self) -> int:
        return sum(p.numel() for g in self.zero_redundancy.optim.param_groups for p in g["params"])


class FSDPMethod(Method):
    name = "fsdp_shard_grad_op"

    def __init__(self, model: GPT, settings: BenchSettings) -> None:
        # What Lightning's FSDPStrategy(sharding_strategy="SHARD_GRAD_OP", auto_wrap_policy={Block})
        # builds, with use_orig_params=True (its default). Lightning passes device_id=None on
        # CPU, which FSDP in this torch rejects ("needs a non-CPU accelerator device") unless
        # the device is named, so it is named here.
        fsdp = FSDP(
            model,
            sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )
        super().__init__(fsdp, AdamW(fsdp.parameters(), lr=settings.lr, weight_decay=settings.weight_decay))


PEERS = ("deepspeed_zero1", "deepspeed_zero2")
"""Optional rows (``--peers``, ``make bench-peers``): DeepSpeed ZeRO-1/2 on its CPU accelerator."""


class DeepSpeedMethod(Method):
    """DeepSpeed ZeRO-1/2 (``DS_ACCELERATOR=cpu``), the same AdamW and bucket size as our engine."""

    keeps_fp32_master = True

    def __init__(self, model: GPT, settings: BenchSettings, stage: int) -> None:
        import os

        import deepspeed

        self.name = f"deepspeed_zero{stage}"
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))  # DeepSpeed asks for it; one node
        deepspeed.init_distributed(dist_backend=BACKEND)  # adopts the process group already set up
        bucket_numel = int(settings.bucket_size_mb * MIB) // 4
        config = {
            "train_micro_batch_size_per_gpu": settings.batch_size, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket_numel,
                                  "allgather_bucket_size": bucket_numel, "overlap_comm": True,
                                  "contiguous_gradients": True},
        }
        inner = AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
        self.engine, self.zero, _, _ = deepspeed.initialize(model=model, optimizer=inner, config=config)
        super().__init__(self.engine, inner)

    def backward(self, loss: Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self) -> None:
        pass  # the engine's step zeroes its gradients

    def _partitions(self) -> list[Tensor]:
        return list(self.zero.single_partition_of_fp32_groups)

    def master_bytes(self) -> int:
        return tensor_bytes(self._partitions())

    def state_bytes(self) -> int:
        return optimizer_state_bytes(self.zero.optimizer) + self.master_bytes()

    def shard_numel(self) -> int:
        return sum(t.numel() for t in self._partitions())


def build_method(name: str, settings: BenchSettings) -> Method:
    if settings.optimizer == "muon" and name not in MUON_METHODS:
        raise ValueError(f"--optimizer muon runs {', '.join(MUON_METHODS)}, not {name}: pick --methods among them")
    model = build_model(settings.model, settings.seed)
    builders: dict[str, Callable[[], Method]] = {
        "ddp": lambda: DDPMethod(model, settings),
        "zero1": lambda: ZeroMethod(model, settings, stage=1),
        "zero2": lambda: ZeroMethod(model, settings, stage=2),
        HYBRID: lambda: ZeroMethod(model, settings, stage=2, shard_group_size=HYBRID_SHARD_GROUP_SIZE),
        GRADS_KEPT: lambda: ZeroMethod(model, settings, stage=2, keep_grads=True),
        "ddp+zero_redundancy": lambda: ZeroRedundancyMethod(model, settings),
        "fsdp_shard_grad_op": lambda: FSDPMethod(model, settings),
        "deepspeed_zero1": lambda: DeepSpeedMethod(model, settings, stage=1),
        "deepspeed_zero2": lambda: DeepSpeedMethod(model, settings, stage=2),
    }
    return builders[name]()


@dataclass
class MethodResult:
    """One method at one world size."""

    world_size: int
    method: str
    step_ms_rounds: list[float]
    """Per timed round, the slowest rank's step time."""
    phase_ms: dict[str, float]
    """Per phase, the median over rounds of the slowest rank's time."""
    state_bytes: list[int]  # per rank, fp32 master included where kept
    master_bytes: list[int]  # per rank
    grad_bytes: list[int]  # per rank, after backward
    shard_numel: list[int]  # per rank
    final_loss: float  # mean over ranks, last step
    resident_bytes: list[int]  # per rank: memory held (anonymous RSS) added by building the method and its first step
    phase_peak_bytes: dict[str, list[int]]  # per phase, per rank: peak RSS above the phase's start
    param_bytes: int  # the model's parameters (one copy)
    unsharded_state_bytes: int
    leftover_turns: int  # turns after which background work still ran (the most on any rank)
    pool_bytes: int = 0  # zero1/zero2: the pool's slots while a backward or the step's gathers run (max rank)
    resident_shared_bytes: list[int] = dataclasses.field(default_factory=list)  # per rank, in the shared processes
    code_page_bytes: list[int] = dataclasses.field(default_factory=list)  # per rank: file-backed RSS it added
    vs_ddp: float = float("nan")  # set once DDP's result is known

    @property
    def step_ms(self) -> float:
        return statistics.median(self.step_ms_rounds)

    @property
    def step_ms_quartiles(self) -> tuple[float, float]:
        q = statistics.quantiles(self.step_ms_rounds, n=4)
        return q[0], q[2]

    @property
    def even_share(self) -> float:
        return self.unsharded_state_bytes / self.world_size

    @property
    def state_vs_even_share(self) -> list[float]:
        return [b / self.even_share for b in self.state_bytes]

    @property
    def state_balance(self) -> float:
        return balance(self.state_bytes)

    @property
    def numel_balance(self) -> float:
        return balance(self.shard_numel)


def balance(sizes: Sequence[int]) -> float:
    return max(sizes) / statistics.mean(sizes)


def paired_ratio(a: MethodResult, b: MethodResult) -> float:
    """Median over rounds of a's step time over b's in the same round ([Note: interleaving])."""
    return statistics.median(x / y for x, y in zip(a.step_ms_rounds, b.step_ms_rounds, strict=True))


def make_batches(settings: BenchSettings, rank: int, steps: int) -> list[tuple[Tensor, Tensor]]:
    """Fixed random tokens per (rank, step), so every method sees the same global batches."""
    batches = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(settings.seed + 1000 * step + rank)
        tokens = torch.randint(settings.model.vocab_size, (settings.batch_size, settings.model.seq_len + 1),
                               generator=generator)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


def train_step(method: Method, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, list[float]]:
    """The strategy's loop; returns the loss and the seconds spent in each of PHASES but the drain."""
    marks = [time.perf_counter()]
    loss = method.module(*batch)
    marks.append(time.perf_counter())
    method.backward(loss)
    marks.append(time.perf_counter())
    method.step()
    marks.append(time.perf_counter())
    method.zero_grad()
    marks.append(time.perf_counter())
    return loss.detach(), [b - a for a, b in zip(marks[:-1], marks[1:], strict=True)]


def timed_turn(method: Method, batches: Sequence[tuple[Tensor, Tensor]]) -> tuple[list[float], bool]:
    """One method's turn ([Note: honest turns]): its steps back to back, then the work they left
    running, all timed. Returns the seconds per step of each of PHASES (the turn's mean) and
    whether background work outlived the turn."""
    totals = [0.0] * len(PHASES)
    for batch in batches:
        _, phases = train_step(method, batch)
        for i, seconds in enumerate(phases):
            totals[i] += seconds
    start = time.perf_counter()
    method.finish()
    totals[-1] += time.perf_counter() - start
    return [t / len(batches) for t in totals], method.background_work()


def gather_ints(value: int, world_size: int) -> list[int]:
    gathered = torch.zeros(world_size, dtype=torch.int64)
    dist.all_gather_into_tensor(gathered, torch.tensor([value], dtype=torch.int64))
    return gathered.tolist()


def slowest_rank_ms(phase_seconds: list[list[float]]) -> Tensor:
    """``[rounds, 1 + phases]`` milliseconds: step total, then phases, each the max over ranks."""
    local = torch.tensor(phase_seconds, dtype=torch.float64)
    both = torch.cat([local.sum(dim=1, keepdim=True), local], dim=1)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return both.mul(1000)


def measure_holdings(method: Method, batch: tuple[Tensor, Tensor], world_size: int, reference: GPT,
                     timings: Tensor, resident: int, leftover_turns: int) -> MethodResult:
    """One more, untimed step: what each rank holds after backward and after the step, and the
    measured peak RSS of each phase above the RSS at its start."""
    peaks: dict[str, int] = {}
    release_free_memory()
    dist.barrier()
    with PeakRSS() as peak:
        loss = method.module(*batch)
    peaks["forward"] = peak.growth
    with PeakRSS() as peak:
        method.backward(loss)
    peaks["backward"] = peak.growth
    grad_bytes = method.grad_bytes()
    with PeakRSS() as peak:
        method.step()
        method.finish()  # an overlapped gather is billed to the step that launched it
    peaks["step"] = peak.growth
    peaks["gather"] = method.gather_peak()
    state_bytes, master_bytes, shard_numel = method.state_bytes(), method.master_bytes(), method.shard_numel()
    method.zero_grad()
    loss_sum = loss.detach().clone()
    dist.all_reduce(loss_sum)
    phase_medians = timings[:, 1:].median(dim=0).values.tolist()
    return MethodResult(
        world_size=world_size,
        method=method.name,
        step_ms_rounds=timings[:, 0].tolist(),
        phase_ms=dict(zip(PHASES, phase_medians, strict=True)),
        state_bytes=gather_ints(state_bytes, world_size),
        master_bytes=gather_ints(master_bytes, world_size),
        grad_bytes=gather_ints(grad_bytes, world_size),
        shard_numel=gather_ints(shard_numel, world_size),
        final_loss=loss_sum.item() / world_size,
        unsharded_state_bytes=unsharded_state_bytes(reference, method.keeps_fp32_master),
        resident_bytes=gather_ints(resident, world_size),
        phase_peak_bytes={phase: gather_ints(peaks[phase], world_size)
                          for phase in ("forward", "backward", "step", "gather")},
        param_bytes=tensor_bytes(list(reference.parameters())),
        leftover_turns=max(gather_ints(leftover_turns, world_size)),
        pool_bytes=max(gather_ints(method.pool_bytes(), world_size)),
    )


def build_measured(name: str, settings: BenchSettings, batch: tuple[Tensor, Tensor]) -> tuple[Method, int, int]:
    """(every rank) Build ``name`` and run its first step: the method, the memory it added (``held_bytes``,
    after `gc` and `malloc_trim` on both sides) and the file-backed pages (library code) it touched first."""
    release_free_memory()
    dist.barrier()
    held, code = held_bytes(), file_backed_bytes()
    method = build_method(name, settings)
    train_step(method, batch)
    method.finish()
    release_free_memory()
    return method, held_bytes() - held, file_backed_bytes() - code


def resident_alone(rank: int, world_size: int, settings: BenchSettings, name: str) -> list[tuple[int, int]]:
    """Runs on every rank of fresh processes: what ``name`` keeps resident between steps when it is the only
    method the processes ever built. Per rank, to rank 0.

    [Note: resident in own processes] All methods run in the same processes, so that their step times are
    paired within rounds. Their resident memory must not be measured there: a method built after others
    reuses heap that glibc kept from theirs (freed, not returned, see BENCHMARKS.md) and grows the RSS by
    less than it holds, so the figure depended on the order (DeepSpeed ZeRO-1: 143 MiB built first, 100 MiB
    after ZeRO-1). Each method's resident memory is measured in processes of its own instead, after the
    one-time costs every training process pays (autograd's engine, gloo's first buffers, DeepSpeed's
    communication setup for the peers) and before its one step, as a user's job would hold it."""
    batches = make_batches(settings, rank, 2)
    if settings.peers:
        import deepspeed  # as in bench_world: its import and communication setup are no method's memory

        deepspeed.init_distributed(dist_backend=BACKEND)
    warm = nn.Linear(8, 8)  # one-time costs of any training process: autograd's engine, gloo's first buffers
    warm(torch.ones(2, 8)).sum().backward()
    dist.all_reduce(torch.ones(8))
    del warm
    _, held, code = build_measured(name, settings, batches[0])
    per_rank: list[Any] = [None] * world_size
    dist.all_gather_object(per_rank, (held, code))
    return per_rank


def bench_world(rank: int, world_size: int, settings: BenchSettings) -> list[MethodResult]:
    """Runs on every rank: all methods, interleaved round by round ([Note: interleaving])."""
    rounds = settings.warmup_rounds + settings.timed_rounds
    turn = settings.steps_per_turn
    batches = make_batches(settings, rank, rounds * turn + 1)
    methods: dict[str, Method] = {}
    resident: dict[str, int] = {}
    names = methods_for(world_size, settings.methods, settings.peers)
    if settings.peers:
        import deepspeed  # its import and communication setup are not any method's resident memory

        deepspeed.init_distributed(dist_backend=BACKEND)
    for name in names:
        # What a method keeps resident: its model, gradients, optimizer state and buffers after
        # one step (the first warm-up step), as growth of the memory held in a process where the methods built
        # before it are alive and their freed memory was handed back. The report's figure is
        # resident_alone's; this one is kept beside it ([Note: resident in own processes]).
        methods[name], resident[name], _ = build_measured(name, settings, batches[0])
    phase_seconds: dict[str, list[list[float]]] = {name: [] for name in names}
    leftover_turns = dict.fromkeys(names, 0)
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            # Ranks start each turn together; within it no barrier, whose wait would let background
            # work run untimed.
            dist.barrier()
            phases, leftover = timed_turn(methods[name], batches[round_index * turn : (round_index + 1) * turn])
            leftover_turns[name] += leftover
            if round_index >= settings.warmup_rounds:
                phase_seconds[name].append(phases)
        if rank == 0 and (round_index + 1) % 10 == 0:
            print(f"  world size {world_size}: round {round_index + 1}/{rounds}", flush=True)
    # An unwrapped copy: FSDP's module shows only this rank's shards of the parameters.
    reference = build_model(settings.model, settings.seed)
    return [
        measure_holdings(methods[name], batches[rounds * turn], world_size, reference,
                         slowest_rank_ms(phase_seconds[name]), resident[name], leftover_turns[name])
        for name in names
    ]


def results_table(results: list[MethodResult]) -> list[str]:
    lines = [
        "| world size | method | step ms (median) | p25-p75 ms | vs DDP (paired) | opt state MiB/rank (max) "
        "| of which fp32 master | max rank vs total/ws | balance max/mean | grads MiB/rank after backward "
        "| loss after last step |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        low, high = r.step_ms_quartiles
        lines.append(
            f"| {r.world_size} | {r.method} | {r.step_ms:.1f} | {low:.0f}-{high:.0f} | {r.vs_ddp:.2f}x "
            f"| {max(r.state_bytes) / MIB:.2f} | {max(r.master_bytes) / MIB:.2f} | {max(r.state_vs_even_share):.4f} "
            f"| {r.state_balance:.4f} | {max(r.grad_bytes) / MIB:.2f} | {r.final_loss:.5f} |"
        )
    return lines


MODEL_STATE_FORMULA = {
    # (bytes per parameter that every rank holds in full, bytes per parameter divided over ranks)
    # in the ZeRO paper's accounting (Rajbhandari et al. 2020, sec. 5: Psi params, K bytes of
    # optimizer state per parameter), fp32: 4 B parameter, 4 B gradient, AdamW K = 8 B (+4 B master).
    "ddp": (4 + 4 + 8, 0),  # baseline: everything replicated
    "ddp+zero_redundancy": (4 + 4, 8),  # P_os
    "zero1": (4 + 4, 8 + 4),  # P_os with an fp32 master (K = 12); see memory_note for the grads
    "zero2": (4, 4 + 8 + 4),  # P_os+g
    "fsdp_shard_grad_op": (4, 4 + 8),  # P_os+g (full parameters only from forward to backward)
    HYBRID: (4, 4 + 8 + 4),  # zero2's, divided over the shard group only (see formula_bytes)
    GRADS_KEPT: (4, 4 + 8 + 4),
    "deepspeed_zero1": (4 + 4, 8 + 4),  # as zero1: DeepSpeed keeps an fp32 partition too
    "deepspeed_zero2": (4, 4 + 8 + 4),
}
FORMULA_TEXT = {
    "ddp": "(4+4+8)Ψ", "ddp+zero_redundancy": "(4+4)Ψ + 8Ψ/N", "zero1": "(4+4)Ψ + 12Ψ/N",
    "zero2": "4Ψ + 16Ψ/N", "fsdp_shard_grad_op": "4Ψ + 12Ψ/N",
    HYBRID: f"4Ψ + 16Ψ/{HYBRID_SHARD_GROUP_SIZE}", GRADS_KEPT: "4Ψ + 16Ψ/N",
    "deepspeed_zero1": "(4+4)Ψ + 12Ψ/N", "deepspeed_zero2": "4Ψ + 16Ψ/N",
}


def formula_bytes(method: str, numel: int, world_size: int) -> float:
    replicated, sharded = MODEL_STATE_FORMULA[method]
    divided_over = HYBRID_SHARD_GROUP_SIZE if method == HYBRID else world_size
    return replicated * numel + sharded * numel / divided_over


def memory_table(results: list[MethodResult]) -> list[str]:
    lines = [
        "| world size | method | ZeRO-paper model states | formula MiB | resident MiB/rank (max) | resident / formula "
        "| + library code pages MiB | in shared processes MiB "
        "| forward peak MiB | backward peak MiB | step peak MiB | resident + highest phase peak MiB "
        "| of the step, gathers alone MiB | pool during a step MiB |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        numel = r.param_bytes // 4
        formula = formula_bytes(r.method, numel, r.world_size)
        peak = {phase: max(v) for phase, v in r.phase_peak_bytes.items()}
        lines.append(
            f"| {r.world_size} | {r.method} | {FORMULA_TEXT[r.method]} | {formula / MIB:.1f} "
            f"| {max(r.resident_bytes) / MIB:.1f} | {max(r.resident_bytes) / formula:.2f} "
            f"| {max(r.code_page_bytes or [0]) / MIB:.1f} | {max(r.resident_shared_bytes or [0]) / MIB:.1f} "
            f"| {peak['forward'] / MIB:.1f} | {peak['backward'] / MIB:.1f} | {peak['step'] / MIB:.1f} "
            f"| {(max(r.resident_bytes) + max(peak['forward'], peak['backward'], peak['step'])) / MIB:.1f} "
            + (f"| {peak['gather'] / MIB:.1f} | {r.pool_bytes / MIB:.1f} |" if r.method.startswith("zero")
               else "| - | - |")
        )
    return lines


MEMORY_NOTE = (
    "Memory is measured, per rank, from Linux /proc/self/status. *resident*: the memory the process holds"
    " itself (anonymous RSS, `RssAnon` + `RssShmem`: heap, tensors) added by building the method (a fresh"
    " model) and running its first step, after `gc` and `malloc_trim`, in fresh processes that build no"
    " other method (the largest rank shown; [Note: resident in own processes] in the script). *library"
    " code pages*: the file-backed RSS (`RssFile`) that step added besides, the pages of libtorch's kernels"
    " it ran first; the page cache holds one copy for every process of the machine, each rank's RSS counts"
    " it again, and it is no state of the method (about 11 MiB for every method here). *in shared"
    " processes*: the memory held, measured where the methods built before it stay alive. *peak* per phase: the kernel's high-water mark, reset with `/proc/self/clear_refs` at"
    " the start of the phase, minus the RSS at that start, in one extra untimed step; the step"
    " phase includes finishing the overlapped parameter gathers and the inner AdamW, whose foreach"
    " implementation allocates temporaries the size of what it steps (the shard for ZeRO, the whole"
    " model for DDP); *gathers alone* runs the same bucketed gathers once more by themselves"
    " (`engine.publish_masters()`): before the bound on gathers in flight this was a whole copy of"
    " the parameters. *resident + highest phase peak*: what a rank needs at its busiest moment of a"
    " step (the two are measured in different steps, so this is an estimate). The formula is the ZeRO paper's"
    " model-state accounting in fp32 (Ψ parameters, N ranks, AdamW's two moments = 8 B, plus 4 B"
    " of fp32 master for zero1/zero2); it leaves out activations and communication buffers, which"
    " the measurement includes (DDP keeps a gradient-sized set of bucket buffers besides `.grad`;"
    " our engine holds MAX_IN_FLIGHT bucket-sized slots, *pool during a step*, from the first reduction"
    " of a backward until the step's gathers end, and none between steps). zero1 frees each full gradient once its"
    " bucket is packed, so between steps it holds what zero2 holds; it differs in accumulation"
    " (full gradients kept across micro-batches)."
)


def phase_table(results: list[MethodResult]) -> list[str]:
    lines = [
        "| world size | method | " + " | ".join(f"{p} ms" for p in PHASES) + " |",
        "| ---: | --- | " + " | ".join("---:" for _ in PHASES) + " |",
    ]
    for r in results:
        lines.append(f"| {r.world_size} | {r.method} | " + " | ".join(f"{r.phase_ms[p]:.1f}" for p in PHASES) + " |")
    return lines


@dataclass
class Check:
    target: str
    passed: bool
    detail: str

    def line(self) -> str:
        return f"- {'PASS' if self.passed else 'FAIL'}: {self.target} ({self.detail})"


def turn_checks(world: list[MethodResult]) -> list[Check]:
    """[Note: honest turns]: no method's work runs past its own timed turn."""
    leftover = [f"{r.method} {r.leftover_turns}" for r in world if r.leftover_turns]
    return [Check(f"ws={world[0].world_size}: every method's turns ended with all its work done (gathers"
                  " included), so no step time is billed to another method",
                  not leftover, "turns with background work left: " + (", ".join(leftover) or "none"))]


def zero_names(by_name: dict[str, MethodResult]) -> list[str]:
    return [name for name in ("zero1", "zero2") if name in by_name]


def resident_checks(by_name: dict[str, MethodResult]) -> list[Check]:
    checks = []
    for name in zero_names(by_name):
        r = by_name[name]
        formula = formula_bytes(name, r.param_bytes // 4, r.world_size)
        ratio = max(r.resident_bytes) / formula
        ddp = by_name["ddp"]
        checks.append(Check(
            f"ws={r.world_size} {name}: resident per rank between steps <= {MAX_RESIDENT_VS_FORMULA}x the ZeRO"
            " formula", ratio <= MAX_RESIDENT_VS_FORMULA,
            f"{ratio:.2f}x: {max(r.resident_bytes) / MIB:.1f} MiB for {formula / MIB:.1f} MiB; DDP"
            f" {max(ddp.resident_bytes) / MIB:.1f} MiB"))
        peer = by_name.get(f"deepspeed_{name}")
        if peer is not None:
            checks.append(Check(
                f"ws={r.world_size} {name}: resident per rank between steps at or below {peer.method}'s",
                max(r.resident_bytes) <= max(peer.resident_bytes),
                f"{max(r.resident_bytes) / MIB:.1f} MiB vs {max(peer.resident_bytes) / MIB:.1f} MiB"))
    return checks


def memory_checks(by_name: dict[str, MethodResult]) -> list[Check]:
    zero_redundancy = by_name.get("ddp+zero_redundancy")
    checks = []
    for name in zero_names(by_name):
        r = by_name[name]
        worst = max(abs(x - 1) for x in r.state_vs_even_share)
        checks += [
            Check(f"ws={r.world_size} {name}: optimizer-state bytes on every rank within"
                  f" {STATE_VS_EVEN_SHARE_TOLERANCE:.0%} of total/world_size",
                  worst <= STATE_VS_EVEN_SHARE_TOLERANCE,
                  f"per rank {', '.join(f'{x:.4f}' for x in r.state_vs_even_share)} of total/ws"),
            Check(f"ws={r.world_size} {name}: optimizer-state balance max/mean <= {MAX_BALANCE}",
                  r.state_balance <= MAX_BALANCE,
                  f"{r.state_balance:.5f}" + (f"; ZeroRedundancyOptimizer {zero_redundancy.state_balance:.5f}"
                                              if zero_redundancy else "")),
            Check(f"ws={r.world_size} {name}: optimizer_shard_numel balance max/mean <= {MAX_BALANCE}",
                  r.numel_balance <= MAX_BALANCE,
                  f"{r.numel_balance:.5f} over {r.shard_numel}" + (
                      f"; ZeroRedundancyOptimizer {zero_redundancy.numel_balance:.5f} over"
                      f" {zero_redundancy.shard_numel}" if zero_redundancy else "")),
        ]
    return checks


def step_memory_checks(by_name: dict[str, MethodResult]) -> list[Check]:
    """The gathers' peak is the pool's bounded slots (taken again after the release between steps),
    not a copy of the parameters as before the bound on gathers in flight."""
    checks = []
    for name in zero_names(by_name):
        r = by_name[name]
        gathers = max(r.phase_peak_bytes["gather"])
        checks.append(Check(
            f"ws={r.world_size} {name}: peak RSS growth of the step's parameter gathers <= the pool's"
            f" {MAX_IN_FLIGHT} slots + {GATHER_PEAK_SLACK_MIB} MiB",
            gathers <= r.pool_bytes + GATHER_PEAK_SLACK_MIB * MIB,
            f"{gathers / MIB:.1f} MiB; pool {r.pool_bytes / MIB:.1f} MiB; parameters {r.param_bytes / MIB:.1f} MiB;"
            f" the whole step {max(r.phase_peak_bytes['step']) / MIB:.1f} MiB with AdamW's temporaries",
        ))
    return checks


def stage_comparison(by_name: dict[str, MethodResult]) -> str:
    """zero1 and zero2 differ in one call per bucket (all_reduce + take a row vs
    reduce_scatter), so their ratio prices the backend's reduce_scatter."""
    zero1, zero2 = by_name["zero1"], by_name["zero2"]
    return (f"- info: ws={zero2.world_size} zero2 / zero1 paired ratio {paired_ratio(zero2, zero1):.3f}x"
            " (the engine's two stages differ only in reduce_scatter vs all_reduce per bucket)")


def speed_checks(by_name: dict[str, MethodResult]) -> list[Check]:
    if "zero2" not in by_name:
        return []
    zero2, ddp = by_name["zero2"], by_name["ddp"]
    checks = [Check(
        f"ws={zero2.world_size} zero2 step time <= {MAX_ZERO2_VS_DDP}x DDP on {BACKEND}",
        zero2.vs_ddp <= MAX_ZERO2_VS_DDP,
        f"paired ratio {zero2.vs_ddp:.3f}x; medians {zero2.step_ms:.1f} ms vs {ddp.step_ms:.1f} ms",
    )]
    for other in (by_name[n] for n in ("ddp+zero_redundancy", "fsdp_shard_grad_op") if n in by_name):
        ratio = paired_ratio(zero2, other)
        checks.append(Check(
            f"ws={zero2.world_size} zero2 no slower than {other.method}",
            ratio <= 1.0,
            f"paired ratio {ratio:.3f}x; medians {zero2.step_ms:.1f} ms vs {other.step_ms:.1f} ms",
        ))
    return checks


def zero_redundancy_partition(group_numels: Sequence[Sequence[int]], world_size: int) -> list[int]:
    """Elements per rank under ZeroRedundancyOptimizer's rule (``_partition_parameters``):
    per param group, largest parameter first, each to the rank with the fewest elements so
    far (lowest rank on ties); the running sizes carry over from one group to the next."""
    sizes = [0] * world_size
    for numels in group_numels:
        for numel in sorted(numels, reverse=True):  # sorted() is stable, as in torch
            rank = sizes.index(min(sizes))
            sizes[rank] += numel
    return sizes


def even_shard_partition(numels: Sequence[int], world_size: int) -> list[int]:
    """Elements per rank under our layout (``lightning_zero.engine.sharding.EvenShard``)."""
    return [sum(EvenShard(n, world_size).shard_numel(rank) for n in numels) for rank in range(world_size)]


def param_groups_numels(model: nn.Module, split_decay: bool) -> list[list[int]]:
    """One group, or nanoGPT's two: matrices with weight decay, vectors without."""
    params = list(model.parameters())
    if not split_decay:
        return [[p.numel() for p in params]]
    return [[p.numel() for p in params if p.dim() >= 2], [p.numel() for p in params if p.dim() < 2]]


def computed_balance_table(models: dict[str, GPTConfig], world_size: int) -> list[str]:
    lines = [
        f"| model | param groups | ZeroRedundancyOptimizer max/mean at {world_size} ranks "
        "| its emptiest rank (elements) | even shard max/mean | even shard min rank (elements) |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for label, config in models.items():
        model = build_model(config, seed=0)
        for split_decay in (False, True):
            groups = param_groups_numels(model, split_decay)
            zr = zero_redundancy_partition(groups, world_size)
            even = even_shard_partition([n for g in groups for n in g], world_size)
            lines.append(
                f"| {label} | {'2 (decay / no decay)' if split_decay else '1'} | {balance(zr):.4f} | {min(zr):,} "
                f"| {balance(even):.6f} | {min(even):,} |"
            )
    return lines


def partition_rule_matches(zero_redundancy: MethodResult, model: GPTConfig) -> bool:
    """The computed ZeroRedundancyOptimizer partition equals the measured one, so the 8-rank
    figure follows the real rule."""
    groups = param_groups_numels(build_model(model, seed=0), split_decay=False)
    return zero_redundancy_partition(groups, zero_redundancy.world_size) == zero_redundancy.shard_numel


def optimizer_words(settings: BenchSettings) -> str:
    if settings.optimizer == "muon":
        return "Muon (lr 0.02, weight decay 0.1) for the blocks' matrices and AdamW (lr 0.001) for the rest"
    return f"AdamW (lr {settings.lr}, weight decay {settings.weight_decay})"


def header(settings: BenchSettings, command: str, elapsed_s: float, loads: list[str]) -> list[str]:
    m = settings.model
    n_params = sum(p.numel() for p in build_model(m, seed=0).parameters())
    names = ", ".join(settings.methods) if settings.methods else "all methods"
    return [
        f"Command: `{command}`  ",
        f"Machine: {describe_machine()}.  ",
        f"Model: GPT, {n_params / 1e6:.2f}M parameters (vocab {m.vocab_size}, {m.n_layers} blocks, d_model"
        f" {m.d_model}, {m.n_heads} heads, tied LM head), sequence {m.seq_len}, batch {settings.batch_size}"
        f" per rank, {optimizer_words(settings)}, fp32.  ",
        f"Timing ({names}): the methods take turns in the same processes, {settings.warmup_rounds}"
        f" warm-up + {settings.timed_rounds} timed rounds; a round is one turn of each method, order rotated"
        f" every round; a turn is {settings.steps_per_turn} consecutive steps timed as one block that ends"
        " with the work they left running (zero1/zero2: the last step's overlapped parameter gathers,"
        " the *drain* phase), so no method's work is billed to another. Every turn starts with a barrier"
        " and is timed on the slowest rank; times are per step (the turn's mean). *vs DDP* and the speed"
        " targets use the median over rounds of the within-round ratio. One thread per process."
        f" Wall time of the whole run: {elapsed_s:.0f} s. Load average (1, 5, 15 min) before each world"
        f" size and at the end: {' / '.join(loads)}.  ",
        "zero1/zero2 run `ZeroEngine` in a plain loop (forward, backward, `engine.ensure_flushed()`,"
        " `opt.step()`, `opt.zero_grad()`), exactly what `ZeroLowLevelStrategy` does per step, so"
        " Lightning's loop overhead is not measured; bucket_size_mb"
        f" {settings.bucket_size_mb}, overlap_communication=True, overlap_param_gather=True. ddp = `DistributedDataParallel`"
        " (Lightning `ddp`); ddp+zero_redundancy = the same with"
        " `ZeroRedundancyOptimizer(optimizer_class=AdamW)`; fsdp_shard_grad_op = FSDP"
        " `ShardingStrategy.SHARD_GRAD_OP`, one unit per block, `use_orig_params=True`.",
    ]


COUNTING_NOTE = (
    "What is counted. *opt state*: every tensor in the rank's optimizer state (AdamW exp_avg,"
    " exp_avg_sq, step) plus, for zero1/zero2, the fp32 master shard buffers (padding included);"
    " the other methods step the fp32 parameters themselves and keep no separate master."
    " *total/ws*: what one process running AdamW over the whole model would hold (2 moments"
    " + a step tensor per parameter, plus a full fp32 master copy for zero1/zero2), divided by"
    " the world size. *grads*: `.grad` of the module's parameters after backward (full for DDP and"
    " ZeroRedundancyOptimizer, sharded for FSDP), plus for zero1/zero2 the fp32 shard-gradient"
    " buffers; DDP's internal bucket buffers are not counted. Backend: gloo, whose reduce_scatter"
    " clones its whole input on the calling thread, all-reduces the clone and copies out this"
    " rank's chunk, so on CPU zero2 moves as many bytes as DDP's all-reduce plus two copies (on"
    " NCCL a reduce-scatter moves half of an all-reduce's bytes)."
)


def report(settings: BenchSettings, results: list[MethodResult], checks: list[Check], infos: list[str],
           header_lines: list[str], world_sizes: Sequence[int]) -> str:
    models = {"this run's GPT": settings.model, "small GPT (--quick model)": QUICK.model}
    unique_models = {label: m for label, m in models.items() if label == "this run's GPT" or m != settings.model}
    lines = [
        *header_lines,
        "",
        *results_table(results),
        "",
        COUNTING_NOTE,
        "",
        "Memory per rank, measured, beside the ZeRO paper's formula for model states:",
        "",
        *memory_table(results),
        "",
        MEMORY_NOTE,
        "",
        "Step-time breakdown (median ms of the slowest rank; *backward* includes the gradient"
        " reductions that do not overlap, *step* the parameter all-gather or broadcast; zero1/zero2"
        " overlap their gathers with the next *forward*, which waits for what it reads; *drain*, per step, is"
        " the turn's last gathers finished at its end, [Note: honest turns]):",
        "",
        *phase_table(results),
        "",
        "Targets:",
        "",
        *[c.line() for c in checks],
        *infos,
        "",
        "Computed, not measured: balance of optimizer-state elements at 8 ranks, from"
        " ZeroRedundancyOptimizer's partitioning rule (greedy by size into the least-loaded rank, per"
        " param group; reproduced here and checked equal to the measured partition at"
        f" {', '.join(map(str, world_sizes))} ranks when ddp+zero_redundancy runs) and from"
        " `lightning_zero.engine.sharding.EvenShard`.",
        "",
        *computed_balance_table(unique_models, world_size=8),
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, few rounds (a smoke run)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=None, help=f"timed rounds (default {FULL.timed_rounds})")
    parser.add_argument("--bucket-size-mb", type=float, default=None,
                        help=f"zero1/zero2 bucket capacity (default {FULL.bucket_size_mb})")
    parser.add_argument("--steps-per-turn", type=int, default=None,
                        help=f"consecutive steps of one method per turn (default {FULL.steps_per_turn})")
    parser.add_argument("--peers", action="store_true",
                        help="add DeepSpeed ZeRO-1/2 rows (DS_ACCELERATOR=cpu; see make bench-peers)")
    parser.add_argument("--methods", nargs="+", choices=(*METHODS, HYBRID, GRADS_KEPT, *PEERS), default=None,
                        help="run only these (ddp is always added: the ratios are to it)")
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                        help=f"muon: Muon+AdamW in {', '.join(MUON_METHODS)} (the default methods then)")
    parser.add_argument("--out", type=Path, default=OUT_DIR / "engine.md")
    args = parser.parse_args(argv)
    if args.optimizer == "muon" and not args.methods:
        args.methods = list(MUON_METHODS)
    if args.methods:
        args.methods = ["ddp", *(m for m in args.methods if m != "ddp")]
    if args.steps_per_turn is not None and args.steps_per_turn < 1:
        parser.error(f"--steps-per-turn must be >= 1, got {args.steps_per_turn}")
    if any(ws < 2 for ws in args.world_sizes):
        parser.error(f"--world-sizes must all be >= 2 (this compares data parallelism), got {args.world_sizes}")
    if args.rounds is not None and args.rounds < 2:
        parser.error(f"--rounds must be >= 2 (quartiles need two), got {args.rounds}")
    return args


def hybrid_comparison(by_name: dict[str, MethodResult]) -> str:
    """The hybrid row beside flat zero2 and DDP: its all-gathers and reduce-scatters span 2 ranks, its
    second reduction hop carries 1/2 of the gradient bytes across the shard groups, and each rank
    holds 1/2 (not 1/world size) of the optimizer state."""
    hybrid, zero2 = by_name[HYBRID], by_name["zero2"]
    return (f"- info: ws={hybrid.world_size} {HYBRID} (2 x {HYBRID_SHARD_GROUP_SIZE}) paired vs zero2"
            f" {paired_ratio(hybrid, zero2):.3f}x, vs DDP {hybrid.vs_ddp:.3f}x; optimizer state per rank"
            f" {max(hybrid.state_bytes) / MIB:.2f} MiB vs zero2 {max(zero2.state_bytes) / MIB:.2f} MiB; loss"
            f" {hybrid.final_loss:.5f} vs {zero2.final_loss:.5f} (gloo: both hops are all-reduces, see"
            " [Note: gloo reduce-scatter])")


def grads_kept_comparison(by_name: dict[str, MethodResult]) -> str:
    """What freeing the gradient shards at ``zero_grad`` costs: zero2 against itself with them kept."""
    kept, zero2 = by_name[GRADS_KEPT], by_name["zero2"]
    return (f"- info: ws={zero2.world_size} zero2 (gradient shards freed at zero_grad) vs {GRADS_KEPT}"
            f" (release_grad_shards=False) paired {paired_ratio(zero2, kept):.3f}x; backward {zero2.phase_ms['backward']:.1f}"
            f" vs {kept.phase_ms['backward']:.1f} ms; resident {max(zero2.resident_bytes) / MIB:.1f} vs"
            f" {max(kept.resident_bytes) / MIB:.1f} MiB")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.rounds is not None:
        settings = dataclasses.replace(settings, timed_rounds=args.rounds)
    if args.bucket_size_mb is not None:
        settings = dataclasses.replace(settings, bucket_size_mb=args.bucket_size_mb)
    if args.steps_per_turn is not None:
        settings = dataclasses.replace(settings, steps_per_turn=args.steps_per_turn)
    if args.methods:
        settings = dataclasses.replace(settings, methods=tuple(args.methods))
    if args.peers or any(m in PEERS for m in args.methods or ()):
        settings = dataclasses.replace(settings, peers=True)
    settings = dataclasses.replace(settings, optimizer=args.optimizer)
    command = " ".join([".venv/bin/python", "bench/engine.py", *(sys.argv[1:] if argv is None else argv)])
    start = time.perf_counter()
    results: list[MethodResult] = []
    checks: list[Check] = []
    infos: list[str] = []
    loads: list[str] = []
    for ws in args.world_sizes:
        loads.append(load_average())
        print(f"world size {ws}: {len(methods_for(ws, settings.methods, settings.peers))} methods, {settings.timed_rounds} timed"
              f" rounds of {settings.steps_per_turn} steps", flush=True)
        world: list[MethodResult] = run_on_ranks(bench_world, ws, settings)
        for r in world:  # [Note: resident in own processes]
            alone = run_on_ranks(resident_alone, ws, settings, r.method)
            r.resident_shared_bytes, r.resident_bytes = r.resident_bytes, [held for held, _ in alone]
            r.code_page_bytes = [code for _, code in alone]
        by_name = {r.method: r for r in world}
        for r in world:
            r.vs_ddp = paired_ratio(r, by_name["ddp"])
            if settings.optimizer == "muon":  # the whole state is what DDP holds (no formula for Muon's)
                r.unsharded_state_bytes = max(by_name["ddp"].state_bytes) + (r.param_bytes if r.master_bytes[0] else 0)
        zero_redundancy = by_name.get("ddp+zero_redundancy")
        if zero_redundancy is not None and not partition_rule_matches(zero_redundancy, settings.model):
            raise AssertionError("the computed ZeroRedundancyOptimizer partition differs from the measured one")
        results += world
        checks += turn_checks(world) + memory_checks(by_name) + step_memory_checks(by_name)
        if settings.optimizer == "adamw":  # targets set for AdamW's state formula and update
            checks += resident_checks(by_name) + speed_checks(by_name)
        if "zero1" in by_name and "zero2" in by_name:
            infos.append(stage_comparison(by_name))
        if HYBRID in by_name:
            infos.append(hybrid_comparison(by_name))
        if GRADS_KEPT in by_name and "zero2" in by_name:
            infos.append(grads_kept_comparison(by_name))
    loads.append(load_average())
    text = report(settings, results, checks, infos,
                  header(settings, command, time.perf_counter() - start, loads), args.world_sizes)
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
