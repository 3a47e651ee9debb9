"""bench/scale.py runs as `make bench` calls it (a small world here) and its checkpoint-planning
simulation plans what a real save writes."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def scale() -> object:
    sys.path.insert(0, str(BENCH))
    try:
        import scale as module
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_the_planning_simulation_plans_every_element_once_and_each_replicated_tensor_once(scale: object) -> None:
    world_size = 3
    planned = scale.plan_save(world_size, blocks=1)  # type: ignore[attr-defined]
    shapes = dict(planned.shapes)
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        for name, shape in shapes.items():
            chunks = planned.metadata.state_dict_metadata[f"{kind}/{name}"].chunks
            assert sum(chunk.sizes[0] for chunk in chunks) == math.prod(shape), (kind, name)
    written = [item.index.fqn for plan in planned.global_plans for item in plan.items]
    for name in shapes:
        assert written.count(f"step/{name}") == 1  # replicated on every rank, written by one
    assert len(written) == len(set((i.index.fqn, i.index.offset) for p in planned.global_plans for i in p.items))
    assert len(planned.global_plans) == world_size


def test_scale_bench_reports_engine_and_planning_rows(tmp_path: Path) -> None:
    out = tmp_path / "scale.md"
    subprocess.run([sys.executable, str(BENCH / "scale.py"), "--world-sizes", "4", "--blocks", "1", "--steps", "1",
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    text = out.read_text()
    assert "| 4 | 1 | 12 |" in text  # engine row: world size, blocks, tensors
    planning = [line for line in text.splitlines() if line.startswith("| 4 | 12 | 48 |")]
    assert len(planning) == 1, text  # 12 tensors x (master, exp_avg, exp_avg_sq, step) per rank
