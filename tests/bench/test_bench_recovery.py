"""bench/recovery.py's helpers, in this process (a real run takes minutes: `.venv/bin/python bench/recovery.py`):
its options, the step time read from the SAVED lines, and the report's rows and durable / fast ratios."""

from __future__ import annotations

import argparse
from typing import Any

import pytest


@pytest.fixture(scope="module")
def recovery(bench_import: Any) -> Any:
    return bench_import("recovery")


def test_help_names_the_persist_interval_and_the_durable_directory(recovery: Any,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        recovery.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "--persist-every" in text and "--durable-dir" in text and "--kill-after" in text


def test_a_kill_before_the_first_persisted_save_is_refused(recovery: Any) -> None:
    with pytest.raises(SystemExit):
        recovery.main(["--persist-every", "5", "--kill-after", "3"])


def test_the_step_time_is_the_gap_between_consecutive_saves_at_one_world_size(recovery: Any) -> None:
    log = "\n".join(["SAVED node=a step=6 world=2 restart=0 at=100.000", "noise",
                     "SAVED node=a step=7 world=2 restart=0 at=100.250", "SAVED node=a step=9 world=2 restart=0 at=101.0",
                     "SAVED node=a step=10 world=2 restart=0 at=101.5", "SAVED node=b step=11 world=2 restart=0 at=9.0",
                     "SAVED node=a step=3 world=4 restart=0 at=50.0", "SAVED node=a step=4 world=4 restart=0 at=51.0"])
    assert recovery.step_gaps(log, 2) == pytest.approx([0.25, 0.5])  # 7 -> 9 skipped; node b's line ignored
    assert recovery.step_gaps(log, 4) == pytest.approx([1.0])


def run(tier: str, step: int, total: float, worker: float, gaps: list[float], world: int = 2,
        resharded: int | None = None) -> dict[str, Any]:
    return {"agent": worker + 1, "worker": worker, "startup": worker - 0.5, "first": 0.2, "choose": 0.01,
            "reshard": 0.0, "load": total - 0.01,
            "total": total, "lost": 8 - step, "tier": tier, "step": step, "from": resharded, "world": world,
            "gaps": gaps}


def test_the_report_charges_the_durable_resume_its_lost_steps(recovery: Any) -> None:
    results = {"fast": [run("local", 8, 0.2, 5.0, [0.1, 0.1], resharded=4)],
               "durable": [run("durable", 5, 0.4, 5.0, [0.1, 0.1, 0.1])],
               "same": [run("local", 8, 0.25, 10.0, [0.3], world=4)]}
    summary = recovery.summarize(results)
    assert summary["step_s"] == pytest.approx(0.1)  # world size 2 only: the same-size restart's gap is left out
    assert summary["rows"]["durable"]["back"] == pytest.approx(0.4 + 3 * 0.1)
    assert summary["rows"]["fast"]["back"] == pytest.approx(0.2)
    args = argparse.Namespace(width=64, depth=2, persist_every=5, repeats=1)
    text = recovery.build_report(args, results, 8, "cmd", 1.0, "machine.", "S3")
    assert "| durable tier (sharded), 4 -> 2 ranks | durable | 5 | 3 | 4 (on load) |" in text, text
    assert "| fast tier, 4 -> 2 ranks (resharded) | local | 8 | 0 | 4 |" in text, text
    assert "| resume (choose + reshard + load) | 2.00 |" in text
    assert "| back at step 8 (resume + lost steps trained again) | 3.50 |" in text
