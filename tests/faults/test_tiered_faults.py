"""Tiered checkpoints under faults, on two "nodes" on 127.0.0.1 (``num_nodes=2``, one rank each, each node
with its own local directory): a node's local storage lost, both copies of a rank's file lost, and, in one
process, the durable tier unreachable."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import pytest
import torch
from _dist import free_port
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_cases import NetModule, loader

from lightning_zero import LocalTier, ZeroCheckpointIO, ZeroLowLevelStrategy
from lightning_zero.checkpoint.tiered.tiers import tier_markers

TESTS = os.path.dirname(os.path.dirname(__file__))


pytestmark = pytest.mark.usefixtures("in_process_trainer_group")


def _two_nodes(tmp_path, out: str, steps: int, persist_every: int, resume: bool, crash: bool,
               kill_node1: str | None = None, devices: int = 1, shard_group_size: int | None = None) -> str:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1",
           "TIERED_DEVICES": str(devices), **({"TIERED_SHARD_GROUP": str(shard_group_size)} if shard_group_size else {})}
    env.pop("WORLD_SIZE", None)
    args = [sys.executable, os.path.join(TESTS, "tiered_node.py"), str(tmp_path / out), str(tmp_path / "durable"),
            str(tmp_path / "node{node_rank}"), str(steps), str(persist_every), str(int(resume)), str(int(crash))]
    kill = {"TIERED_KILL": kill_node1} if kill_node1 else {}
    nodes = [subprocess.Popen(args, env={**env, "NODE_RANK": str(rank), **(kill if rank == 1 else {})},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    logs = [node.communicate(timeout=300)[0] for node in nodes]
    if kill_node1:
        assert nodes[1].returncode == 17, "\n\n".join(logs)
        assert nodes[0].returncode != 0, "\n\n".join(logs)  # its save failed: the peer was lost
    else:
        assert [node.returncode for node in nodes] == [0, 0], "\n\n".join(logs)
    return "\n".join(logs)


def _rank_files(root, rank: int, world_size: int = 2) -> list[str]:
    return glob.glob(f"{root}/_zero_data/*/*/rank{rank:05d}-of-{world_size:05d}.pt")


@pytest.mark.slow
def test_a_node_that_lost_its_local_storage_resumes_from_the_replica_bit_exact(tmp_path):
    # Run 1 saves every step and dies after its last save committed: nothing ever reached the durable tier.
    _two_nodes(tmp_path, "first.pt", steps=2, persist_every=10, resume=False, crash=True)
    assert not glob.glob(str(tmp_path / "durable" / "*.ckpt"))
    # Each node holds its own rank's file and the other node's replica, committed.
    for node in (0, 1):
        newest = tier_markers(str(tmp_path / f"node{node}"))[0][1]["tier"]
        assert newest["ranks"] == [0, 1] and newest["replicated"] and newest["step"] == 2
    shutil.rmtree(tmp_path / "node1")  # node 1 lost its local storage
    log = _two_nodes(tmp_path, "second.pt", steps=2, persist_every=10, resume=True, crash=False)
    first, second = torch.load(tmp_path / "first.pt"), torch.load(tmp_path / "second.pt")
    assert second["tier"] == "local", log
    assert second["step"] == 2
    for name, value in first["params"].items():
        assert torch.equal(second["params"][name], value), name
    assert "fetched their files" in log
    assert _rank_files(tmp_path / "node1", 1)  # node 1 holds its own file again


@pytest.mark.slow
@pytest.mark.parametrize("shard_group_size", [None, 2], ids=["flat", "hybrid"])
def test_two_ranks_per_node_replicate_to_their_peers_and_resume_after_a_node_lost_its_storage(tmp_path,
                                                                                             shard_group_size):
    # 2 nodes x 2 ranks: rank l of node 0 sends to rank l of node 1 and back; each node's directory is shared
    # by its two ranks (one marker, written by its lowest rank), and ends up holding all four files. Hybrid:
    # sharded within each node (shard_group_size=2), replicated across the two.
    _two_nodes(tmp_path, "first.pt", steps=3, persist_every=10, resume=False, crash=True, devices=2,
               shard_group_size=shard_group_size)
    for node in (0, 1):
        markers = tier_markers(str(tmp_path / f"node{node}"))
        newest = markers[0][1]["tier"]
        assert newest["ranks"] == [0, 1, 2, 3] and newest["replicated"] and newest["step"] == 3
        assert len(markers) == 2  # keep=2
        assert markers[0][1].get("shard_group_size") == shard_group_size
        for rank in range(4):
            assert len(_rank_files(tmp_path / f"node{node}", rank, 4)) == 2  # in each kept checkpoint
    shutil.rmtree(tmp_path / "node1")  # node 1 (ranks 2 and 3) lost its local storage
    log = _two_nodes(tmp_path, "second.pt", steps=3, persist_every=10, resume=True, crash=False, devices=2,
                     shard_group_size=shard_group_size)
    first, second = torch.load(tmp_path / "first.pt"), torch.load(tmp_path / "second.pt")
    assert second["tier"] == "local" and second["step"] == 3, log
    for name, value in first["params"].items():
        assert torch.equal(second["params"][name], value), name
    assert "rank(s) [2, 3] fetched their files" in log


@pytest.mark.slow
def test_both_copies_of_a_rank_file_lost_falls_back_to_the_durable_tier_with_a_warning(tmp_path):
    _two_nodes(tmp_path, "first.pt", steps=2, persist_every=1, resume=False, crash=True)
    shutil.rmtree(tmp_path / "node1")
    for path in _rank_files(tmp_path / "node0", 1):  # node 0's replica of rank 1 too
        os.remove(path)
    log = _two_nodes(tmp_path, "second.pt", steps=2, persist_every=1, resume=True, crash=False)
    first, second = torch.load(tmp_path / "first.pt"), torch.load(tmp_path / "second.pt")
    assert second["tier"] == "durable", log
    assert "both copies of some rank's file are lost" in log
    for name, value in first["params"].items():
        assert torch.equal(second["params"][name], value), name


@pytest.mark.slow
def test_killed_during_replication_the_partial_replica_is_never_used(tmp_path):
    # Node 1 dies in save 2's replication: save 1 is complete and replicated on both nodes; save 2 is
    # committed locally only (each node its own rank). Node 1's storage is then lost too: save 2 has no copy
    # of rank 1 anywhere, so the resume takes save 1 from the local tier (rank 1 from node 0's replica).
    _two_nodes(tmp_path, "first.pt", steps=3, persist_every=10, resume=False, crash=False,
               kill_node1="replication:2")
    newest = tier_markers(str(tmp_path / "node0"))[0][1]["tier"]
    assert newest["step"] == 2 and newest["ranks"] == [0] and not newest["replicated"]
    shutil.rmtree(tmp_path / "node1")
    log = _two_nodes(tmp_path, "second.pt", steps=1, persist_every=10, resume=True, crash=False)
    second = torch.load(tmp_path / "second.pt")
    assert second["tier"] == "local" and second["step"] == 1, log
    assert "both copies of some rank's file are lost" in log
    for name, value in torch.load(f"{tmp_path / 'first.pt'}.step1").items():
        assert torch.equal(second["params"][name], value), name


@pytest.mark.slow
def test_killed_during_persistence_the_durable_tier_keeps_its_previous_checkpoint(tmp_path):
    # Node 1 dies in save 2's durable write: the durable tier holds save 1 only (no marker of save 2); the
    # local tier holds save 2, complete and replicated, which the resume takes.
    _two_nodes(tmp_path, "first.pt", steps=3, persist_every=1, resume=False, crash=False, kill_node1="persist:2")
    assert sorted(p for p in os.listdir(tmp_path / "durable") if p.endswith(".ckpt")) == ["epoch=0-step=1.ckpt"]
    log = _two_nodes(tmp_path, "second.pt", steps=2, persist_every=1, resume=True, crash=False)
    second = torch.load(tmp_path / "second.pt")
    assert second["tier"] == "local" and second["step"] == 2, log
    for name, value in torch.load(f"{tmp_path / 'first.pt'}.step2").items():
        assert torch.equal(second["params"][name], value), name


class _Unblock(Callback):
    """The durable tier comes back after ``at`` steps (the file blocking its directory is removed)."""

    def __init__(self, blocker, at: int) -> None:
        self.blocker, self.at = blocker, at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at and os.path.exists(self.blocker):
            os.remove(self.blocker)


def test_durable_tier_unreachable_local_saves_go_on_and_persistence_resumes(tmp_path):
    blocker = tmp_path / "mnt"
    blocker.write_text("not a directory")  # the durable path cannot be created while this file is here
    durable = blocker / "ckpt"
    io = ZeroCheckpointIO(mode="sharded", local_tier=LocalTier(str(tmp_path / "local")), persist_every=2)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, use_distributed_sampler=False,
                      strategy=ZeroLowLevelStrategy(stage=2, bucket_size_mb=0.0005, start_method="popen"),
                      plugins=[io], enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[_Unblock(blocker, at=3),
                                 ModelCheckpoint(dirpath=durable, every_n_train_steps=1, save_top_k=-1)])
    with pytest.warns(UserWarning, match="Persisting checkpoint .* failed; it is committed on the local tier") as caught:
        trainer.fit(NetModule(), loader(6, 1, 1))
    failures = [w for w in caught if "Persisting checkpoint" in str(w.message)]
    assert len(failures) == 1 and "epoch=0-step=2.ckpt" in str(failures[0].message)  # once, for save 2
    assert len(tier_markers(str(tmp_path / "local"))) == 2  # local saves went on (keep=2)
    # Back from step 3: saves 4 and 6 persisted.
    assert sorted(p for p in os.listdir(durable) if p.endswith(".ckpt")) == ["epoch=0-step=4.ckpt",
                                                                             "epoch=0-step=6.ckpt"]
