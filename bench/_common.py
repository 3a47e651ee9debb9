"""Helpers shared by the benchmarks: gloo CPU process groups on 127.0.0.1 and the machine line.

A benchmark passes a function ``fn(rank, world_size, *args)``; :func:`run_on_ranks` starts one
spawned process per rank (one thread each, so ranks do not fight over the cores), runs it, and
returns what rank 0 returned. A failure on any rank is raised in the parent with that rank's
traceback instead of leaving the others waiting in a collective until a timeout.
"""

from __future__ import annotations

import gc
import os
import platform
import socket
import tempfile
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BACKEND = "gloo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
            out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # Deprecation notices (FSDP1, renamed collectives) would bury the report.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    dist.init_process_group(BACKEND, rank=rank, world_size=world_size)
    try:
        payload: tuple[str, Any] = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:  # reported by the parent, with the traceback
        payload = ("error", f"rank {rank}: {exc!r}\n{traceback.format_exc()}")
    if rank == 0 or payload[0] == "error":
        torch.save(payload, os.path.join(out_dir, f"rank{rank}.pt"))
    # Wrappers such as DDP, FSDP and ZeroEngine sit in reference cycles (hooks that close over
    # them) and hold the process group; collect them while it is still valid.
    gc.collect()
    dist.destroy_process_group()


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> Any:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo processes; rank 0's result."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world_size, free_port(), fn, args, out_dir), nprocs=world_size,
                           start_method="spawn")
        payloads = {f: torch.load(os.path.join(out_dir, f), weights_only=False) for f in sorted(os.listdir(out_dir))}
    errors = [body for status, body in payloads.values() if status == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return payloads["rank0.pt"][1]


def describe_machine() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    accelerator = "no GPU" if not torch.cuda.is_available() else f"GPU {torch.cuda.get_device_name()} (unused)"
    return (f"{cores} CPU cores ({platform.machine()}), {accelerator}; backend {BACKEND} on 127.0.0.1;"
            f" torch {torch.__version__}; Python {platform.python_version()}")


def load_average() -> str:
    """The 1/5/15-minute load average: other processes on the machine inflate timings."""
    return ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line (Linux only)")


def rss_bytes() -> int:
    """This process's resident set size now."""
    return _status_kib("VmRSS") * 1024


def held_bytes() -> int:
    """What this process holds in memory of its own: anonymous pages (``RssAnon``, the heap and every
    tensor) and shared anonymous ones (``RssShmem``). Not the file-backed pages it maps (``RssFile``:
    library code such as libtorch's kernels), which the page cache shares between every process of the
    machine and which a rank's RSS counts again in each; see :func:`file_backed_bytes`."""
    return (_status_kib("RssAnon") + _status_kib("RssShmem")) * 1024


def file_backed_bytes() -> int:
    """This process's resident file-backed pages (``RssFile``): mapped library code and files."""
    return _status_kib("RssFile") * 1024


def release_free_memory() -> None:
    """Collect garbage and hand freed heap pages back (glibc ``malloc_trim``), so a later RSS
    delta is what is alive, not what the allocator kept."""
    import ctypes

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the numbers are then upper bounds
        pass


class PeakRSS:
    """Peak resident memory above the start of a block: ``with PeakRSS() as peak: ...; peak.growth``.

    Resets the kernel's high-water mark (``echo 5 > /proc/self/clear_refs``, which sets VmHWM to
    the current RSS) on entry and reads VmHWM on exit, so the peak of each phase is measured, not
    computed, and a transient buffer freed before the block ends still counts.
    """

    def __enter__(self) -> PeakRSS:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        self.start = rss_bytes()
        return self

    def __exit__(self, *_: object) -> None:
        self.peak = _status_kib("VmHWM") * 1024
        self.growth = max(0, self.peak - self.start)


def muon_with_adamw(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """Muon for the transformer blocks' matrices, AdamW for the rest (embeddings tied with the head,
    LayerNorms, biases), as Muon is used: the one setup ``bench/optimizers.py`` and ``bench/engine.py
    --optimizer muon`` share."""
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]
    rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
    return [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1), torch.optim.AdamW(rest, lr=1e-3)]
