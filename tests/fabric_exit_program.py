"""A Fabric program as one is written elsewhere: it saves at its last step with ``fabric.save`` and ends, with
no ``fabric.strategy.teardown()`` (tests/fabric/test_fabric_exit.py). Each write is held back ``DELAY`` seconds, so the
save is still in flight when the script's last line has run.

    python fabric_exit_program.py PATH MODE DEVICES
"""

from __future__ import annotations

import sys
import time

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_zero import ZeroCheckpointIO
from lightning_zero.checkpoint.store import file_io
from lightning_zero.fabric import ZeroLowLevelStrategy

DELAY = 1.5


def slow(write):
    def held_back(*args, **kwargs):
        time.sleep(DELAY)
        return write(*args, **kwargs)
    return held_back


def main(path: str, mode: str, devices: int) -> None:
    file_io.torch_save_to = slow(file_io.torch_save_to)  # a full file, a local rank file, a marker
    file_io.write_file = slow(file_io.write_file)
    strategy = ZeroLowLevelStrategy(stage=2, checkpoint_io=ZeroCheckpointIO(mode=mode))
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    for _ in range(2):
        loss = model(torch.randn(4, 8)).square().mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(path, {"model": model, "optimizer": optimizer, "iter_num": 2})
    fabric.print("saved: queued")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
