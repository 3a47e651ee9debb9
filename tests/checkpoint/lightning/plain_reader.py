"""A program that has never heard of lightning_zero reads a weights-only checkpoint as a DDP user would.

``python plain_reader.py CKPT OUT``: ``load_from_checkpoint`` and a plain Trainer's ``validate(ckpt_path=...)``
on one CPU process with Lightning's default strategy; writes the validated module's ``state_dict`` and the
names of the modules this process imported under ``lightning_zero`` (none expected) to ``OUT``.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):  # the layers of tests/engine_cases.py's Net, typed here: no import of the test helpers
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(7, 11)
        self.hidden = nn.Linear(11, 13)
        self.branch = nn.Linear(13, 13)
        self.dropped = nn.Linear(13, 13)
        self.frozen = nn.Linear(13, 13)
        self.head = nn.Linear(13, 11)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(torch.tanh(self.embed(x))))
        h = self.head(h + self.frozen(h)) * self.scale
        return F.linear(h, self.embed.weight.t())


class NetModule(LightningModule):
    def __init__(self, optimizer: str = "adamw", scheduler: bool = False) -> None:
        super().__init__()
        self.net = Net()

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = F.mse_loss(self.net(batch[0]), batch[1])
        self.log("val_loss", loss)
        return loss


def main(ckpt: str, out: str) -> None:
    loaded = NetModule.load_from_checkpoint(ckpt, map_location="cpu")
    module = NetModule()
    data = DataLoader(TensorDataset(torch.randn(8, 7), torch.randn(8, 7)), batch_size=4)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.validate(module, data, ckpt_path=ckpt)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, module.state_dict()[name]), name
    ours = sorted(name for name in sys.modules if name.startswith("lightning_zero"))
    torch.save({"state_dict": module.state_dict(), "imported": ours}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
