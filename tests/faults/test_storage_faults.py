"""Real storage faults on local disks: a file system that fills up mid-save (a 1 MiB tmpfs) and one
mounted read-only. Needs root for ``mount`` (skipped otherwise; a container without
CAP_SYS_ADMIN cannot mount either).

Why read-only rather than ``chmod``: the tests run as root, which ignores permission bits; a
read-only mount refuses root too, through the same ``open``/``mkdir`` calls.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_distributed
from fault_cases import MODES, sharded_tree, timed

from lightning_zero.checkpoint import (
    CheckpointSaveError,
    FlatShard,
    async_save,
    load,
    maybe_finalize_async_calls,
    save,
)

pytestmark = pytest.mark.usefixtures("one_rank")  # one in-process gloo rank (tests/conftest.py)


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()})")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs."""
    where = tmp_path / "small"
    _mount_tmpfs(where, "1m")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=True)


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs remounted read-only, holding one (writable before) subdirectory."""
    where = tmp_path / "ro"
    _mount_tmpfs(where, "1m")
    (where / "run").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
    yield where / "run"
    subprocess.run(["umount", "-l", str(where)], check=True)


def tree(value: float, numel: int) -> dict[str, Any]:
    return {"w": FlatShard(torch.full((numel,), value), (numel,), 0, 1), "b": torch.full((3,), value),
            "meta": {"n": 1}}


def loaded_value(path: Path, numel: int) -> float:
    target = tree(0.0, numel)
    load(target, str(path))
    return target["w"].local.unique().item()


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


BIG = 512 * 1024  # 2 MiB of float32: more than the disk holds


@pytest.mark.parametrize("mode", MODES)
def test_a_disk_that_fills_up_mid_save_fails_clearly_and_keeps_the_previous_checkpoint(
        small_disk: Path, tmp_path: Path, mode: str) -> None:
    path = small_disk / "last.ckpt"
    save(tree(1.0, 1000), str(path), mode=mode)
    committed = files(small_disk)
    live = tree(2.0, BIG)
    async_save(live, str(path), mode=mode)
    with pytest.raises(CheckpointSaveError, match=rf"{re.escape(repr(str(path)))} failed; the previous checkpoint is"
                                                  r" intact.*the disk is full.*No space left on device"):
        maybe_finalize_async_calls(blocking=True)
    assert loaded_value(path, 1000) == 1.0
    assert files(small_disk) == committed, "the failed save left files behind on the full disk"
    assert live["w"].local.eq(2.0).all(), "the training state in memory changed"
    save(live, str(tmp_path / "elsewhere.ckpt"), mode=mode)  # a later save with room succeeds
    assert loaded_value(tmp_path / "elsewhere.ckpt", BIG) == 2.0


@pytest.mark.parametrize("mode", ["local", "full"])
def test_a_failed_save_is_reported_once_and_the_next_save_still_writes_its_own(
        small_disk: Path, tmp_path: Path, mode: str) -> None:
    async_save(tree(2.0, BIG), str(small_disk / "a.ckpt"), mode=mode)
    with pytest.raises(CheckpointSaveError, match=r"a\.ckpt.*the disk is full"):
        async_save(tree(3.0, 1000), str(tmp_path / "b.ckpt"), mode=mode)
    maybe_finalize_async_calls(blocking=True)  # raised once: b's own save finishes cleanly
    assert loaded_value(tmp_path / "b.ckpt", 1000) == 3.0


@pytest.mark.parametrize("mode", MODES)
def test_a_read_only_path_fails_before_any_data_is_written_naming_it(read_only_dir: Path, mode: str) -> None:
    path = read_only_dir / "last.ckpt"
    async_save(tree(1.0, 1000), str(path), mode=mode)
    with pytest.raises(CheckpointSaveError, match=r"failed before any data was written.*cannot write"
                                                  rf" '{re.escape(str(read_only_dir))}.*read-only"):
        maybe_finalize_async_calls(blocking=True)
    assert files(read_only_dir) == []


def save_to(rank: int, world_size: int, path: str, mode: str) -> dict[str, Any]:
    return timed(lambda: save(sharded_tree(rank, world_size, 1.0), path, mode=mode))


@pytest.mark.parametrize("mode", MODES)
def test_a_read_only_path_fails_on_every_rank_without_hanging(read_only_dir: Path, mode: str) -> None:
    results = run_distributed(save_to, 2, str(read_only_dir / "last.ckpt"), mode, start_method="forkserver")
    for rank, result in enumerate(results):
        assert result["error"] and "read-only" in result["error"], f"rank {rank}: {result}"
        assert result["seconds"] < 10, f"rank {rank} took {result['seconds']:.1f} s"
