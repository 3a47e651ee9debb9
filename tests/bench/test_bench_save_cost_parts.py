"""bench/save_cost_parts.py: its measurement-only patches come off again, the step positions are counted from the
save, and a short run prints a row per variant (slow)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_a_variant_takes_its_parts_out_and_puts_them_back(bench_import) -> None:
    parts = bench_import("save_cost_parts")
    from lightning_zero.checkpoint.modes import local as local_mode
    from lightning_zero.checkpoint.runtime import staging
    from lightning_zero.checkpoint.store import file_io

    before = (local_mode.integrity, file_io._save_keeping_write_errors, staging._host_copy)
    tensor = torch.ones(3)
    assert staging._host_copy(tensor).data_ptr() != tensor.data_ptr()
    with parts.without("none"):
        assert staging._host_copy(tensor).data_ptr() == tensor.data_ptr()  # the live tensor, not a copy
        assert local_mode.integrity.header({}, "id", 0, 1) == {}
        assert local_mode.integrity.checksums_enabled()  # write_local asks it: the records get no CRC32 either
    with parts.without("no-crc"):
        assert file_io._save_keeping_write_errors is before[1] and staging._host_copy is before[2]
    assert (local_mode.integrity, file_io._save_keeping_write_errors, staging._host_copy) == before


def test_copy_only_keeps_the_copy_and_pinned_gives_the_cpus_back(bench_import) -> None:
    parts = bench_import("save_cost_parts")
    import os

    from lightning_zero.checkpoint.modes import local as local_mode
    from lightning_zero.checkpoint.runtime import scheduler, staging
    from lightning_zero.checkpoint.store import file_io

    tensor = torch.ones(3)
    with parts.without("copy-only"):
        assert staging._host_copy(tensor).data_ptr() != tensor.data_ptr()  # still a copy
        assert local_mode.integrity.header({}, "id", 0, 1) == {}
        written = []
        file_io._save_keeping_write_errors({"t": tensor}, type("S", (), {"write": written.append})(), False)
        assert written == [b"x"]
    cpus, run = os.sched_getaffinity(0), scheduler.SerialWorker._run
    if len(cpus) < 2:
        pytest.skip("pinning needs 2 CPUs")
    with parts.without("pinned"):
        assert len(os.sched_getaffinity(0)) == 1 and scheduler.SerialWorker._run is not run
    assert os.sched_getaffinity(0) == cpus and scheduler.SerialWorker._run is run


def test_steps_are_counted_by_their_position_after_the_save(bench_import) -> None:
    parts = bench_import("save_cost_parts")
    # 11 step starts 10 ms apart, except that the steps at positions 0 (after a save) take 30 ms.
    starts, t = [], 0.0
    for i in range(11):
        starts.append(("training_step", t))
        t += 0.030 if i % 2 == 0 else 0.010
    positions = parts.by_position(starts, every=2)
    assert positions == pytest.approx({0: 30.0, 1: 10.0})


@pytest.mark.slow
def test_a_short_run_prints_a_row_per_variant() -> None:
    done = subprocess.run([sys.executable, str(BENCH / "save_cost_parts.py"), "--variants", "full", "none",
                           "--steps", "16"], check=True, capture_output=True, text=True, timeout=600)
    for variant in ("full", "none"):
        assert re.search(rf"^\| {variant} \| 1 \| [\d.]+ \| [\d.]+ \| [\d.]+x \| [\d /]+ \|", done.stdout, re.M), done.stdout
