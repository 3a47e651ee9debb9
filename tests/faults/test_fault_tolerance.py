"""Fault tolerance across replica groups (torchft), with real faults: torchft's lighthouse and one torchrun
job per group on 127.0.0.1 (tests/ft_cluster.py running tests/faults/ft_job.py). Each rank reports every
optimizer step: the trainer's step, whether it was committed, the participants, the heals, and a digest of
its master shards and optimizer state, so "bit-identical" below is a comparison of digests."""

from __future__ import annotations

import math
import os
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


def sharing(ft: FTCluster, a: int, b: int, count: int, since: float = 0.0) -> bool:
    """Groups ``a`` and ``b`` (its reports after ``since``) committed at least ``count`` of the same trainer steps,
    on every rank: what a test waits for before it compares them, so the comparison's size never depends on the
    machine's speed or on which group wrote its report first."""
    return all(len(by_step(ft.reports(a, rank)).keys()
                   & by_step([r for r in ft.reports(b, rank) if r["t"] > since]).keys()) >= count
               for rank in range(ft.ranks))


DATASET = 4096  # tests/faults/ft_job.py's Numbers


def assert_every_sample_once(ft: FTCluster, groups: int, ranks: int = 2) -> int:
    """Over the committed steps of every group and rank (the ReplicaGroupSampler the Trainer or Fabric puts in): no
    sample of an epoch seen twice, and an epoch that ended saw all of them (its last step padded with the epoch's
    first samples). Returns the committed samples counted."""
    by_epoch: dict[int, list[int]] = {}
    for group in range(groups):
        for rank in range(ranks):
            for report in ft.reports(group, rank):
                if report["committed"] and report["place"] is not None:  # a healing group contributes nothing
                    by_epoch.setdefault(report["epoch"], []).extend(report["samples"])
    for epoch, seen in by_epoch.items():
        ended = epoch + 1 in by_epoch
        repeated = len(seen) - len(set(seen))
        if ended:
            assert set(seen) == set(range(DATASET)), f"epoch {epoch}: {DATASET - len(set(seen))} samples never seen"
            assert repeated < groups * ranks * 4, f"epoch {epoch}: {repeated} samples seen twice"
        else:
            assert repeated == 0, f"epoch {epoch}: {repeated} samples seen twice"
    return sum(len(seen) for seen in by_epoch.values())


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
        ft.wait_for(lambda: sum(r["participants"] == 3 for r in ft.committed(2) if r["t"] > relaunched_at) >= 5
                    and sharing(ft, 0, 1, 15) and sharing(ft, 0, 2, 5, relaunched_at), 240,
                    "the relaunched group committing with 3 participants")
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
    assert assert_every_sample_once(ft, 3) > 0
    print(f"stall {stall:.2f} s; discarded {len(discarded)}; heal {relaunched[0]['last_heal_s']:.2f} s")


def committing(ft: FTCluster, group: int, participants: int, since: float, count: int) -> bool:
    return sum(r["committed"] and r["participants"] == participants for r in ft.reports(group) if r["t"] > since) >= count


def test_a_group_dying_inside_the_cross_group_all_reduce(tmp_path: Path) -> None:
    """Group 2 dies (agent and workers SIGKILLed by its first rank) right after launching its share of the cross-
    group all-reduce: the other two stay bit-identical at every committed step and apply no partial step (no NaN,
    the same digests as each other). Each discards the step group 2 died in, or the first step after it whose split
    changed; where the collective broke for one survivor only, that one is a step behind, heals from the other and
    discards that step too, as its source does ([Note: a healer decides as its source]). Counted from when the test
    saw group 2 gone, a survivor's first discard may come before it."""
    with FTCluster(tmp_path, groups=3, steps=100_000, step_sleep=0.15) as ft:
        ft.start_lighthouse()
        ft.launch(0)
        ft.launch(1)
        ft.launch(2, extra_env={"FT_DIE_IN_ALLREDUCE_AT": "12"})
        ft.wait_for(lambda: ft.procs[2].poll() is not None, 240, "group 2 dying inside the all-reduce")
        died_at = time.time()
        assert any(r["participants"] == 3 for r in ft.committed(2)), "group 2 never took part"
        ft.wait_for(lambda: committing(ft, 0, 2, died_at, 8) and committing(ft, 1, 2, died_at, 8)
                    and sharing(ft, 0, 1, 15), 120, "the survivors committing on their own")
    for rank in range(2):
        assert assert_identical_where_shared(ft.reports(0, rank), ft.reports(1, rank)) >= 15
    discarded = sorted(sum(not r["committed"] for r in ft.reports(g) if r["t"] > died_at) for g in (0, 1))
    assert discarded in ([0, 1], [1, 1], [1, 2]), discarded


