"""Trainer runs whose training step records the sample ids it trained on (tests/lightning/test_data_position.py)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from lifecycle_cases import as_torchrun
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from lightning_zero import ZeroLowLevelStrategy
from lightning_zero.checkpoint import ZeroCheckpointIO
from lightning_zero.data import DataPosition, ElasticDistributedSampler

SAMPLES = 24
BATCH = 2


class Ids(Dataset):
    """Sample i is its id and a fixed input."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        return index, torch.full((3,), float(index) / SAMPLES)


class RecordsIds(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(3, 3)
        self.seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, x = batch
        self.seen += [int(i) for i in ids]
        return F.mse_loss(self.layer(x), x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_ids(rank: int, world_size: int, root: str, name: str, max_steps: int, ckpt_path: str | None,
            epochs: int = 1) -> dict[str, Any]:
    """A fit of ``max_steps`` (-1: to the end of ``epochs``); ModelCheckpoint saves every 3 steps in
    ``root/name/`` (``step=3.ckpt``: in the middle of the epoch, as a job killed later resumes)."""
    as_torchrun(rank, world_size)
    loader = DataLoader(Ids(), batch_size=BATCH, sampler=ElasticDistributedSampler(Ids(), shuffle=True, seed=3),
                        num_workers=1)  # a worker reads ahead of the training loop
    module = RecordsIds()
    trainer = Trainer(accelerator="cpu", devices=world_size, strategy=ZeroLowLevelStrategy(stage=2),
                      plugins=[ZeroCheckpointIO(mode="sharded")], max_steps=max_steps, max_epochs=epochs,
                      callbacks=[DataPosition(), ModelCheckpoint(dirpath=os.path.join(root, name), filename="{step}",
                                                                 every_n_train_steps=3, save_top_k=-1)],
                      logger=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return {"seen": module.seen, "path": os.path.join(root, name, "step=3.ckpt"), "global_step": trainer.global_step,
            "epoch": trainer.current_epoch}
