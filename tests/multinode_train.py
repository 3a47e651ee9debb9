"""One "node" of a two-node run on 127.0.0.1 (started twice by tests/lightning/test_multinode.py).

Usage: NODE_RANK=<0|1> MASTER_ADDR=127.0.0.1 MASTER_PORT=<port> python multinode_train.py OUT CKPT_DIR
"""

from __future__ import annotations

import os
import sys

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, os.path.dirname(__file__))

from lightning_cases import NetModule, loader  # noqa: E402

from lightning_zero import ZeroLowLevelStrategy  # noqa: E402
from lightning_zero.checkpoint import ZeroCheckpointIO  # noqa: E402

if __name__ == "__main__":
    out, ckpt_dir = sys.argv[1], sys.argv[2]
    module = NetModule(scheduler=True)
    trainer = Trainer(
        accelerator="cpu", devices=1, num_nodes=2, strategy=ZeroLowLevelStrategy(stage=2, bucket_size_mb=0.0005),
        plugins=[ZeroCheckpointIO(mode="sharded")], max_steps=3, logger=False, use_distributed_sampler=False,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3)],
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, loader(3, 1, 2))
    if trainer.is_global_zero:
        torch.save({"params": {n: p.detach() for n, p in module.net.named_parameters()},
                    "shard_numel": trainer.strategy.optimizer_shard_numel, "world_size": trainer.world_size}, out)
    # Leave like a fork-server worker does: gloo can abort a process that already finished its
    # work while the interpreter shuts down (see tests/lightning/test_strategy.py), failing the test at random.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