def test_a_frozen_group_is_dropped_and_rejoins_by_healing(tmp_path: Path) -> None:
    """Group 2 frozen (SIGSTOP) well past the timeout: the others drop it and go on. Resumed (SIGCONT), it is behind:
    it rejoins by healing (in its processes, or in new ones if its torchrun restarts it) and is then bit-identical
    to the others, which it never corrupted."""
    with FTCluster(tmp_path, groups=3, steps=100_000, step_sleep=0.15) as ft:
        ft.start_lighthouse()
        ft.launch(0)
        ft.launch(1)
        ft.launch(2, max_restarts=2)
        ft.wait_for(lambda: all(committing(ft, g, 3, 0, 2) for g in range(3)), 240, "three groups committing")
        frozen_at = ft.kill(2, signal.SIGSTOP)
        ft.wait_for(lambda: committing(ft, 0, 2, frozen_at + 7, 5), 90, "the others committing past the timeout")
        resumed_at = ft.kill(2, signal.SIGCONT)
        ft.wait_for(lambda: committing(ft, 2, 3, resumed_at, 5) and sharing(ft, 0, 1, 20)
                    and sharing(ft, 0, 2, 5, resumed_at), 240, "the frozen group back among three")
    for rank in range(2):
        assert assert_identical_where_shared(ft.reports(0, rank), ft.reports(1, rank)) >= 20
        back = [r for r in ft.reports(2, rank) if r["t"] > resumed_at]
        assert assert_identical_where_shared(ft.reports(0, rank), back) >= 5
    assert all(math.isfinite(r["loss"]) for g in range(3) for r in ft.reports(g))
    assert assert_every_sample_once(ft, 3) > 0


def marked_after(ft: FTCluster, name: str, since: float) -> bool:
    """Whether ft_job.py's marker ``name`` (healing_g2_r0, serving_g1_r1, ...) was written after ``since``."""
    path = ft.root / name
    return path.exists() and float(path.read_text() or 0) > since


def test_a_group_killed_again_during_its_heal_heals_when_relaunched_once_more(tmp_path: Path) -> None:
    """Group 2 killed, relaunched with a heal slowed to 6 s (FT_HEAL_SLEEP), and killed again in the middle of its
    heal (the state received, not yet loaded): groups 0 and 1 go on without it, bit-identical to each other.
    Relaunched once more, it heals and is bit-identical to group 0 at every step they share."""
    with FTCluster(tmp_path, groups=3, steps=100_000, step_sleep=0.15) as ft:
        ft.start()
        ft.wait_for(lambda: all(committing(ft, g, 3, 0, 2) for g in range(3)), 240, "three groups committing")
        first_kill = ft.kill(2)
        ft.wait_for(lambda: committing(ft, 0, 2, first_kill, 2), 60, "two groups committing")
        relaunched_at = time.time()
        ft.launch(2, extra_env={"FT_HEAL_SLEEP": "6"})
        ft.wait_for(lambda: marked_after(ft, "healing_g2_r0", relaunched_at), 240, "group 2 in its heal")
        killed_in_heal = ft.kill(2)
        ft.wait_for(lambda: committing(ft, 0, 2, killed_in_heal, 3), 60, "two groups committing after the kill")
        assert not any(r["t"] > relaunched_at and r["committed"] for r in ft.reports(2)), "the heal was not cut"
        back_at = time.time()
        ft.launch(2)
        ft.wait_for(lambda: committing(ft, 2, 3, back_at, 5) and sharing(ft, 0, 1, 10)
                    and sharing(ft, 0, 2, 5, back_at), 240,
                    "group 2 healed and among three")
        for group in (0, 1):
            assert ft.procs[group].poll() is None, ft.log_tail(group)
    for rank in range(2):
        assert assert_identical_where_shared(ft.reports(0, rank), ft.reports(1, rank)) >= 10
        back = [r for r in ft.reports(2, rank) if r["t"] > back_at]
        assert back[0]["heals"] == 1
        assert assert_identical_where_shared(ft.reports(0, rank), back) >= 5
    assert all(math.isfinite(r["loss"]) for g in range(3) for r in ft.reports(g))
    assert assert_every_sample_once(ft, 3) > 0


