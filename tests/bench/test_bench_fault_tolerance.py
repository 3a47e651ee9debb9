"""bench/fault_tolerance.py: its helpers in this process (the stall, the heal, the step time read from the jobs'
JSON lines, the report's rows and ratios), and its ``--quick`` run end to end (minutes: 2 groups x 2 ranks with
torchft, the same job under torch elastic, and the step-time pair)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ft_cluster import torchft_installed  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def ft_bench(bench_import: Any) -> Any:
    return bench_import("fault_tolerance")


def line(t: float, step: int, committed: bool = True, participants: int = 2, heals: int = 0,
         heal_s: float | None = None) -> dict[str, Any]:
    return {"t": t, "global_step": step, "committed": committed, "participants": participants, "heals": heals,
            "last_heal_s": heal_s}


def test_the_stall_runs_from_the_kill_to_the_survivors_next_step_committed_without_the_dead_group(
        ft_bench: Any) -> None:
    survivor = [line(9.0, 7, participants=3), line(10.2, 8, participants=3),  # in flight at the kill, still 3
                line(11.5, 8, committed=False), line(12.0, 9, participants=2), line(12.1, 10, participants=2)]
    assert ft_bench.stall_of(survivor, 10.0, 2) == {"stall": pytest.approx(2.0), "discarded": 1}
    assert ft_bench.stall_of(survivor[:3], 10.0, 2) is None


def test_the_heal_runs_from_the_relaunch_to_the_first_committed_step_and_must_follow_a_heal(ft_bench: Any) -> None:
    relaunched = [line(5.0, 3, participants=3), line(21.0, 14, committed=False, heals=1, heal_s=0.2),
                  line(22.5, 15, participants=3, heals=1, heal_s=0.25)]
    assert ft_bench.heal_of(relaunched, 20.0) == {"heal": pytest.approx(2.5), "transfer": 0.25}
    with pytest.raises(RuntimeError, match="did not follow a heal"):
        ft_bench.heal_of([line(21.0, 1, participants=3)], 20.0)
    survivor = [line(20.5, 14, committed=False), line(22.5, 15, participants=3)]
    assert ft_bench.rejoin_discards(survivor, 20.0, 3) == 1
    assert ft_bench.rejoin_discards(survivor[:1], 20.0, 3) is None


def test_a_run_of_discarded_steps_stops_the_benchmark(ft_bench: Any) -> None:
    ft_bench.check_progress([line(float(i), 3, committed=False) for i in range(29)] + [line(30.0, 4)], 0)
    with pytest.raises(RuntimeError, match="group 1 discarded its last 30 steps"):
        ft_bench.check_progress([line(0.0, 2)] + [line(float(i), 3, committed=False) for i in range(30)], 1)


def test_the_step_time_is_the_mean_past_warm_up(ft_bench: Any) -> None:
    lines = [line(float(step), step) for step in range(1, 6)] + [line(6.0 + 0.5 * i, 6 + i) for i in range(5)]
    assert ft_bench.mean_step_s(lines, 5) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="past warm-up"):
        ft_bench.mean_step_s(lines, 9)


def test_the_report_sets_the_elastic_recovery_against_the_stall_and_the_step_times_side_by_side(ft_bench: Any) -> None:
    results = {"ft": [{"stall": 1.5, "discarded": 1, "heal": 8.0, "transfer": 0.1, "rejoin_discarded": 0,
                       "timeout_s": 5.0}],
               "elastic": [{"recovery": 12.0, "worker": 6.0, "resume": 0.2, "world": 2, "tier": "local", "lost": 0}],
               "steps": [{"with": 0.012, "without": 0.010}], "steps_wide": [{"with": 0.110, "without": 0.100}]}
    args = argparse.Namespace(groups=2, repeats=1, step_sleep=0.05, warmup=10, step_steps=40, width=1024)
    text = ft_bench.build_report(args, results, "cmd", 1.0, "machine.")
    assert ("| fault tolerance (torchft): the survivors go on at 1 x 2 | 1.50 | 1 (at the rejoin: 0) | 8.00 | 0.100 |"
            in text)
    assert "| torch elastic, tuned, from the fast tier: restarted at 2 ranks | 12.00 | 0 (steps lost) |" in text
    assert "| torch elastic recovery / fault-tolerance stall | 8.0 |" in text
    assert "the groups' timeout_s 5 s" in text
    assert "| torch elastic recovery / relaunched group's relaunch -> first committed step | 1.50 |" in text
    assert "| fault tolerance (torchft, 2 groups) | 12.0 | 1.20 |" in text
    assert "| fault tolerance, 1024-wide MLP (2 hidden layers) | 110.0 | 1.10 |" in text


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.skipif(not torchft_installed(), reason='needs the [ft] extra: pip install "lightning-zero[ft]"')
@pytest.mark.timeout(900)
def test_the_quick_run_reports_the_stall_the_heal_the_elastic_recovery_and_the_step_times(tmp_path: Path) -> None:
    out = tmp_path / "fault_tolerance.md"
    done = subprocess.run([sys.executable, str(BENCH / "fault_tolerance.py"), "--quick", "--dir", str(tmp_path),
                           "--out", str(out)], check=True, capture_output=True, text=True, timeout=840)
    text = out.read_text()
    assert text in done.stdout
    assert re.search(r"^\| fault tolerance \(torchft\): the survivors go on at 1 x 2 \| [\d.]+ \| \d+ \(at the rejoin:"
                     r" \d+\) \| [\d.]+ \| [\d.]+ \|$", text, re.M), text
    assert re.search(r"^\| torch elastic, tuned, from the fast tier: restarted at 2 ranks \| [\d.]+ \|", text,
                     re.M), text
    assert re.search(r"^\| torch elastic recovery / fault-tolerance stall \| [\d.]+ \|$", text, re.M), text
    assert re.search(r"^\| fault tolerance \(torchft, 2 groups\) \| [\d.]+ \| [\d.]+ \|$", text, re.M), text


def test_the_step_only_report_gives_the_step_times_and_the_phases_side_by_side(ft_bench: Any) -> None:
    phases_with = {"steps": 50, "step": 0.030, "quorum": 0.006, "hop_wait": 0.004, "commit": 0.005,
                   "should_commit": 0.0045, "finish_backward": 0.009, "optimizer_step": 0.024}
    phases_without = {"steps": 50, "step": 0.020, "finish_backward": 0.011, "optimizer_step": 0.015}
    run = {"with": 0.030, "without": 0.020, "phases_with": phases_with, "phases_without": phases_without}
    results = {"ft": [], "elastic": [], "steps": [run], "steps_wide": [{**run, "with": 0.110, "without": 0.100}]}
    args = argparse.Namespace(groups=2, repeats=1, step_sleep=0.05, warmup=10, step_steps=60, width=1024)
    text = ft_bench.build_report(args, results, "cmd --only step", 1.0, "machine.")
    assert "torch elastic" not in text
    assert "| fault tolerance (torchft, 2 groups) | 30.0 | 1.50 |" in text
    assert "| 8-16-1 MLP | quorum | 6.0 | - |" in text
    assert "| 8-16-1 MLP | finish_backward | 9.0 | 11.0 |" in text
    assert "| 1024-wide MLP | should_commit | 4.5 | - |" in text
