"""bench/gloo_gather.py runs and reports both gathers (each one's rows are checked inside the script)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_gloo_gather_bench_gathers_the_same_rows_both_ways_and_reports_them() -> None:
    run = subprocess.run([sys.executable, str(BENCH / "gloo_gather.py"), "--world-sizes", "2", "--rounds", "1",
                          "--numel", "300000"], check=True, capture_output=True, text=True, timeout=300)
    rows = [line for line in run.stdout.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 1, run.stdout
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    assert float(cells[1]) > 0 and float(cells[2]) > 0 and cells[3].endswith("x"), rows