def test_a_source_killed_during_a_heal_leaves_the_healer_to_heal_from_another_group(tmp_path: Path) -> None:
    """Groups 0 and 1 serve heals slowly (FT_SERVE_SLEEP 2 s). Group 2 killed and relaunched: its two ranks heal
    from groups 0 and 1 (torchft spreads a group's ranks over the sources); group 1 is killed while it serves. The
    healer never loads a partial state: its heal from group 1 fails, the step is discarded, and it heals again at a
    later quorum, from group 0, and is then bit-identical to group 0 at every step they share."""
    slow = {"FT_SERVE_SLEEP": "2"}
    # A source hands out its state on its quorum thread, so serving a heal holds its own step for FT_SERVE_SLEEP. The
    # lighthouse waits that long for a live group only up to its join timeout: under 2 s, the other two go on, the
    # source is behind and heals in turn, and the groups can heal one another for ever (docs/fault-tolerance.md).
    with FTCluster(tmp_path, groups=3, steps=100_000, step_sleep=0.15, join_timeout_ms=10_000) as ft:
        ft.start_lighthouse()
        ft.launch(0, extra_env=slow)
        ft.launch(1, extra_env=slow)
        ft.launch(2)
        ft.wait_for(lambda: all(committing(ft, g, 3, 0, 2) for g in range(3)), 240, "three groups committing")
        first_kill = ft.kill(2)
        ft.wait_for(lambda: committing(ft, 0, 2, first_kill, 2), 60, "two groups committing")
        relaunched_at = time.time()
        ft.launch(2)
        ft.wait_for(lambda: any(marked_after(ft, f"serving_g1_r{rank}", relaunched_at) for rank in range(2)), 240,
                    "group 1 serving group 2's heal")
        source_killed_at = ft.kill(1)
        ft.wait_for(lambda: committing(ft, 2, 2, source_killed_at, 5) and committing(ft, 0, 2, source_killed_at, 5)
                    and sharing(ft, 0, 2, 5, relaunched_at), 240, "group 2 healed and committing with group 0")
        assert ft.procs[0].poll() is None, ft.log_tail(0)
    for rank in range(2):
        healed = [r for r in ft.reports(2, rank) if r["t"] > relaunched_at]
        assert healed and all(r["heals"] >= 1 for r in healed)
        assert assert_identical_where_shared(ft.reports(0, rank), healed) >= 5
    assert all(math.isfinite(r["loss"]) for g in range(3) for r in ft.reports(g))
    assert assert_every_sample_once(ft, 3) > 0


def test_down_to_one_group_and_back_to_three(tmp_path: Path) -> None:
    """min_replica_groups=1: groups 1 and 2 killed one after the other, group 0 trains alone; both relaunched, they
    heal and the three are bit-identical again."""
    with FTCluster(tmp_path, groups=3, steps=100_000, step_sleep=0.15) as ft:
        ft.start()
        ft.wait_for(lambda: all(committing(ft, g, 3, 0, 2) for g in range(3)), 240, "three groups committing")
        one_lost_at = ft.kill(1)
        ft.wait_for(lambda: committing(ft, 0, 2, one_lost_at, 3), 60, "two groups committing")
        alone_at = ft.kill(2)
        ft.wait_for(lambda: committing(ft, 0, 1, alone_at, 5), 60, "group 0 committing alone")
        back_at = time.time()
        ft.launch(1)
        ft.launch(2)
        ft.wait_for(lambda: all(committing(ft, g, 3, back_at, 5) for g in range(3))
                    and all(sharing(ft, 0, g, 5, back_at) for g in (1, 2)), 240, "three groups again")
    for group in (1, 2):
        for rank in range(2):
            back = [r for r in ft.reports(group, rank) if r["t"] > back_at]
            assert back[0]["heals"] == 1
            assert assert_identical_where_shared(ft.reports(0, rank), back) >= 5
    assert assert_every_sample_once(ft, 3) > 0


