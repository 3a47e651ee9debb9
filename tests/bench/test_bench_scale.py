"""bench/scale.py runs as `make bench` calls it (a small world here) and its checkpoint-planning
simulation plans what a real save writes."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def scale(bench_import: Any) -> Any:
    return bench_import("scale")


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


def test_pool_rows_show_the_byte_ceiling_keeping_a_7b_pool_flat_from_256_to_1024_ranks(scale: object) -> None:
    numels = scale.llama_7b_numels()  # type: ignore[attr-defined]
    assert 6.7e9 < sum(numels) < 6.8e9
    mib = 1024 * 1024

    def pools(ws: int) -> tuple[int, int]:
        old = scale.pool_bytes(numels, ws, scale.old_default_bucket_numel(ws, 2), 2)  # type: ignore[attr-defined]
        new = scale.pool_bytes(numels, ws, scale.ZeroConfig().bucket_numel(ws, 2), 2)  # type: ignore[attr-defined]
        return old, new

    assert pools(64)[0] == pools(64)[1]  # below the ceiling nothing changed
    old_1024, new_1024 = pools(1024)
    assert old_1024 > 3900 * mib  # uncapped: two ~2 GiB slots
    # Two slots; a bucket closes once it reaches the 256 MiB ceiling, so it holds less than the ceiling
    # plus its last parameter (at most the 250 MiB embedding), flags and output row aside.
    assert new_1024 <= 2 * (256 + 250 + 2) * mib
    rows = scale.pool_report([8, 1024])  # type: ignore[attr-defined]
    assert any(row.startswith("| 1024 | 1,953 | 4,036 | 256 |") for row in rows), rows
