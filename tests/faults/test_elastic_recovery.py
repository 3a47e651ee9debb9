"""Elastic recovery from the local tier: a job of 2 "nodes" x 2 ranks on 127.0.0.1 (each node its own local
directory) goes on at another world size, resharded from the files the surviving nodes hold, and the state
equals bit for bit what a ``sharded`` durable save of the same step gives when resumed at that world size."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _dist import free_port
from test_integrity import flip_byte

from lightning_zero.checkpoint.tiered.tiers import tier_markers

TESTS = os.path.dirname(os.path.dirname(__file__))


def _run(tmp_path: Path, out: str, nodes: int, devices: int, steps: int, ckpt: str, *, persist_every: int = 1,
         crash: bool = False, durable: str = "durable", pattern: str = "node{node_rank}",
         kill_node1: str | None = None) -> str:
    """Start ``nodes`` node processes (node 0 first); each runs Lightning's launcher for its ``devices``."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}
    env.pop("WORLD_SIZE", None)
    args = [sys.executable, os.path.join(TESTS, "elastic_node.py"), str(tmp_path / out), str(tmp_path / durable),
            str(tmp_path / pattern), str(nodes), str(devices), str(steps), str(persist_every), ckpt, str(int(crash))]
    procs = [subprocess.Popen(args, env={**env, "NODE_RANK": str(rank),
                                         **({"ELASTIC_KILL": kill_node1} if kill_node1 and rank == 1 else {})},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(nodes)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    log = "\n\n".join(logs)
    if kill_node1:
        assert procs[1].returncode == 17, log
    else:
        assert [p.returncode for p in procs] == [0] * nodes, log
    return log


def _durable(tmp_path: Path, step: int) -> str:
    """The durable tier's checkpoint of ``step`` (a `sharded` one: ModelCheckpoint names it by epoch and step)."""
    (found,) = glob.glob(str(tmp_path / "durable" / f"epoch=*-step={step}.ckpt"))
    return found


def _assert_same_start(tmp_path: Path, got: str, want: str, world_size: int) -> None:
    """Every rank's engine state as the fit started (masters, optimizer state, buffers, lr), bit for bit."""
    for rank in range(world_size):
        a, b = torch.load(tmp_path / f"{got}.rank{rank}.start"), torch.load(tmp_path / f"{want}.rank{rank}.start")
        assert a.keys() == b.keys()
        for key, value in b.items():
            if isinstance(value, tuple):
                assert a[key][1:] == value[1:], key
                assert a[key][0].dtype == value[0].dtype and torch.equal(a[key][0], value[0]), (rank, key)
            elif isinstance(value, torch.Tensor):
                assert torch.equal(a[key], value), (rank, key)
            else:
                assert a[key] == value, (rank, key)


def _assert_same_run(tmp_path: Path, got: str, want: str, world_size: int) -> dict:
    _assert_same_start(tmp_path, got, want, world_size)
    a, b = torch.load(tmp_path / got, weights_only=False), torch.load(tmp_path / want, weights_only=False)
    assert a["losses"] and a["losses"] == b["losses"]  # the next steps' losses, exactly
    for name, value in b["params"].items():
        assert torch.equal(a["params"][name], value), name
    return a


@pytest.mark.slow
def test_two_by_two_shrinks_to_one_node_then_one_rank_and_grows_back_from_the_local_tier(tmp_path):
    # 2 nodes x 2 ranks save every step (each also persisted, so a durable `sharded` save of every step is the
    # ground truth), then node 1's processes are gone: node 0 holds its own files and node 1's replicas.
    _run(tmp_path, "a.pt", nodes=2, devices=2, steps=3, ckpt="-", crash=True)
    newest = tier_markers(str(tmp_path / "node0"))[0][1]["tier"]
    assert newest["ranks"] == [0, 1, 2, 3] and newest["step"] == 3
    for place in ("node0", "durable"):
        shutil.copytree(tmp_path / place, tmp_path / "one" / place)
    # Down to 1 node x 2 ranks: 4 -> 2 from node 0's directory alone.
    log = _run(tmp_path, "b.pt", nodes=1, devices=2, steps=5, ckpt="last")
    _run(tmp_path, "b_durable.pt", nodes=1, devices=2, steps=5, ckpt=_durable(tmp_path, 3), durable="d_b",
         pattern="l_b{node_rank}")
    b = _assert_same_run(tmp_path, "b.pt", "b_durable.pt", 2)
    load = b["load"]
    assert load.tier == "local" and load.step == 3 and load.resharded_from == 4 and load.steps_lost == 0, log
    assert load.reshard_s > 0 and load.choose_s > 0 and load.seconds >= load.reshard_s + load.choose_s
    assert "resharded from 4 to 2 ranks" in log
    # Down to one rank: 4 -> 1.
    one = tmp_path / "one"
    _run(one, "g.pt", nodes=1, devices=1, steps=4, ckpt="last")
    _run(one, "g_durable.pt", nodes=1, devices=1, steps=4, ckpt=_durable(one, 3), durable="d_g", pattern="l_g{node_rank}")
    g = _assert_same_run(one, "g.pt", "g_durable.pt", 1)
    assert g["load"].tier == "local" and g["load"].resharded_from == 4
    # Back to 2 x 2: the 2-rank run's step 5 is on node 0 only; node 1's ranks get their pieces over the
    # network (its directory holds only the older 4-rank checkpoints of the first run).
    log = _run(tmp_path, "d.pt", nodes=2, devices=2, steps=7, ckpt="last")
    _run(tmp_path, "d_durable.pt", nodes=2, devices=2, steps=7, ckpt=_durable(tmp_path, 5), durable="d_d",
         pattern="l_d{node_rank}")
    d = _assert_same_run(tmp_path, "d.pt", "d_durable.pt", 4)
    assert d["load"].tier == "local" and d["load"].step == 5 and d["load"].resharded_from == 2, log
    assert d["load"].moved["read_bytes"] > 0  # rank 0 read its pieces from its own node


@pytest.mark.slow
def test_killed_during_a_save_resumes_resharded_from_the_previous_complete_state(tmp_path):
    # Node 1 dies in save 2's replication: save 2 is on each node's own ranks only; save 1 is complete.
    _run(tmp_path, "a.pt", nodes=2, devices=2, steps=3, ckpt="-", kill_node1="replication:2")
    log = _run(tmp_path, "b.pt", nodes=1, devices=2, steps=3, ckpt="last")
    _run(tmp_path, "b_durable.pt", nodes=1, devices=2, steps=3, ckpt=_durable(tmp_path, 1), durable="d_b",
         pattern="l_b{node_rank}")
    b = _assert_same_run(tmp_path, "b.pt", "b_durable.pt", 2)
    assert b["load"].tier == "local" and b["load"].step == 1 and b["load"].resharded_from == 4, log
    assert b["load"].steps_lost == 1  # save 2 reached node 0's own files only


def _replica(tmp_path: Path, node: str, step: int, rank: int) -> Path:
    (marker,) = [m for p, m in tier_markers(str(tmp_path / node)) if p.endswith(f"-step={step}.ckpt")]
    return Path(glob.glob(str(tmp_path / node / marker["data"] / f"rank{rank:05d}-of-00004.pt"))[0])


@pytest.mark.slow
@pytest.mark.parametrize("damaged", [(3,), (3, 2)], ids=["newest", "both_kept"])
def test_a_flipped_byte_in_the_needed_replica_falls_back_with_one_warning(tmp_path, damaged):
    # Saves at steps 1-3, the second persisted: the durable tier holds step 2, the local tier steps 2 and 3.
    _run(tmp_path, "a.pt", nodes=2, devices=2, steps=3, ckpt="-", crash=True, persist_every=2)
    shutil.rmtree(tmp_path / "node1")  # the dead node's storage is lost: node 0's replicas are the only copies
    for step in damaged:
        flip_byte(_replica(tmp_path, "node0", step, 2))
    log = _run(tmp_path, "b.pt", nodes=1, devices=2, steps=4, ckpt="last", persist_every=2)
    warnings = [line for line in log.splitlines() if "cannot be used" in line]
    assert len(warnings) == len(damaged), log  # one per damaged checkpoint, naming the rank, the file, the reason
    for warning, step in zip(warnings, damaged):
        assert f"step={step}.ckpt" in warning and "rank00002-of-00004.pt" in warning, log
        assert "rank 0: Checksum mismatch" in warning and warning.count("Checksum mismatch") == 1, log
        # said once, what happened then what is done: no advice to do what recovery is doing, no ".."
        assert "Resume from another checkpoint" not in warning and ".." not in warning, log
        assert warning.rstrip().endswith("resuming from the next newest complete state instead."), log
    b = torch.load(tmp_path / "b.pt", weights_only=False)
    # The older local one (step 2, not older than the durable one), else the durable step 2.
    want_tier = "local" if damaged == (3,) else "durable"
    assert b["load"].tier == want_tier and b["load"].step == 2, log
    assert b["load"].steps_lost == 1
    _run(tmp_path, "b_durable.pt", nodes=1, devices=2, steps=4, ckpt=_durable(tmp_path, 2), durable="d_b",
         pattern="l_b{node_rank}", persist_every=2)
    _assert_same_run(tmp_path, "b.pt", "b_durable.pt", 2)
