"""A save without optimizer state is the plain file DDP writes, in every mode ([Note: model-only saves] in
lightning_zero/checkpoint/lightning/lightning_tree.py): ``ModelCheckpoint(save_weights_only=True)`` and
``trainer.save_checkpoint(path, weights_only=True)`` under the Trainer, ``fabric.save(path, {"model": model})``
under Fabric; read by ``torch.load`` and by a program that never imports this package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_distributed
from checkpoint_cases import MODES, assert_same_weights, fit, make_trainer
from fabric_cases import FabricCase, params_of, set_up, train_steps
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroCheckpointIO
from lightning_zero.checkpoint import maybe_finalize_async_calls

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
DDP_KEYS = {"epoch", "global_step", "pytorch-lightning_version", "state_dict", "loops"}
"""What Lightning's ``dump_checkpoint(weights_only=True)`` holds for this module, and so what DDP's file holds."""


class SaveWeightsAtEnd(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.save_checkpoint(self.path, weights_only=True)


def read_plainly(ckpt: Path, out: Path) -> dict[str, Any]:
    """plain_reader.py in a fresh interpreter: no lightning_zero on its path or in its imports."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(HERE / "plain_reader.py"), str(ckpt), str(out)], env=env, cwd="/",
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("mode", MODES)
def test_a_weights_only_checkpoint_is_the_file_ddp_writes_and_a_plain_trainer_validates_from_it(
        tmp_path: Path, mode: str) -> None:
    ckpts = tmp_path / "ckpts"
    end = tmp_path / "end.ckpt"
    trainer = make_trainer(mode, ckpts, 2, callbacks=[
        ModelCheckpoint(dirpath=str(ckpts), save_weights_only=True, every_n_train_steps=1),
        SaveWeightsAtEnd(str(end))])
    final = fit(trainer)
    # keep-last-n (save_top_k=1): one file left, the newest; nothing of this package beside it
    assert sorted(os.listdir(ckpts)) == ["epoch=1-step=4.ckpt"]
    for path in (ckpts / "epoch=1-step=4.ckpt", end):
        content = torch.load(path, weights_only=True, map_location="cpu")
        assert set(content) == DDP_KEYS, sorted(content)
        assert content["global_step"] == 4
        weights = {k.removeprefix("net."): v for k, v in content["state_dict"].items()}
        assert_same_weights({f"net.{k}": v for k, v in weights.items()}, final, f"{mode}: {path.name}")
    validated = read_plainly(end, tmp_path / "out.pt")
    assert validated["imported"] == []
    assert_same_weights(validated["state_dict"], final, f"{mode}: a plain Trainer's validate(ckpt_path=...)")


def fabric_model_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Two steps, then ``fabric.save(path, {"model": model})`` in each mode (async, the default plugin's)."""
    case = FabricCase(strategy="zero2")
    live: dict[str, Any] = {}
    for mode in MODES:
        loop = set_up(rank, world_size, case, plugins=[ZeroCheckpointIO(mode=mode)])
        train_steps(loop, case, rank, world_size, 0, 2)
        loop.fabric.save(os.path.join(root, f"{mode}.pth"), {"model": loop.model})
        live[mode] = params_of(loop.model)
        train_steps(loop, case, rank, world_size, 2, 3)  # the update after the save leaves the file as it was
        maybe_finalize_async_calls(blocking=True)
        loop.fabric.strategy.teardown()
    return live


def test_fabric_save_of_a_model_alone_is_the_file_fabrics_ddp_writes(tmp_path: Path) -> None:
    live = run_distributed(fabric_model_save, 2, str(tmp_path), start_method="forkserver")[0]
    for mode in MODES:
        content = torch.load(tmp_path / f"{mode}.pth", weights_only=True)
        assert list(content) == ["model"], f"{mode}: {sorted(content)}"
        assert content["model"].keys() == live[mode].keys()
        for name, value in live[mode].items():
            assert torch.equal(content["model"][name], value), f"{mode}: {name}"
    assert sorted(os.listdir(tmp_path)) == [f"{mode}.pth" for mode in sorted(MODES)]  # one file each, rank 0's
