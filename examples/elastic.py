"""Elastic training under torchrun: ZeRO-2, tiered checkpoints, ``ckpt_path="last"`` on every (re)start.

torchrun's agents restart the workers themselves when a node dies (``--max-restarts``) and let the job go on
with the nodes that are left (``--nnodes=MIN:MAX``); every start of this script calls
``trainer.fit(..., ckpt_path="last")``: the first finds nothing and starts fresh, a restart resumes from the
newest complete checkpoint of either tier, the local tier resharded from the surviving nodes' files when the
world size changed (docs/tiers.md, "Elastic recovery"). Lightning detects torchrun (TorchElasticEnvironment);
``num_nodes`` is read from torchrun's environment at each start, since it changes with the rendezvous.

The local tier's directory must stay with the machine, not with the node rank: torch elastic gives the nodes
of each rendezvous new ranks (the survivor of a 2-node job is node 0 of the next), so the directory is
``--local-tier`` with ``{node}`` filled from ``$ELASTIC_NODE_NAME`` (default: the host name)::

    # on each of two machines (the first also hosts the rendezvous store):
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    ELASTIC_NODE_NAME=$(hostname) torchrun --nnodes=1:2 --nproc-per-node=2 --max-restarts=3 \\
        --rdzv-backend=c10d --rdzv-endpoint=$HOST0:29400 --rdzv-id=job7 \\
        examples/elastic.py --root runs/elastic --local-tier /dev/shm/ckpt/{node} --steps 200

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (torch 2.13): by default the agents share the rendezvous' TCP store
with the workers, the same store server for every restart and no per-attempt key prefix
(torch/distributed/rendezvous.py), so a restarted worker can read a dead worker's gloo address and fail with
"Gloo connectFullMesh failed ... Connection refused" on every restart; with it set, rank 0 of each start
hosts a fresh store.

Kill one machine's agent (or the machine): the other's agent restarts its 2 workers at world size 2 after
the rendezvous drops the dead node, and they resume resharded 4 -> 2 from the local tier. ``--report FILE``:
rank 0 writes the resume's figures (``checkpoint_io.last_load``) and the time of the first completed step of
every start to FILE.<restart count>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `lightning_zero` from a checkout

from lightning_zero import (  # noqa: E402
    DataPosition,
    ElasticDistributedSampler,
    LocalTier,
    ZeroCheckpointIO,
    ZeroLowLevelStrategy,
)
from lightning_zero.checkpoint.runtime.stats import process_started_at  # noqa: E402

STARTED = process_started_at() or time.time()  # this process's start (the report's worker start)


class Regression(Dataset):
    """Sample i: a fixed random input and a target of it, the same in every process (seeded by i)."""

    def __init__(self, samples: int, width: int) -> None:
        self.samples, self.width = samples, width

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.width, generator=torch.Generator().manual_seed(index))
        return x, x.roll(1).tanh()


class MLP(LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[layer for _ in range(depth) for layer in (nn.Linear(width, width), nn.Tanh())])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Report(Callback):
    """Rank 0 writes, per start of the script, what the resume did and when the first step completed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.written = False

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:  # noqa: ANN001
        if self.written or not trainer.is_global_zero:
            return
        load = trainer.strategy.checkpoint_io.last_load
        if load is not None and load.first_step_s is None:
            return  # the package completes the recovery's timeline at the first step (its callback runs after)
        self.report(trainer, load)

    def report(self, trainer: Trainer, load) -> None:  # noqa: ANN001
        self.written = True
        done = time.time() if load is None else load.ended_at + load.first_step_s
        report = {"restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), "world_size": trainer.world_size,
                  "process_started": STARTED, "first_step_done": done,
                  "first_step": trainer.global_step if load is None or load.step is None else load.step + 1,
                  "last_load": dataclasses.asdict(load) if load is not None else None,
                  "failure_to_step_s": load.failure_to_step_s if load is not None else None}
        self.write(report)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        load = trainer.strategy.checkpoint_io.last_load
        if trainer.is_global_zero and not self.written and (load is None or load.first_step_s is not None):
            self.report(trainer, load)  # the run ended at the first step after its resume
        if trainer.is_global_zero:
            self.write({"final_step": trainer.global_step}, suffix="end")

    def write(self, report: dict, suffix: str | None = None) -> None:
        name = f"{self.path}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}" + (f".{suffix}" if suffix else "")
        with open(name + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(name + ".tmp", name + ".json")


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", required=True, help="the durable tier's directory (ModelCheckpoint dirpath)")
    parser.add_argument("--local-tier", required=True,
                        help="this node's local-tier directory; {node} is $ELASTIC_NODE_NAME (default: host name)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--persist-every", type=int, default=50, help="every n-th save also goes to --root")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="samples per rank and step")
    parser.add_argument("--samples", type=int, default=65536, help="the dataset (the same on every restart)")
    parser.add_argument("--report", help="rank 0 writes the resume's figures to REPORT.<restart>.json")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, callbacks: Sequence[Callback] = ()) -> Trainer:
    args = parse(argv)
    torch.set_num_threads(1)
    node = os.environ.get("ELASTIC_NODE_NAME") or socket.gethostname()
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    io = ZeroCheckpointIO(mode="sharded", persist_every=args.persist_every,
                          local_tier=LocalTier(args.local_tier.replace("{node}", node), replicas=1, keep=2))
    data = Regression(samples=args.samples, width=args.width)
    loader = DataLoader(data, batch_size=args.batch, sampler=ElasticDistributedSampler(data, shuffle=True, seed=7))
    trainer = Trainer(
        accelerator="cpu", devices=local_ranks, num_nodes=int(os.environ.get("WORLD_SIZE", 1)) // local_ranks,
        strategy=ZeroLowLevelStrategy(stage=2), plugins=[io], max_steps=args.steps, logger=False,
        callbacks=[DataPosition(), ModelCheckpoint(dirpath=args.root, every_n_train_steps=1, save_top_k=2,
                                                   monitor="step", mode="max"),
                   *([Report(args.report)] if args.report else []), *callbacks],
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(MLP(args.width, args.depth), loader, ckpt_path="last")
    return trainer


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo may abort a finished process at interpreter exit (as tests/multinode_train.py)
