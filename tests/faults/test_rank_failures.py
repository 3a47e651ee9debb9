"""One rank fails, dies or freezes: every rank makes the same collectives, so all of them fail
together within seconds (or within the process group timeout for a frozen peer), each naming the
failing rank and the cause, and nothing is committed.

The faults are real: an allocation refused by ``RLIMIT_AS`` on one rank, a file deleted under one
rank, ``SIGKILL``/``SIGSTOP`` of one process.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _dist import run_distributed
from fault_cases import (
    full_gather_while_one_rank_runs_out_of_memory,
    load_with_one_rank_failing,
    save_while_a_peer_dies,
    save_while_one_rank_runs_out_of_memory,
    start_ranks,
    train_while_a_peer_dies,
)

from lightning_zero.checkpoint import load
from lightning_zero.checkpoint.store import storage

OOM = r"can't allocate memory|not enough memory|out of memory|Cannot allocate memory"


@pytest.mark.parametrize("mode", ["local", "sharded", "full"])
def test_out_of_memory_while_staging_on_one_rank_fails_the_save_on_every_rank(tmp_path: Path, mode: str) -> None:
    results = run_distributed(save_while_one_rank_runs_out_of_memory, 2, str(tmp_path), 1, mode,
                              start_method="forkserver")
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} did not see the failure"
        assert "CheckpointSaveError" in result["error"] and "before any data was written" in result["error"]
        assert "rank 1: staging the state failed" in result["error"], result["error"]
        assert result["seconds"] < 10, f"rank {rank} took {result['seconds']:.1f} s"
    assert not (tmp_path / "oom.ckpt").exists()
    assert not (tmp_path / "_zero_data" / "oom.ckpt").exists() or not any((tmp_path / "_zero_data" / "oom.ckpt").iterdir())


def test_out_of_memory_in_the_middle_of_the_full_gather_stops_every_rank_at_the_same_tensor() -> None:
    results = run_distributed(full_gather_while_one_rank_runs_out_of_memory, 2, 1, start_method="forkserver")
    assert re.search(rf"rank 1: gathering a tensor of shape \(\d+,\) to rank 0 failed .*({OOM})", results[1]["error"])
    assert "rank 0: stopped the gather to rank 0 because another rank failed" in results[0]["error"]
    assert all(r["seconds"] < 10 for r in results), results


@pytest.mark.parametrize(("mode", "damage"), [("sharded", "other-model"), ("local", "other-model"),
                                              ("local", "missing-file")])
def test_a_load_failing_on_one_rank_before_the_data_is_read_fails_on_every_rank(
        tmp_path: Path, mode: str, damage: str) -> None:
    results = run_distributed(load_with_one_rank_failing, 2, str(tmp_path), 1, mode, damage,
                              start_method="forkserver")
    expected = "does not match this model" if damage == "other-model" else r"rank00001-of-00002.pt' is missing"
    assert expected.replace("\\", "") in results[1]["error"]
    assert "failed on another rank, so no rank loads it: rank 1:" in results[0]["error"], results[0]["error"]
    for rank, result in enumerate(results):
        assert result["seconds"] < 10, f"rank {rank} took {result['seconds']:.1f} s"
        assert result["untouched"], f"rank {rank}: a refused load changed the state"


# ---- a peer dies or freezes --------------------------------------------------------------


TIMEOUT_S = 4.0


@pytest.mark.parametrize("how", ["kill", "stop"])
@pytest.mark.parametrize("mode", ["local", "sharded"])
def test_a_peer_killed_or_frozen_during_a_save_fails_it_on_the_others_within_the_timeout(
        tmp_path: Path, how: str, mode: str, single_rank_group: None) -> None:
    ranks = start_ranks(save_while_a_peer_dies, 3, str(tmp_path), 2, how, mode, timeout_s=TIMEOUT_S)
    results = ranks.wait(deadline_s=60, survivors=[0, 1])
    for rank, result in results.items():
        assert result is not None, f"rank {rank} was still waiting after 60 s"
        assert result["error"] and "lost contact with another rank" in result["error"], result
        # What happened, in words: a killed peer's connection closes at once; a frozen one never answers.
        said = "a peer closed its connection" if how == "kill" else "no answer within the process group timeout"
        assert said in result["error"], result["error"]
        assert result["seconds"] < TIMEOUT_S * 3 + 5, f"rank {rank} took {result['seconds']:.1f} s"
    # Nothing committed: last.ckpt is still the first save (value 1.0), which loads at world size 3 only
    # in local mode; its marker names the first data version.
    marker = storage.read_marker(storage.resolve(str(tmp_path / "last.ckpt")))
    assert marker is not None
    versions = list((tmp_path / "_zero_data" / "last.ckpt").iterdir())
    assert marker["data"].endswith(tuple(v.name for v in versions))
    if mode == "sharded":
        from fault_cases import sharded_tree

        target = sharded_tree(0, 1, 0.0)
        load(target, str(tmp_path / "last.ckpt"))
        assert target["a"].local.eq(1.0).all(), "the previous checkpoint was replaced"


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_peer_killed_or_frozen_during_training_stops_the_others_within_the_timeout(how: str) -> None:
    ranks = start_ranks(train_while_a_peer_dies, 2, 1, how, timeout_s=TIMEOUT_S)
    results = ranks.wait(deadline_s=60, survivors=[0])
    assert results[0] is not None, "rank 0 was still training after 60 s"
    assert re.search(r"stopped answering|timed out|Timed out|Connection (closed|reset) by peer", results[0]["error"]), \
        results[0]
    assert results[0]["seconds"] < TIMEOUT_S * 3 + 5, results[0]

