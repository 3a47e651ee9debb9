"""One "node" of a two-node Trainer run whose node 1 is killed or frozen (started twice by
tests/faults/test_peer_loss_trainer.py).

Usage: NODE_RANK=<0|1> MASTER_ADDR=127.0.0.1 MASTER_PORT=<port> python peer_loss_train.py SIGNAL WHEN CKPT_DIR

SIGNAL is KILL or STOP; WHEN is ``train`` (node 1 signals itself at the start of step 3) or ``save``
(node 1 signals itself while its part of the step-2 checkpoint is being written).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_cases import NetModule, loader  # noqa: E402

from lightning_zero import ZeroCheckpointIO, ZeroLowLevelStrategy  # noqa: E402
from lightning_zero.checkpoint.modes import local  # noqa: E402

TIMEOUT_S = 8


def signal_self(sig: signal.Signals, ckpt_dir: str) -> None:
    """Note the wall-clock time (the test measures the survivor's exit against it), then the signal."""
    with open(os.path.join(ckpt_dir, "signalled-at"), "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), sig)


class SignalSelf(Callback):
    def __init__(self, sig: signal.Signals, when: str, ckpt_dir: str) -> None:
        self.sig, self.when, self.ckpt_dir = sig, when, ckpt_dir

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.node_rank == 1 and self.when == "train" and trainer.global_step == 3:
            signal_self(self.sig, self.ckpt_dir)

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        if trainer.node_rank != 1 or self.when != "save":
            return
        real_write = local.write_local

        def write_then_die(*write_args: Any, **kwargs: Any) -> None:
            signal_self(self.sig, self.ckpt_dir)
            real_write(*write_args, **kwargs)

        local.write_local = write_then_die


if __name__ == "__main__":
    sig, when, ckpt_dir = signal.Signals[f"SIG{sys.argv[1]}"], sys.argv[2], sys.argv[3]
    os.makedirs(ckpt_dir, exist_ok=True)
    trainer = Trainer(
        accelerator="cpu", devices=1, num_nodes=2, max_steps=6, logger=False, use_distributed_sampler=False,
        strategy=ZeroLowLevelStrategy(stage=2, bucket_size_mb=0.0005, timeout=timedelta(seconds=TIMEOUT_S)),
        plugins=[ZeroCheckpointIO(mode="local")],
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1), SignalSelf(sig, when, ckpt_dir)],
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(NetModule(), loader(6, 1, 2))
    sys.stdout.flush()
    os._exit(0)
