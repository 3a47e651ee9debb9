"""Shape-aware optimizer benchmark: Muon (matrices) + AdamW (the rest) under ZeRO beside AdamW.

The GPT of ``bench/engine.py``; Muon takes the blocks' matrices, AdamW the embeddings (tied with the
head), LayerNorms and biases, as Muon is used. Methods: plain DDP with the same two optimizers (the
reference: full state on every rank), ``zero1``/``zero2`` with Muon+AdamW, and ``zero2`` with AdamW
alone (what the even split costs without a shape-aware optimizer). Interleaved round by round as in
``bench/engine.py`` ([Note: interleaving] there), on CPU processes over gloo.

Per method: the median step time (slowest rank) and its ratio to DDP with the same optimizers; the
bytes of fp32 masters and optimizer state each rank holds between steps and their balance (max/mean);
the bytes each rank receives per step for the whole-matrix step ([Note: whole-matrix step] in
lightning_zero/engine/whole_step.py) beside the gradient bytes one all-reduce of the model moves; the loss
after the last step (DDP's and ZeRO's Muon runs must agree).

Usage::

    .venv/bin/python bench/optimizers.py                 # world sizes 2 and 4, the small GPT
    .venv/bin/python bench/optimizers.py --world-sizes 2 --rounds 10 --d-model 384 --layers 4
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from _common import BACKEND, describe_machine, load_average, muon_with_adamw, run_on_ranks
from engine import GPT, GPTConfig, build_model
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_zero.engine import ZeroConfig, ZeroEngine

METHODS = ("ddp muon+adamw", "zero1 muon+adamw", "zero2 muon+adamw", "zero2 adamw")


@dataclass(frozen=True)
class Settings:
    model: GPTConfig
    batch_size: int = 2
    warmup: int = 2
    rounds: int = 8


def optimizers(model: GPT, muon: bool) -> list[torch.optim.Optimizer]:
    if not muon:
        return [torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)]
    return muon_with_adamw(model)


class Method:
    def __init__(self, name: str, settings: Settings) -> None:
        self.name = name
        model = build_model(settings.model, seed=0)
        self.model: nn.Module = model
        self.engine: ZeroEngine | None = None
        if name.startswith("ddp"):
            self.module: nn.Module = DDP(model)
            self.opts = optimizers(model, muon=True)
        else:
            stage = int(name[4])
            self.engine = ZeroEngine(model, optimizers(model, muon="muon" in name), ZeroConfig(stage=stage))
            self.module = model
            self.opts = list(self.engine.optimizers)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        loss = self.module(*batch)
        loss.backward()
        if self.engine is not None:
            self.engine.ensure_flushed()
        for opt in self.opts:
            opt.step()
        for opt in self.opts:
            opt.zero_grad(set_to_none=True)
        if self.engine is not None:
            # The step's overlapped gathers are part of this method's time, not the next method's.
            self.engine.finish_param_gather()
        return loss.item()

    def state_bytes(self) -> int:
        """fp32 masters (ZeRO; DDP's parameters are its masters) and optimizer state, between steps."""
        if self.engine is None:
            tensors = list(self.model.parameters())
        else:
            tensors = [sp.master for sp in self.engine.sharded_params.values()]
        for opt in self.opts:
            tensors += [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def whole_step_bytes(self) -> int:
        if self.engine is None:
            return 0
        return sum(opt.whole_step.gathered_bytes for opt in self.engine.optimizers if opt.whole_step is not None)


def bench(rank: int, world_size: int, settings: Settings) -> dict[str, dict[str, object]]:
    torch.manual_seed(0)
    methods = [Method(name, settings) for name in METHODS]
    times: dict[str, list[float]] = {m.name: [] for m in methods}
    losses: dict[str, float] = {}
    for step in range(settings.warmup + settings.rounds):
        g = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(settings.model.vocab_size, (settings.batch_size, settings.model.seq_len + 1), generator=g)
        batch = (tokens[:, :-1], tokens[:, 1:])
        order = methods[step % len(methods):] + methods[: step % len(methods)]
        for method in order:
            dist.barrier()
            start = time.perf_counter()
            losses[method.name] = method.step(batch)
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= settings.warmup:
                times[method.name].append(elapsed.item() * 1000)
    out: dict[str, dict[str, object]] = {}
    for method in methods:
        per_rank = [torch.zeros((), dtype=torch.int64) for _ in range(world_size)]
        dist.all_gather(per_rank, torch.tensor(method.state_bytes()))
        gathered = torch.tensor(method.whole_step_bytes())
        dist.all_reduce(gathered, op=dist.ReduceOp.MAX)
        loss = torch.tensor(losses[method.name])
        dist.all_reduce(loss)
        out[method.name] = {"step_ms": statistics.median(times[method.name]), "ms": times[method.name],
                            "state": [int(b) for b in per_rank], "whole_step_bytes": int(gathered),
                            "loss": loss.item() / world_size}
    out["_model"] = {"param_bytes": sum(p.numel() * 4 for p in methods[0].model.parameters()),
                     "muon_bytes": sum(p.numel() * 4 for n, p in methods[0].model.named_parameters()
                                       if p.ndim == 2 and n.startswith("blocks."))}
    return out


def report(world_size: int, result: dict[str, dict[str, object]]) -> list[str]:
    model = result.pop("_model")
    ddp_ms = result["ddp muon+adamw"]["ms"]
    lines = [f"### {world_size} ranks ({BACKEND})", "",
             f"Parameters {model['param_bytes'] / 2**20:.2f} MiB fp32, of which Muon's matrices"
             f" {model['muon_bytes'] / 2**20:.2f} MiB.", "",
             "| method | step ms (median) | vs DDP (paired median) | state MiB per rank (min-max) | balance max/mean |"
             " whole-step MiB received per step | final loss |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for name, r in result.items():
        state = r["state"]
        ratios = [a / b for a, b in zip(r["ms"], ddp_ms, strict=True)]
        lines.append(f"| {name} | {r['step_ms']:.1f} | {statistics.median(ratios):.2f}x |"
                     f" {min(state) / 2**20:.2f}-{max(state) / 2**20:.2f} |"
                     f" {max(state) / (sum(state) / len(state)):.3f} | {r['whole_step_bytes'] / 2**20:.2f} |"
                     f" {r['loss']:.4f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    settings = Settings(GPTConfig(vocab_size=2048, seq_len=32, d_model=args.d_model, n_layers=args.layers,
                                  n_heads=4), rounds=args.rounds)
    lines = ["## Muon+AdamW under ZeRO (bench/optimizers.py)", "", describe_machine(), f"load {load_average()}", ""]
    for world_size in args.world_sizes:
        lines += report(world_size, run_on_ranks(bench, world_size, settings)) + [""]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
