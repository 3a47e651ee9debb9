"""bench/engine.py bills each method the work it started: a turn ends with our engine's overlapped
gathers finished ([Note: honest turns] in bench/engine.py), and the report fails a method whose
background work outlived its turn."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from _dist import run_distributed

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _bench_module() -> Any:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import engine as bench_engine

    return bench_engine


def run_turns(rank: int, _world_size: int) -> dict[str, bool]:
    """A zero2 method of the benchmark: background work after a bare step, and after a timed turn."""
    bench = _bench_module()
    settings = bench.QUICK
    method = bench.build_method("zero2", settings)
    batches = bench.make_batches(settings, rank, 3)
    bench.train_step(method, batches[0])
    after_step = method.background_work()  # the gathers the step started are still queued
    method.finish()
    _, after_turn = bench.timed_turn(method, batches[1:])
    method.engine.close()
    return {"after_step": after_step, "after_turn": after_turn}


def test_a_timed_turn_ends_with_the_gathers_its_steps_started_finished() -> None:
    for result in run_distributed(run_turns, 2, start_method="forkserver"):
        # The detector sees real work: a step returns while its gathers run (overlap_param_gather).
        assert result["after_step"], result
        assert not result["after_turn"], result


def test_the_report_fails_a_method_whose_work_outlived_its_turn() -> None:
    bench = _bench_module()
    result = bench.MethodResult(
        world_size=2, method="zero2", step_ms_rounds=[1.0, 1.0], phase_ms={}, state_bytes=[], master_bytes=[],
        grad_bytes=[], shard_numel=[], final_loss=0.0, resident_bytes=[], phase_peak_bytes={}, param_bytes=0,
        unsharded_state_bytes=0, leftover_turns=1,
    )
    [check] = bench.turn_checks([result])
    assert not check.passed and "zero2 1" in check.detail
    [check] = bench.turn_checks([bench.dataclasses.replace(result, leftover_turns=0)])
    assert check.passed


def test_engine_bench_smoke_run_passes_the_turn_boundary_check(tmp_path: Path) -> None:
    out = tmp_path / "engine.md"
    subprocess.run([sys.executable, str(BENCH / "engine.py"), "--quick", "--world-sizes", "2", "--rounds", "2",
                    "--methods", "zero2", "--out", str(out)], check=True, capture_output=True, timeout=600)
    text = out.read_text()
    assert "- PASS: ws=2: every method's turns ended with all its work done" in text, text
    assert "| 2 | zero2 |" in text and "| 2 | ddp |" in text
    assert "drain ms" in text


def test_deepspeed_rows_are_optional() -> None:
    # DeepSpeed is not a test dependency: its rows run only when asked for (make bench-peers).
    bench = _bench_module()
    assert not set(bench.PEERS) & set(bench.methods_for(4))
    assert set(bench.PEERS) <= set(bench.methods_for(4, peers=True))
    assert bench.methods_for(2, ("ddp", "zero2"), peers=True) == ("ddp", "zero2")


def test_resident_memory_is_checked_against_deepspeed_when_its_rows_ran() -> None:
    bench = _bench_module()
    mib = 1024 * 1024

    def row(method: str, resident_mib: float) -> Any:
        return bench.MethodResult(
            world_size=2, method=method, step_ms_rounds=[1.0], phase_ms={}, state_bytes=[], master_bytes=[],
            grad_bytes=[], shard_numel=[], final_loss=0.0, resident_bytes=[int(resident_mib * mib)] * 2,
            phase_peak_bytes={}, param_bytes=40 * mib, unsharded_state_bytes=0, leftover_turns=0)

    without = {"ddp": row("ddp", 180), "zero2": row("zero2", 110)}
    assert not any("deepspeed" in c.target for c in bench.resident_checks(without))
    for ours, theirs, passed in ((110, 143, True), (126, 100, False)):
        by_name = {**without, "zero2": row("zero2", ours), "deepspeed_zero2": row("deepspeed_zero2", theirs)}
        [check] = [c for c in bench.resident_checks(by_name) if "deepspeed_zero2" in c.target]
        assert check.passed is passed, check


def test_muon_rows_run_the_methods_that_can_step_muon_and_refuse_the_others() -> None:
    import dataclasses

    import pytest

    bench = _bench_module()
    assert bench.parse_args(["--optimizer", "muon"]).methods == list(bench.MUON_METHODS)
    settings = dataclasses.replace(bench.QUICK, optimizer="muon")
    with pytest.raises(ValueError, match="--optimizer muon runs ddp, zero1, zero2"):
        bench.build_method("fsdp_shard_grad_op", settings)
    names = [type(o).__name__ for o in bench.make_optimizers(bench.build_model(settings.model, 0), settings)]
    assert names == ["Muon", "AdamW"]


def test_held_memory_counts_tensors_and_not_the_library_pages_a_process_maps() -> None:
    # The resident figure is memory the process holds (RssAnon + RssShmem); library code pages (RssFile)
    # are shared by every process of the machine and reported apart. Touch 16 MiB of libtorch's own file
    # pages, then allocate 16 MiB of tensor: only the tensor is held.
    import mmap

    import torch

    _bench_module()  # bench/ on the path
    import _common as common
    library = max(Path(torch.__file__).parent.joinpath("lib").glob("libtorch_cpu*.so*"), key=lambda p: p.stat().st_size)
    mib = 1024 * 1024
    with open(library, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        held, code = common.held_bytes(), common.file_backed_bytes()
        touched = sum(mapped[i] for i in range(0, 16 * mib, mmap.PAGESIZE))
        assert common.file_backed_bytes() - code >= 12 * mib, touched
        assert common.held_bytes() - held < 4 * mib
    # Freed heap that glibc kept resident would serve the tensor without growing the RSS: hand it back first.
    common.release_free_memory()
    held = common.held_bytes()
    tensor = torch.ones(4 * mib)  # 16 MiB of float32, every page written
    assert common.held_bytes() - held >= 15 * mib
    del tensor
