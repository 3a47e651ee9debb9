"""``ModelCheckpoint(save_last="link")`` with ZeroCheckpointIO, on a local disk and on S3.

2 ranks of ZeRO-2 save every step and keep the newest 2; ``last.ckpt`` must name the newest
committed checkpoint (a symlink on local disks, a copy of the commit marker on S3), and a fresh
Trainer resuming from ``"last"`` with a perturbed module must end bit-identical to an
uninterrupted 2-epoch run (the pattern of tests/checkpoint/lightning/test_checkpoint_resume.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from checkpoint_cases import MODES, assert_same_weights, fit
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroCheckpointIO, ZeroLowLevelStrategy

if TYPE_CHECKING:
    from s3_server import S3  # the type of the s3 fixture (tests/conftest.py)

pytestmark = pytest.mark.slow

FIRST_EPOCH = ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]
SECOND_EPOCH = ["epoch=1-step=3.ckpt", "epoch=1-step=4.ckpt"]


def link_trainer(mode: str, dirpath: str, max_epochs: int, storage_options: dict[str, Any] | None = None) -> Trainer:
    """2 CPU ranks of ZeRO-2 over 2 steps an epoch, saving every step, newest 2 kept, ``last`` a link."""
    return Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroLowLevelStrategy(stage=2, start_method="forkserver"),
        plugins=[ZeroCheckpointIO(mode=mode, storage_options=storage_options)],  # type: ignore[arg-type]
        callbacks=[ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=2, monitor="step", mode="max",
                                   save_last="link")],
        max_epochs=max_epochs,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=None if "://" in dirpath else dirpath,
    )


def checkpoint_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != "_zero_data")


@pytest.mark.parametrize("mode", MODES)
def test_last_links_to_the_newest_checkpoint_and_resumes(uninterrupted: dict[str, torch.Tensor], tmp_path: Path,
                                                         mode: str) -> None:
    fit(link_trainer(mode, str(tmp_path), 1))
    last = tmp_path / "last.ckpt"
    assert checkpoint_names(tmp_path) == [*FIRST_EPOCH, "last.ckpt"]
    assert last.is_symlink() and os.readlink(last) == FIRST_EPOCH[-1]

    resumed = fit(link_trainer(mode, str(tmp_path), 2), ckpt_path="last", perturb=True)
    assert_same_weights(resumed, uninterrupted, f"{mode}: resumed from last -> {FIRST_EPOCH[-1]}")
    # The resumed run went on linking, and retention removed the first epoch's checkpoints.
    assert checkpoint_names(tmp_path) == [*SECOND_EPOCH, "last.ckpt"]
    assert os.readlink(last) == SECOND_EPOCH[-1]


@pytest.mark.s3
def test_last_on_s3_is_a_copy_of_the_newest_marker_and_resumes(uninterrupted: dict[str, torch.Tensor],
                                                               s3: S3) -> None:
    prefix = s3.fresh_prefix("link-last")

    def names() -> list[str]:
        return sorted(k.rsplit("/", 1)[-1] for k in s3.keys(prefix) if "/_zero_data/" not in k)

    fit(link_trainer("sharded", prefix, 1, s3.storage_options))
    assert names() == [*FIRST_EPOCH, "last.ckpt"]
    assert s3.read(f"{prefix}/last.ckpt") == s3.read(f"{prefix}/{FIRST_EPOCH[-1]}")

    resumed = fit(link_trainer("sharded", prefix, 2, s3.storage_options), ckpt_path="last", perturb=True)
    assert_same_weights(resumed, uninterrupted, "sharded on S3: resumed from last")
    assert names() == [*SECOND_EPOCH, "last.ckpt"]
    assert s3.read(f"{prefix}/last.ckpt") == s3.read(f"{prefix}/{SECOND_EPOCH[-1]}")
