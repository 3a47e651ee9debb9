"""Run a function on N gloo CPU processes and collect what each rank returns."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONSOLE = os.path.join(os.path.dirname(sys.executable), "lightning-zero")
"""The console command as pip installed it beside the interpreter running the tests (a venv's bin/, or a
system's), which is where a user's shell finds it: not a path assumed under the repository."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


COLLECTIVE_TIMEOUT = timedelta(seconds=120)
"""A collective that ranks do not all reach (a bug under test) fails after this, instead of
hanging the test run for gloo's default 30 minutes."""


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    try:
        result: Any = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:  # reported to the parent with the traceback
        result = ("error", f"rank {rank}: {exc!r}\n{traceback.format_exc()}")
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


FORKSERVER_PRELOAD = ["torch", "lightning_zero", "engine_cases", "_dist"]
"""Modules the fork server imports once (conftest.py sets them): a rank forked from it starts in
~0.1 s, where a spawned rank imports torch and lightning itself (~6 s of CPU each, so 8 ranks
on 2 cores take ~50 s)."""


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, start_method: str = "spawn") -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank; returns the per-rank results.

    ``start_method="forkserver"`` is the fast choice for tests; ``fn`` must be importable
    (defined in a module, not a test body) with either method.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world_size, free_port(), fn, args, out_dir), nprocs=world_size,
                           start_method=start_method)
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
    errors = [payload for status, payload in results if status == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [payload for _, payload in results]
