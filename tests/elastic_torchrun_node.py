"""examples/elastic.py under torchrun with slow steps that say when a save is complete (run by
tests/faults/test_torchrun_elastic.py and bench/recovery.py, one torchrun agent per "node").

Usage: ELASTIC_NODE_NAME=<a|b> [ELASTIC_STEP_SLEEP=<s>] torchrun ... elastic_torchrun_node.py <examples/elastic.py args>

Before every step but the first of a start, every rank waits for the previous step's save to commit (locally
and replicated), the ranks meet, and each node's local rank 0 prints ``SAVED node=<name> step=<n> world=<ws>
restart=<count>``; then every rank sleeps ELASTIC_STEP_SLEEP seconds (default 1). A kill in that sleep
lands between saves, never in one.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.elastic import main  # noqa: E402


class SavedThenSlow(Callback):
    def __init__(self, sleep: float) -> None:
        self.sleep = sleep
        self.first = True

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:  # noqa: ANN001
        if self.first:  # nothing saved yet by this start
            self.first = False
            return
        trainer.strategy.checkpoint_io.finalize()
        dist.barrier()
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            print(f"SAVED node={os.environ.get('ELASTIC_NODE_NAME')} step={trainer.global_step}"
                  f" world={trainer.world_size} restart={os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
                  f" at={time.time():.3f}", flush=True)
        time.sleep(self.sleep)


if __name__ == "__main__":
    main(sys.argv[1:], callbacks=[SavedThenSlow(float(os.environ.get("ELASTIC_STEP_SLEEP", 1)))])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo may abort a finished process at interpreter exit
