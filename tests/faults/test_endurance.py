"""Long runs: 200 consecutive async saves keep threads, file descriptors and memory flat and leave
exactly the retained checkpoints; with ``save_top_k`` and ``save_last`` and saves every step (on
disk, and on S3 behind a proxy that adds latency to every request, so saves overlap training), at
every moment between steps at least one complete, loadable checkpoint exists."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from fault_cases import Watch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_cases import NetModule, loader
from s3_proxy import faulty_proxy

from lightning_zero import ZeroCheckpointIO, ZeroLowLevelStrategy

if TYPE_CHECKING:
    from s3_server import S3  # the type of the s3 fixture (tests/conftest.py)


def run(ckpt_dir: str, out_dir: Path, steps: int, top_k: int, mode: str = "local",
        storage_options: dict[str, Any] | None = None, every: int = 1, check_loadable: bool = True) -> None:
    trainer = Trainer(
        accelerator="cpu", devices=2, max_steps=steps, max_epochs=-1, logger=False, use_distributed_sampler=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=ZeroLowLevelStrategy(stage=2, start_method="forkserver"),
        plugins=[ZeroCheckpointIO(mode=mode, storage_options=storage_options)],
        callbacks=[Watch(str(out_dir), ckpt_dir, every, storage_options, check_loadable),
                   ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=top_k, monitor="step",
                                   mode="max", save_last=True)],
    )
    # 10 batches an epoch: the dataset's tensors go to the fork-server workers as file descriptors.
    trainer.fit(NetModule(), loader(min(steps, 10), 1, 2))


def records(out_dir: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out_dir / f"rank{rank}.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_200_async_saves_keep_threads_fds_and_memory_flat_and_leave_only_the_retained(tmp_path: Path) -> None:
    ckpts, out = tmp_path / "ckpts", tmp_path / "out"
    out.mkdir()
    run(str(ckpts), out, steps=200, top_k=3, every=10, check_loadable=False)
    for rank in (0, 1):
        figures = records(out, rank)
        early, late = figures[2], figures[-1]  # step 20 (everything started) and step 190
        print(f"rank {rank}: step {early['step']}: {early}; step {late['step']}: {late}")
        assert late["threads"] == early["threads"], figures
        assert abs(late["fds"] - early["fds"]) <= 2, figures
        assert late["rss"] - early["rss"] < 32 * 2**20, figures
    names = sorted(os.listdir(ckpts))
    assert names == ["_zero_data", "epoch=19-step=198.ckpt", "epoch=19-step=199.ckpt", "epoch=19-step=200.ckpt",
                     "last.ckpt"], names
    data = {name: os.listdir(ckpts / "_zero_data" / name) for name in os.listdir(ckpts / "_zero_data")}
    assert sorted(data) == [n for n in names if n.endswith(".ckpt")], data
    assert all(len(versions) == 1 for versions in data.values()), data


@pytest.mark.slow
def test_keep_last_n_under_async_saves_always_leaves_a_complete_checkpoint_on_disk(tmp_path: Path) -> None:
    ckpts, out = tmp_path / "ckpts", tmp_path / "out"
    out.mkdir()
    run(str(ckpts), out, steps=30, top_k=2)
    checks = [r for r in records(out, 0) if "complete" in r]
    assert len(checks) == 29
    assert all(r["complete"] for r in checks), [r for r in checks if not r["complete"]]


@pytest.mark.s3
@pytest.mark.slow
def test_keep_last_n_under_async_saves_always_leaves_a_complete_checkpoint_on_slow_s3(
        s3: S3, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    prefix = s3.fresh_prefix("keep-last")
    with faulty_proxy(s3.endpoint_url) as proxy:
        proxy.delay_s = 0.01  # every request: saves take longer than a training step
        options = s3.options(proxy.endpoint_url)
        run(prefix, out, steps=10, top_k=2, mode="sharded", storage_options=options)
    checks = [r for r in records(out, 0) if "complete" in r]
    assert len(checks) == 9
    assert all(r["complete"] for r in checks), [r for r in checks if not r["complete"]]
