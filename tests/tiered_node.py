"""One "node" of a two-node tiered-checkpoint run on 127.0.0.1 (started twice by tests/faults/test_tiered_faults.py).

Usage: NODE_RANK=<0|1> MASTER_ADDR=127.0.0.1 MASTER_PORT=<port> python tiered_node.py OUT DURABLE_DIR LOCAL_PATTERN
       STEPS PERSIST_EVERY RESUME(0|1) CRASH(0|1)

Saves every step (the local tier of each node is LOCAL_PATTERN with {node_rank}); CRASH=1 leaves like a node
that dies after its last save committed (before fit's end persists it); RESUME=1 fits with ckpt_path="last".
TIERED_KILL=<replication|persist>:<n> kills this node in the n-th save's replication or durable write.
TIERED_DEVICES=<n> (default 1): ranks per node. TIERED_SHARD_GROUP=<n>: hybrid sharding (shard_group_size).
Rank 0 writes the parameters after each step to OUT.step<N>.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, os.path.dirname(__file__))

from lightning_cases import NetModule, loader  # noqa: E402

from lightning_zero import LocalTier, ZeroCheckpointIO, ZeroLowLevelStrategy  # noqa: E402


def _record(trainer: Trainer, module: NetModule, out: str) -> None:
    if trainer.is_global_zero:
        load = trainer.strategy.checkpoint_io.last_load
        torch.save({"params": {n: p.detach().clone() for n, p in module.net.named_parameters()},
                    "step": trainer.global_step, "tier": load.tier if load else None,
                    "reason": load.reason if load else None}, out)


class CrashAfterLastSave(Callback):
    """Leave like a node that dies after its last save committed, ``record`` having written what the test reads
    (tests/elastic_node.py passes its own)."""

    def __init__(self, out: str, record: Callable[[Trainer, NetModule, str], None] | None = None) -> None:
        self.out = out
        self.record = record or _record

    def on_train_end(self, trainer: Trainer, pl_module: NetModule) -> None:
        trainer.strategy.checkpoint_io.finalize()  # the last save committed (locally, replicated)
        self.record(trainer, pl_module, self.out)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class ParamsEveryStep(Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_batch_end(self, trainer: Trainer, pl_module: NetModule, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero:
            torch.save({n: p.detach().clone() for n, p in pl_module.net.named_parameters()},
                       f"{self.out}.step{trainer.global_step}")


def _kill_in(where: str, nth: int) -> None:
    """Make this process die (as a node does) in the ``nth`` save's replication or durable write."""
    from lightning_zero.checkpoint.modes import sharded
    from lightning_zero.checkpoint.tiered import replication

    module, name = (replication.Replicating, "join") if where == "replication" else (sharded, "write_sharded")
    original, calls = getattr(module, name), []

    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) == nth:
            os._exit(17)
        return original(*args, **kwargs)

    setattr(module, name, dying)


if __name__ == "__main__":
    if os.environ.get("TIERED_KILL"):
        where, nth = os.environ["TIERED_KILL"].split(":")
        _kill_in(where, int(nth))
    out, durable, pattern, steps, persist_every, resume, crash = sys.argv[1:8]
    module = NetModule(scheduler=True)
    io = ZeroCheckpointIO(mode="sharded", local_tier=LocalTier(pattern, replicas=1, keep=2),
                          persist_every=int(persist_every))
    callbacks: list[Callback] = [ParamsEveryStep(out),
                                 ModelCheckpoint(dirpath=durable, every_n_train_steps=1, save_top_k=-1)]
    if crash == "1":
        callbacks.append(CrashAfterLastSave(out))
    devices = int(os.environ.get("TIERED_DEVICES", "1"))
    trainer = Trainer(
        accelerator="cpu", devices=devices, num_nodes=2, strategy=ZeroLowLevelStrategy(stage=2, bucket_size_mb=0.0005, **(
            {"shard_group_size": int(os.environ["TIERED_SHARD_GROUP"])} if os.environ.get("TIERED_SHARD_GROUP") else {})),
        plugins=[io], max_steps=int(steps), logger=False, use_distributed_sampler=False, callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, loader(int(steps), 1, 2 * devices), ckpt_path="last" if resume == "1" else None)
    _record(trainer, module, out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/multinode_train.py: gloo may abort a finished process at interpreter exit
