"""A damaged newest checkpoint: resuming from "last" falls back to the newest complete one."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_cases import NetModule, loader

from lightning_zero import ZeroLowLevelStrategy
from lightning_zero.checkpoint import ZeroCheckpointIO


def _trainer(epochs: int, dirpath: str) -> Trainer:
    return Trainer(
        accelerator="cpu", devices=2, max_epochs=epochs, logger=False, use_distributed_sampler=False,
        strategy=ZeroLowLevelStrategy(stage=2, bucket_size_mb=0.0005, start_method="forkserver"),
        plugins=[ZeroCheckpointIO(mode="local")],
        callbacks=[ModelCheckpoint(dirpath=dirpath, save_top_k=-1, save_last=True)],
        enable_progress_bar=False, enable_model_summary=False,
    )


@pytest.mark.slow
def test_damaged_last_checkpoint_on_one_rank_falls_back_to_newest_complete_one(tmp_path):
    first = str(tmp_path / "first")
    _trainer(2, first).fit(NetModule(), loader(2, 1, 2))
    assert sorted(os.listdir(first)) == ["_zero_data", "epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]
    # Damage only rank 1's file of "last": rank 0 could load it, rank 1 cannot. Both must agree.
    (victim,) = glob.glob(f"{first}/_zero_data/last.ckpt/*/rank00001-of-00002.pt")
    with open(victim, "wb") as f:
        f.write(b"not a checkpoint")
    # "last" is epoch=1 (step 4); the newest complete other checkpoint is that same state, so
    # a resume that trains to epoch 3 must equal a resume from epoch=1-step=4.ckpt directly.
    fallback = NetModule()
    # Rank 1 cannot read its file of "last", so this fit succeeds only through the fallback (the
    # warning is printed by the workers, whose stderr a shared fork server does not route to
    # pytest); ending equal to a resume from epoch=1-step=4 shows which checkpoint it chose.
    _trainer(3, str(tmp_path / "a")).fit(fallback, loader(2, 1, 2), ckpt_path=os.path.join(first, "last.ckpt"))
    direct = NetModule()
    _trainer(3, str(tmp_path / "b")).fit(direct, loader(2, 1, 2), ckpt_path=os.path.join(first, "epoch=1-step=4.ckpt"))
    for (name, a), (_, b) in zip(fallback.named_parameters(), direct.named_parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