def test_a_group_that_joins_and_then_writes_replaces_the_checkpoints_of_the_group_it_healed_from(tmp_path: Path) -> None:
    """Group 1 trains alone and writes `last.ckpt`; group 0 joins, heals from it and, as the first group of the
    quorum, writes from then on. It replaces and removes what group 1 wrote (the heal carries ModelCheckpoint's
    state) instead of versioning its own files beside them (`last-v1.ckpt`)."""
    from lightning_zero.checkpoint import read_lightning_checkpoint

    checkpoints = tmp_path / "ckpt"
    with FTCluster(tmp_path / "run", groups=2, steps=100_000, step_sleep=0.1,
                   env={"FT_CKPT_DIR": str(checkpoints)}) as ft:
        ft.start_lighthouse()
        ft.launch(1)
        ft.wait_for(lambda: ft.step_of(1) >= 7 and (checkpoints / "last.ckpt").exists(), 240,
                    "group 1 alone past its first save")
        joined_at, step_at_join = time.time(), ft.step_of(1)
        ft.launch(0)
        ft.wait_for(lambda: committing(ft, 0, 2, joined_at, 12), 240, "group 0 in the quorum, writing")
    assert [r["heals"] for r in ft.reports(0)][-1] == 1
    names = sorted(path.name for path in checkpoints.glob("*.ckpt"))
    assert "last.ckpt" in names and not [name for name in names if name.startswith("last-v")], names
    assert read_lightning_checkpoint(str(checkpoints / "last.ckpt"))["global_step"] > step_at_join + 5


def test_a_lost_lighthouse_stops_every_group_with_a_clear_error_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    """The lighthouse SIGKILLed: no group hangs; each stops once its quorum timeout (5 s here) has passed, saying
    what happened and what to do, and the last checkpoint (sharded, written by one group) reads whole. torchft's
    managers do not reconnect to a restarted lighthouse within a quorum request, so the job stops."""
    from lightning_zero.checkpoint import read_lightning_checkpoint

    checkpoints = tmp_path / "ckpt"
    env = {"FT_CKPT_DIR": str(checkpoints), "FT_QUORUM_TIMEOUT": "5"}
    with FTCluster(tmp_path / "run", groups=2, steps=100_000, step_sleep=0.1, env=env) as ft:
        ft.start()
        ft.wait_for(lambda: all(committing(ft, g, 2, 0, 1) for g in range(2)) and ft.step_of(0) >= 12, 240,
                    "two groups past step 12")
        assert ft.lighthouse is not None
        ft.lighthouse.kill()
        lost_at = time.time()
        codes = [ft.wait_exit(g, 60) for g in range(2)]
        stopped_after = time.time() - lost_at
    assert all(code != 0 for code in codes)
    assert stopped_after < 30, f"{stopped_after:.0f} s"
    for group in range(2):
        assert "no quorum from the torchft lighthouse" in (tmp_path / "run" / f"g{group}.log").read_text()
    assert read_lightning_checkpoint(str(checkpoints / "last.ckpt"))["global_step"] >= 10


def test_a_rank_lost_inside_a_group_is_restarted_by_torchrun_and_heals(tmp_path: Path) -> None:
    """One rank of group 1 SIGKILLed: its torchrun restarts the group's workers, which heal from group 0 (no
    storage read) and are then bit-identical to it; group 0 keeps its processes."""
    with FTCluster(tmp_path, groups=2, steps=100_000, step_sleep=0.15) as ft:
        ft.start_lighthouse()
        ft.launch(0)
        ft.launch(1, max_restarts=1)
        ft.wait_for(lambda: all(committing(ft, g, 2, 0, 3) for g in range(2)), 240, "two groups committing")
        pid = next(r["pid"] for r in reversed(ft.reports(1, 1)))
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        ft.wait_for(lambda: committing(ft, 0, 2, killed_at, 5) and committing(ft, 1, 2, killed_at, 5)
                    and sharing(ft, 0, 1, 5, killed_at), 240, "group 1 restarted and committing with group 0")
    before = {r["pid"] for r in ft.reports(0) if r["t"] < killed_at}
    assert {r["pid"] for r in ft.reports(0)} == before, "group 0 was restarted"
    for rank in range(2):
        back = [r for r in ft.reports(1, rank) if r["t"] > killed_at and r["pid"] != pid]
        assert back and back[0]["heals"] == 1, "the restarted group did not heal"
        assert assert_identical_where_shared(ft.reports(0, rank), back) >= 5
