"""Each checkpoint save's cost reaches Lightning's loggers from rank 0, and ``last_save_stats`` reads it."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning_cases import NetModule, loader

from lightning_zero import ZeroCheckpointIO, ZeroLowLevelStrategy
from lightning_zero.checkpoint import (
    async_save,
    last_save_stats,
    maybe_finalize_async_calls,
    wait_for_staging,
)

METRICS = ["blocked_ms", "staging_wait_ms", "staging_ms", "write_ms", "commit_ms", "committed_after_ms", "bytes",
           "throughput_mb_s", "step"]


def checkpoint_rows(metrics_csv: Path) -> list[dict[str, float]]:
    with open(metrics_csv) as f:
        rows = [row for row in csv.DictReader(f) if row.get("checkpoint/blocked_ms")]
    return [{name: float(row[f"checkpoint/{name}"]) for name in METRICS} for row in rows]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["local", "sharded", "full"])
def test_csv_logger_receives_every_saves_timings_and_bytes_through_a_trainer_run(tmp_path: Path, mode: str) -> None:
    steps, every = 4, 2
    trainer = Trainer(
        accelerator="cpu", devices=2, max_steps=steps, use_distributed_sampler=False,
        strategy=ZeroLowLevelStrategy(stage=2, bucket_size_mb=0.0005, start_method="forkserver"),
        plugins=[ZeroCheckpointIO(mode=mode)],
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=every, save_top_k=-1)],
        logger=CSVLogger(tmp_path, name="run", version=0),
        enable_progress_bar=False, enable_model_summary=False,
    )
    module = NetModule()
    trainer.fit(module, loader(steps, 1, 2))

    rows = checkpoint_rows(tmp_path / "run" / "version_0" / "metrics.csv")
    # One row per save, logged once (by rank 0), including the last save that teardown finalized.
    assert [row["step"] for row in rows] == [2.0, 4.0]
    n_params = sum(p.numel() for p in module.parameters())
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    for row in rows:
        assert row["blocked_ms"] > 0 and row["staging_ms"] > 0 and row["write_ms"] > 0 and row["commit_ms"] >= 0
        # The call returned before the background work finished: from the call to the commit is at
        # least the staging and the writing.
        assert row["committed_after_ms"] >= row["staging_ms"] + row["write_ms"]
        if mode == "full":  # rank 0 writes the whole state: the weights at least, and AdamW's moments
            assert row["bytes"] > 4 * n_params
        else:  # rank 0's fp32 master shard at least, never the whole state
            assert 4 * (trained // 2) <= row["bytes"] < 3 * 4 * n_params
        assert row["throughput_mb_s"] == pytest.approx(row["bytes"] / row["write_ms"] / 1e3, rel=1e-3)


def test_last_save_stats_reports_the_newest_committed_save_of_the_functional_api(
        tmp_path: Path, single_rank_group: None) -> None:
    state = {"model": {"w": torch.ones(1000), "b": torch.zeros(24)}, "step": 3}
    async_save(state, str(tmp_path / "a"), mode="local")
    wait_for_staging()
    assert maybe_finalize_async_calls(blocking=True)
    first = last_save_stats()
    assert first is not None and first.url.endswith("/a") and first.mode == "local"
    assert first.bytes_written == 4 * 1024 and first.step is None
    assert first.blocked_s > 0 and first.write_s > 0 and first.committed_after_s >= first.write_s

    async_save(state, str(tmp_path / "b"), mode="sharded", marker_fields={"global_step": 7})
    maybe_finalize_async_calls(blocking=True)
    second = last_save_stats()
    assert second is not None and second.url.endswith("/b") and second.step == 7
    assert second.as_metrics()["checkpoint/bytes"] == 4 * 1024
    assert ZeroCheckpointIO().last_save_stats is second


def test_prog_bar_shows_the_newest_saves_blocked_and_commit_times(tmp_path: Path,
                                                                  in_process_trainer_group: None) -> None:
    from lightning_zero.checkpoint import CheckpointMetrics

    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=4, use_distributed_sampler=False, logger=False,
        strategy=ZeroLowLevelStrategy(stage=2), plugins=[ZeroCheckpointIO(mode="local")],
        callbacks=[CheckpointMetrics(prog_bar=True),
                   ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=1)],
        enable_progress_bar=True, enable_model_summary=False,
    )
    trainer.fit(NetModule(), loader(4, 1, 1))
    assert sum(isinstance(c, CheckpointMetrics) for c in trainer.callbacks) == 1  # the strategy added none
    shown = trainer.progress_bar_metrics
    assert shown["ckpt_blocked_ms"] > 0 and shown["ckpt_commit_ms"] > 0


def test_the_strategys_save_hook_builds_its_tree_with_the_collector_paused(
        tmp_path: Path, in_process_trainer_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: the collector and a save's objects] in checkpoint/saver.py: the tree ModelCheckpoint's save builds on
    the training thread is made with the collector paused (its objects live until the save's job ends), and the
    collector is on again after the fit's saves."""
    import gc

    from lightning_zero.checkpoint.lightning import entry

    seen = []
    build_tree = entry.build_tree

    def recording(*args: object, **kwargs: object) -> object:
        seen.append(gc.isenabled())
        return build_tree(*args, **kwargs)

    monkeypatch.setattr(entry, "build_tree", recording)  # as the strategy calls it
    assert gc.isenabled()
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=3, use_distributed_sampler=False, logger=False,
        strategy=ZeroLowLevelStrategy(stage=2), plugins=[ZeroCheckpointIO(mode="local", async_save=True)],
        callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)],
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(NetModule(), loader(4, 1, 1))
    assert seen == [False, False, False]
    assert gc.isenabled()
