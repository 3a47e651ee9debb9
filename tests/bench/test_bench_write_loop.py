"""Smoke runs of bench/write_loop.py, so `make bench` does not break unnoticed: every write method
reports a time, and the fresh-memory measurement reports both passes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
METHODS = ("raw", "raw_writeback", "raw_writeback_cached", "sharded", "sharded_one_thread", "sharded_cached",
           "sharded_no_writeback", "local", "dcp_save")


@pytest.mark.slow
def test_the_write_loop_times_every_method() -> None:
    done = subprocess.run([sys.executable, str(BENCH / "write_loop.py"), "--size-mb", "16", "--rounds", "1"],
                          check=True, capture_output=True, text=True, timeout=300)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in done.stdout.splitlines() if line.startswith("| ")}
    for method in METHODS:
        assert re.fullmatch(rf"\| {method} \| \d+\.\d{{3}} \| [\d.]+ \| [\d,]+ \| \d+% \|", rows.get(method, "")), (
            method, done.stdout)


def test_the_fresh_memory_measurement_reports_both_passes() -> None:
    done = subprocess.run([sys.executable, str(BENCH / "write_loop.py"), "--fresh-memory", "--gib", "1"],
                          check=True, capture_output=True, text=True, timeout=120)
    assert re.search(r"^\| first \| [\d,]+ \|", done.stdout, re.M), done.stdout
    assert re.search(r"^\| second, just freed \| [\d,]+ \|", done.stdout, re.M), done.stdout
    assert "reported to the host" in done.stdout or "no free page reporting" in done.stdout
