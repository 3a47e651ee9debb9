"""Trainer runs whose training step records the sample ids it trained on (tests/lightning/test_data_position.py)."""

from __future__ import annotations

import os
import warnings
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lifecycle_cases import as_torchrun
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_zero import ZeroLowLevelStrategy
from lightning_zero._compat import NOT_RESUMABLE_WARNING
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
            epochs: int = 1, sampler: Literal["elastic", "lightning", "own"] = "elastic",
            data_position: bool = True) -> dict[str, Any]:
    """A fit of ``max_steps`` (-1: to the end of ``epochs``); ModelCheckpoint saves every 3 steps in
    ``root/name/`` (``step=3.ckpt``: in the middle of the epoch, as a job killed later resumes).

    ``sampler``: the loader's: an ElasticDistributedSampler, none (``shuffle=True``: the sampler Lightning puts in)
    or a DistributedSampler of the user's own. ``data_position``: the DataPosition callback given to the Trainer.
    The result names the training loader's sampler, whether it is the user's object, the DataPosition callbacks
    of the run and the "not resumable" warnings rank 0 gave."""
    as_torchrun(rank, world_size)
    kinds = {"elastic": ElasticDistributedSampler(Ids(), shuffle=True, seed=3), "lightning": None,
             "own": DistributedSampler(Ids(), num_replicas=world_size, rank=rank, shuffle=True, seed=3)}
    own = kinds[sampler]
    loader = DataLoader(Ids(), batch_size=BATCH, sampler=own, shuffle=True if own is None else None,
                        num_workers=1)  # a worker reads ahead of the training loop
    module = RecordsIds()
    callbacks: list[Any] = [ModelCheckpoint(dirpath=os.path.join(root, name), filename="{step}", every_n_train_steps=3,
                                            save_top_k=-1)]
    if data_position:
        callbacks.insert(0, DataPosition())
    trainer = Trainer(accelerator="cpu", devices=world_size, strategy=ZeroLowLevelStrategy(stage=2),
                      plugins=[ZeroCheckpointIO(mode="sharded")], max_steps=max_steps, max_epochs=epochs,
                      callbacks=callbacks, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader, ckpt_path=ckpt_path)
    train_sampler = trainer.train_dataloader.sampler
    return {"seen": module.seen, "path": os.path.join(root, name, "step=3.ckpt"), "global_step": trainer.global_step,
            "epoch": trainer.current_epoch, "sampler": type(train_sampler).__name__,
            "own_sampler": train_sampler is own,
            "positions": sum(isinstance(c, DataPosition) for c in trainer.callbacks),
            "not_resumable": [str(w.message) for w in caught if NOT_RESUMABLE_WARNING in str(w.message)]}
