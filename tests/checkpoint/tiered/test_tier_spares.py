"""A local tier's spare files ([Note: spare tier files] in checkpoint/tiered/spares.py): retired checkpoints'
files are written over by the next saves, cut to length, and deleted at the end of fit."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_cases import NetModule, loader

from lightning_zero import LocalTier, ZeroCheckpointIO, ZeroLowLevelStrategy
from lightning_zero.checkpoint.store import file_io, storage
from lightning_zero.checkpoint.tiered import spares as tier_spares
from lightning_zero.checkpoint.tiered.tiers import tier_markers


def test_retired_files_become_spares_up_to_the_limit_and_each_is_claimed_once(tmp_path):
    root = str(tmp_path)
    old = tmp_path / "_zero_data" / "a.ckpt" / "v1"
    old.mkdir(parents=True)
    for i in range(3):
        (old / f"rank{i}.pt").write_bytes(b"x" * (i + 1))
    (old / "rank9.pt.tmp-1234").write_bytes(b"partial")
    tier_spares.retire(str(tmp_path / "_zero_data" / "a.ckpt"), root, limit=2)
    assert not (tmp_path / "_zero_data" / "a.ckpt").exists()
    assert len(os.listdir(tier_spares.spare_dir(root))) == 2  # the third and the temporary were deleted
    claimed = [tier_spares.claim(root, str(tmp_path / f"new{i}")) for i in range(3)]
    assert claimed == [True, True, False]
    assert sorted(len((tmp_path / f"new{i}").read_bytes()) for i in range(2)) in ([1, 2], [1, 3], [2, 3])
    tier_spares.clear(root)
    assert not os.path.exists(tier_spares.spare_dir(root))


def test_a_file_written_over_a_longer_spare_holds_only_its_own_bytes(tmp_path):
    root = str(tmp_path)
    pool = tier_spares.spare_dir(root)
    os.makedirs(pool)
    with open(os.path.join(pool, "old"), "wb") as f:
        f.write(os.urandom(1 << 20))  # longer than what is written over it
    inode = os.stat(os.path.join(pool, "old")).st_ino
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 3}
    loc = storage.resolve(str(tmp_path / "x.ckpt"))
    file_io.write_file(loc, str(tmp_path / "over.pt"), state, recycle=lambda path: tier_spares.claim(root, path))
    file_io.write_file(loc, str(tmp_path / "fresh.pt"), state)
    assert os.stat(tmp_path / "over.pt").st_ino == inode  # written over the spare, not a new file
    assert (tmp_path / "over.pt").read_bytes() == (tmp_path / "fresh.pt").read_bytes()
    loaded = torch.load(tmp_path / "over.pt", weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3


class _SpareInodes(Callback):
    """Before each step: the previous save finished; the spares' inodes, and the newest local file's."""

    def __init__(self, root: str) -> None:
        self.root, self.seen = root, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        trainer.strategy.checkpoint_io.finalize()
        pool = tier_spares.spare_dir(self.root)
        spares = {os.stat(os.path.join(pool, n)).st_ino for n in os.listdir(pool)} if os.path.isdir(pool) else set()
        markers = tier_markers(self.root)
        newest = None
        if markers:
            data = os.path.join(self.root, markers[0][1]["data"])
            newest = os.stat(os.path.join(data, os.listdir(data)[0])).st_ino
        self.seen.append((spares, newest))


@pytest.mark.usefixtures("in_process_trainer_group")
def test_tier_saves_write_over_retired_files_and_the_end_of_fit_deletes_the_spares(tmp_path):
    root = str(tmp_path / "local" / "node0")
    watch = _SpareInodes(root)
    io = ZeroCheckpointIO(mode="sharded", local_tier=LocalTier(str(tmp_path / "local" / "node{node_rank}"), keep=1),
                          persist_every=100)
    module = NetModule()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False, use_distributed_sampler=False,
                      strategy=ZeroLowLevelStrategy(stage=2, bucket_size_mb=0.0005, start_method="popen"),
                      plugins=[io], enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[watch, ModelCheckpoint(dirpath=tmp_path / "durable", every_n_train_steps=1,
                                                        save_top_k=-1)])
    trainer.fit(module, loader(5, 1, 1))
    # keep=1: save 2's commit retires save 1's file, a spare that save 3 writes over, and so on.
    written_over = [newest in watch.seen[step - 1][0] for step, (_, newest) in enumerate(watch.seen) if step >= 3]
    assert written_over == [True, True], watch.seen
    assert not os.path.exists(tier_spares.spare_dir(root))
    resumed = NetModule()
    again = Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False, use_distributed_sampler=False,
                    strategy=ZeroLowLevelStrategy(stage=2, bucket_size_mb=0.0005, start_method="popen"),
                    plugins=[ZeroCheckpointIO(mode="sharded", local_tier=LocalTier(str(tmp_path / "local" / "node{node_rank}"),
                                                                                  keep=1), persist_every=100)],
                    enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[ModelCheckpoint(dirpath=tmp_path / "durable", every_n_train_steps=1, save_top_k=-1)])
    again.fit(resumed, loader(5, 1, 1), ckpt_path="last")
    assert again.strategy.checkpoint_io.last_load.tier == "local"
    for (name, value), (_, other) in zip(module.net.named_parameters(), resumed.net.named_parameters()):
        assert torch.equal(value, other), name
