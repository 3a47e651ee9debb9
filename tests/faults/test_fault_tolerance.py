"""Fault tolerance across replica groups (torchft), with real faults: torchft's lighthouse and one torchrun
job per group on 127.0.0.1 (tests/ft_cluster.py running tests/faults/ft_job.py). Each rank reports every
optimizer step: the trainer's step, whether it was committed, the participants, the heals, and a digest of
its master shards and optimizer state, so "bit-identical" below is a comparison of digests."""

from __future__ import annotations

import math
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ft_cluster import FTCluster, torchft_installed  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torchft_installed(), reason='needs the [ft] extra: pip install "lightning-zero[ft]"'),
    pytest.mark.timeout(600),
]


def by_step(reports: list[dict]) -> dict[int, dict]:
    """The committed steps' reports by trainer step (a discarded step repeats the previous step)."""
    return {r["global_step"]: r for r in reports if r.get("committed", True)}


def assert_identical_where_shared(a: list[dict], b: list[dict], after: int = 0) -> int:
    """Equal digests (and losses' finiteness) at every committed step both reached past ``after``; returns
    how many steps were compared."""
    sa, sb = by_step(a), by_step(b)
    shared = sorted(step for step in sa.keys() & sb.keys() if step > after)
    for step in shared:
        assert sa[step]["digest"] == sb[step]["digest"], f"state differs at step {step}: {sa[step]} vs {sb[step]}"
        assert math.isfinite(sa[step]["loss"]) and math.isfinite(sb[step]["loss"])
    return len(shared)


def test_no_failure_matches_the_same_hybrid_job_bit_for_bit(tmp_path: Path) -> None:
    """2 groups x 2 ranks with fault tolerance, 30 steps, against one job of 4 ranks hybrid-sharded in groups of
    2 without it (same model, data split and LR schedule): every step's state is bit-identical."""
    steps = 30
    # The lighthouse waits for both groups before the first quorum, so that both take part from step 1.
    with FTCluster(tmp_path / "ft", groups=2, steps=steps, min_replicas=2) as ft:
        ft.start()
        for group in range(2):
            assert ft.wait_exit(group, 300) == 0, ft.log_tail(group)
    hybrid = FTCluster(tmp_path / "hybrid", groups=2, ranks=4, steps=steps, env={"FT_HYBRID": "1"})
    hybrid.launch(0)
    assert hybrid.wait_exit(0, 300) == 0, hybrid.log_tail(0)
    for group in range(2):
        for rank in range(2):
            with_ft, without = ft.reports(group, rank), hybrid.reports(group, rank)
            assert [r["global_step"] for r in with_ft] == list(range(1, steps + 1))
            assert all(r["committed"] and r["participants"] == 2 for r in with_ft)
            assert [r["digest"] for r in with_ft] == [r["digest"] for r in without]
            assert [r["loss"] for r in with_ft] == [r["loss"] for r in without]
            assert [r["lr"] for r in with_ft] == [r["lr"] for r in without]  # the LR schedule steps alike


@pytest.mark.parametrize("front_end", ["trainer", "fabric"])
def test_a_killed_group_costs_the_others_one_step_and_heals_when_relaunched(tmp_path: Path, front_end: str) -> None:
    """3 groups x 2 ranks. Group 2 is SIGKILLed mid-training: groups 0 and 1 go on in the same processes,
    bit-identical to each other at every committed step, with at most one step discarded and no NaN. Group 2
    relaunched heals from a live group before its first forward: at every step it shares with group 0 afterwards,
    its state is bit-identical."""
    env = {"FT_FABRIC": "1"} if front_end == "fabric" else {}
    with FTCluster(tmp_path, groups=3, steps=100_000, step_sleep=0.15, env=env) as ft:
        ft.start()
        ft.wait_for(lambda: all(any(r["participants"] == 3 for r in ft.committed(g)) for g in range(3))
                    and ft.step_of(0) >= 8, 240, "all three groups committing together past step 8")
        pids = {g: {r["pid"] for r in ft.reports(g)} for g in (0, 1)}
        killed_at = ft.kill(2)
        killed_step = ft.step_of(0)
        ft.wait_for(lambda: any(r["t"] > killed_at and r["committed"] and r["participants"] == 2
                                for r in ft.reports(0)), 60, "a committed step of the two survivors")
        resumed = next(r for r in ft.reports(0) if r["t"] > killed_at and r["committed"] and r["participants"] == 2)
        stall = resumed["t"] - killed_at
        discarded = [r for r in ft.reports(0) if r["t"] > killed_at and not r["committed"]]
        assert len(discarded) <= 1, discarded

        relaunched_at = time.time()
        ft.launch(2)
        ft.wait_for(lambda: sum(r["participants"] == 3 for r in ft.committed(2) if r["t"] > relaunched_at) >= 5,
                    240, "the relaunched group committing with 3 participants")
        for group in (0, 1):
            assert ft.procs[group].poll() is None, ft.log_tail(group)
    for group in (0, 1):
        assert {r["pid"] for r in ft.reports(group)} == pids[group], "a survivor was restarted"
        assert all(math.isfinite(r["loss"]) for r in ft.reports(group))
    for rank in range(2):
        assert assert_identical_where_shared(ft.reports(0, rank), ft.reports(1, rank)) >= 15
        relaunched = [r for r in ft.reports(2, rank) if r["t"] > relaunched_at]
        assert relaunched[0]["global_step"] > killed_step, "the relaunched group started over instead of healing"
        assert relaunched[0]["heals"] == 1
        assert assert_identical_where_shared(ft.reports(0, rank), relaunched) >= 5
    print(f"stall {stall:.2f} s; discarded {len(discarded)}; heal {relaunched[0]['last_heal_s']:.2f} s")
