"""One "node" of an elastic tiered-checkpoint run on 127.0.0.1 (started by tests/faults/test_elastic_recovery.py
once per node; each node with its own local-tier directory).

Usage: NODE_RANK=<n> MASTER_ADDR=127.0.0.1 MASTER_PORT=<port> python elastic_node.py OUT DURABLE_DIR LOCAL_PATTERN
       NODES DEVICES STEPS PERSIST_EVERY CKPT CRASH(0|1)

CKPT: "last", a checkpoint path, or "-" (start fresh). Saves every step (LOCAL_PATTERN with {node_rank} is a
node's local tier). CRASH=1 leaves like a node that dies after its last save committed (before fit's end
persists it). ELASTIC_KILL=<replication|persist>:<n> kills this node in the n-th save's replication or durable write
(tiered_node.py's).
ELASTIC_SHARD_GROUP=<n>: hybrid sharding. Every rank writes its engine state as the fit starts (after the
resume) to OUT.rank<r>.start; rank 0 writes the losses, the parameters and the recovery's figures to OUT.
"""

from __future__ import annotations

import os
import sys

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, os.path.dirname(__file__))

from lightning_cases import NetModule, loader  # noqa: E402
from tiered_node import CrashAfterLastSave, _kill_in  # noqa: E402

from lightning_zero import LocalTier, ZeroCheckpointIO, ZeroLowLevelStrategy  # noqa: E402
from lightning_zero.checkpoint.engine_tree import zero_state_dict  # noqa: E402
from lightning_zero.checkpoint.formats.tree import FlatShard, walk  # noqa: E402

GLOBAL_BATCH_RANKS = 4  # the data's global batches, the same at every world size


def _record(trainer: Trainer, module: NetModule, out: str) -> None:
    if trainer.is_global_zero:
        load = trainer.strategy.checkpoint_io.last_load
        torch.save({"params": {n: p.detach().clone() for n, p in module.net.named_parameters()},
                    "step": trainer.global_step, "losses": list(module.losses), "load": load}, out)


class StartState(Callback):
    """Each rank's engine state (masters, optimizer state, buffers) as the fit starts, by tree path."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer: Trainer, pl_module: NetModule) -> None:
        tree = zero_state_dict(trainer.strategy.engine, pl_module)
        state = {}
        for path, leaf in walk(tree):
            key = "/".join(path)
            if isinstance(leaf, FlatShard):
                state[key] = (leaf.local.clone(), leaf.shape, leaf.rank, leaf.world_size)
            elif isinstance(leaf, torch.Tensor):
                state[key] = leaf.clone()
        state["lr"] = [g["lr"] for opt in trainer.optimizers for g in opt.param_groups]
        state["global_step"] = trainer.global_step
        torch.save(state, f"{self.out}.rank{trainer.global_rank}.start")


if __name__ == "__main__":
    if os.environ.get("ELASTIC_KILL"):
        where, nth = os.environ["ELASTIC_KILL"].split(":")
        _kill_in(where, int(nth))
    out, durable, pattern, nodes, devices, steps, persist_every, ckpt, crash = sys.argv[1:10]
    module = NetModule(scheduler=True)
    io = ZeroCheckpointIO(mode="sharded", local_tier=LocalTier(pattern, replicas=1, keep=2),
                          persist_every=int(persist_every))
    callbacks: list[Callback] = [StartState(out), ModelCheckpoint(dirpath=durable, every_n_train_steps=1, save_top_k=-1)]
    if crash == "1":
        callbacks.append(CrashAfterLastSave(out, record=_record))
    group = os.environ.get("ELASTIC_SHARD_GROUP")
    trainer = Trainer(
        accelerator="cpu", devices=int(devices), num_nodes=int(nodes),
        strategy=ZeroLowLevelStrategy(stage=2, bucket_size_mb=0.0005,
                                      **({"shard_group_size": int(group)} if group else {})),
        plugins=[io], max_steps=int(steps), logger=False, use_distributed_sampler=False, callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, loader(int(steps), 1, GLOBAL_BATCH_RANKS), ckpt_path=None if ckpt == "-" else ckpt)
    _record(trainer, module, out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/multinode_train.py: gloo may abort a finished process at interpreter exit
