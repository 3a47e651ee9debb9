"""A process forked after the saver ran (Lightning's fork/spawn launchers remove their weights file
through the plugin in the main process) saves normally: it does not inherit a thread-less worker."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import torch

from lightning_zero.checkpoint import maybe_finalize_async_calls, read_mode, remove, save


def _save_in_child(path: str) -> None:
    save({"x": torch.arange(3.0)}, path, mode="full")


def test_a_forked_child_saves_after_the_parent_used_the_saver(tmp_path: Path) -> None:
    leftover = tmp_path / "weights.ckpt"
    leftover.write_bytes(b"x")
    remove(str(leftover))  # starts the saver's worker thread in this process
    maybe_finalize_async_calls(blocking=True)
    assert not leftover.exists()
    child = multiprocessing.get_context("fork").Process(target=_save_in_child, args=(str(tmp_path / "c.ckpt"),))
    child.start()
    child.join(timeout=int(os.environ.get("FORK_JOIN", "60")))
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0, "the forked child's save never ran"
    assert read_mode(str(tmp_path / "c.ckpt")) == "full"
