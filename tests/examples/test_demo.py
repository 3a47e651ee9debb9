"""``make demo``'s script: it finishes, its resumed run starts from the saved step, and its summary
reports how long every save blocked the loop (the figures the runs' CSV loggers received)."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^((?:epoch=\d+-)?step=(\d+)(?:\.ckpt)?)\s+(\d)\s+([\d.]+ MB|removed)\s+([\d.]+) ms\s+(\d+) ms$")


def logged_blocked_ms(metrics_csv: Path) -> dict[int, float]:
    with open(metrics_csv) as f:
        return {int(float(row["checkpoint/step"])): float(row["checkpoint/blocked_ms"])
                + float(row["checkpoint/staging_wait_ms"]) for row in csv.DictReader(f) if row.get("checkpoint/step")}


@pytest.mark.slow
def test_demo_resumes_from_the_saved_step_and_reports_each_saves_blocked_time(tmp_path: Path) -> None:
    root = tmp_path / "demo"
    done = subprocess.run([sys.executable, "examples/demo.py", "--root", str(root), "--steps", "20",
                           "--resume-steps", "20", "--small", "--hf-steps", "2"], cwd=REPO, capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    # The resumed run (3 processes) starts where the first (2 processes) saved.
    assert "[demo] world size 2, start at step 0;" in output
    assert "[demo] world size 3, start at step 20;" in output
    assert "Restored all states from the checkpoint" in output
    # Our own code paths print no warning a user cannot act on.
    assert "LeafSpec" not in output and "lightning_zero/" not in output.replace("lightning_zero demo", "")

    rows = [m.groups() for line in done.stdout.splitlines() if (m := ROW.match(line.strip()))]
    assert [(int(step), int(procs)) for _, step, procs, *_ in rows] == [(20, 2), (40, 3)]
    logged = {**logged_blocked_ms(root / "logs" / "version_0" / "metrics.csv"),
              **logged_blocked_ms(root / "logs" / "version_1" / "metrics.csv")}
    for name, step, _, size, blocked, committed in rows:
        assert float(blocked) == pytest.approx(logged[int(step)], abs=0.06)  # the table shows 1 decimal
        assert float(committed) > 0
        assert size.endswith(" MB") and (root / "checkpoints" / name).is_file()
    assert (root / "export" / "model.ckpt").is_file()
    transformers = pytest.importorskip("transformers")
    transformers.AutoModelForCausalLM.from_pretrained(root / "export" / "hf")  # the --to hf export loads
    assert "last.ckpt -> epoch=0-step=40.ckpt" in done.stdout
