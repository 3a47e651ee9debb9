"""A functional loop that ends as DDP programs end: no ``engine.close()`` after the last ``opt.step()``.

    python ddp_style_ending.py STORE_DIR RANK WORLD_SIZE RUNS ENDING OUT

Each of ``RUNS`` runs (a file store of its own under STORE_DIR) sets up a process group, trains a 4-layer MLP
with ZeRO-2 and AdamW for 3 steps, and ends without ``engine.close()``: rank 0 reads ``model.state_dict()``;
every other rank at once calls ``dist.destroy_process_group()`` (ENDING ``destroy``, the usual last line of a
DDP program) or, in the last run, leaves the interpreter without it (ENDING ``exit``). Rank 0 then destroys the
group too and writes the weights it read in every run to OUT. The process's exit status is the check: 0 unless
a gather failed or the interpreter aborted.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_zero import ZeroConfig, ZeroEngine

STEPS = 3


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 5))


def global_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(4 * world_size, 16, generator=generator), torch.randn(4 * world_size, 5, generator=generator)


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, world_size)
    return x.chunk(world_size)[rank], y.chunk(world_size)[rank]


def main(store_dir: str, rank: int, world_size: int, runs: int, ending: str, out: str) -> None:
    torch.set_num_threads(1)
    read: list[dict[str, torch.Tensor]] = []
    for run in range(runs):
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(store_dir, f'store-{run}')}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=60))
        model = mlp()
        engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters(), lr=1e-2)],
                            ZeroConfig(stage=2, bucket_size_mb=0.001))  # several buckets: several gathers in flight
        opt = engine.optimizers[0]
        for step in range(STEPS):
            x, y = batch(step, rank, world_size)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        if rank == 0:
            read.append({k: v.clone() for k, v in model.state_dict().items()})
            dist.destroy_process_group()
        elif ending == "exit" and run == runs - 1:
            return  # the interpreter ends with the gathers of this run in flight
        else:
            dist.destroy_process_group()
    if rank == 0:
        torch.save(read, out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
