"""Helpers of bench/checkpoint.py that know nothing about checkpoints: raw-disk writes, the page
cache, process plumbing, aggregation over ranks and repeats, and the machine's description."""

from __future__ import annotations

import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MIB = 1024 * 1024
MB = 1_000_000

now = time.monotonic  # CLOCK_MONOTONIC: comparable across the processes of one machine


# ---- file helpers ---------------------------------------------------------------------------


def write_raw(path: str, nbytes: int, chunk: memoryview, writeback: bool = False,
              drop_behind: bool = True) -> tuple[float, float]:
    """Sequential large writes then fsync; returns (start, end) on the monotonic clock. With
    ``writeback``, through the checkpoint writers' ``WritebackStream`` ([Note: early writeback]),
    dropping written pages unless not ``drop_behind``."""
    from lightning_zero.checkpoint.store.writeback import WritebackStream

    start = now()
    with open(path, "wb", buffering=0) as raw:
        f = WritebackStream(raw, drop_behind=drop_behind) if writeback else raw
        left = nbytes
        while left > 0:
            left -= f.write(chunk[: min(left, len(chunk))])
        os.fsync(raw.fileno())
    return start, now()


def drop_page_cache(root: str) -> None:
    """Evict the files under ``root`` from the page cache. They were fsynced, so their pages are
    clean and POSIX_FADV_DONTNEED drops them without root rights (unlike /proc/sys/vm/drop_caches)."""
    for dirpath, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ---- process plumbing -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks on two cores: one compute thread each
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        payload: Any = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:  # reported by the parent with the traceback
        payload = ("error", f"rank {rank}: {exc!r}\n{traceback.format_exc()}")
    if rank == 0 or payload[0] == "error":
        torch.save(payload, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def run_world(fn: Callable[..., Any], world_size: int, *args: Any) -> Any:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world_size, free_port(), fn, args, out_dir), nprocs=world_size,
                           start_method="spawn")
        payloads = [torch.load(os.path.join(out_dir, f), weights_only=False) for f in sorted(os.listdir(out_dir))]
    errors = [body for status, body in payloads if status == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return payloads[0][1]


def max_over_ranks(value: float) -> float:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return max(gathered)


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# ---- aggregation ----------------------------------------------------------------------------


def slowest(records: list[list[dict[str, float]]], key: str) -> list[float]:
    """Per repeat, the slowest rank's value (training waits for the slowest rank)."""
    return [max(r[key] for r in ranks if key in r) for ranks in records]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def throughput(records: list[list[dict[str, float]]], total_bytes: int) -> list[float]:
    """Bytes/s of the background write: all ranks' bytes over (last commit - last staging end)."""
    return [total_bytes / (max(r["committed_at"] for r in ranks) - max(r["staged_at"] for r in ranks))
            for ranks in records]


def raw_throughput(records: list[list[dict[str, float]]]) -> list[float]:
    return [sum(r["bytes"] for r in ranks if r) / (max(r["end"] for r in ranks if r) - min(r["start"] for r in ranks if r))
            for ranks in records]


@dataclass(frozen=True)
class Check:
    name: str
    value: float
    limit: float
    at_most: bool
    detail: str

    @property
    def passed(self) -> bool:
        return self.value <= self.limit if self.at_most else self.value >= self.limit

    def line(self) -> str:
        sign = "<=" if self.at_most else ">="
        return (f"- **{'PASS' if self.passed else 'FAIL'}** {self.name}: {self.value:.3g} {sign} {self.limit:.3g}"
                f" ({self.detail})")


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}" if seconds >= 0.01 else f"{seconds * 1e3:.2f}"


def runs(values: Sequence[float], scale: float = 1e3) -> str:
    return "/".join(f"{v * scale:.0f}" if v * scale >= 10 else f"{v * scale:.2g}" for v in values)


# ---- the machine ----------------------------------------------------------------------------


def describe_machine(root: str) -> str:
    df = subprocess.run(["df", "-T", root], capture_output=True, text=True).stdout.splitlines()
    device, fstype = (df[-1].split()[:2] if len(df) > 1 else ("?", "?"))
    cores = len(os.sched_getaffinity(0))
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{cores} CPU cores ({cpu}), {mem:.0f} GiB RAM, no GPU; checkpoints in {root} on {device}"
            f" ({fstype}, `df -T`); gloo on 127.0.0.1; torch {torch.__version__}; Python"
            f" {platform.python_version()}; load average at start {load}.")


def busy_cpu_seconds() -> float:
    """CPU time every process on the machine has used since boot (user + nice + system + irq)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    import resource

    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


OUT_DIR = Path(__file__).resolve().parent / "out"


def bench_command(argv: Sequence[str] | None, env: str = "") -> str:
    """The command line of a ``bench/checkpoint.py`` run, as a report prints it."""
    return " ".join([*([env] if env else []), ".venv/bin/python", "bench/checkpoint.py",
                     *(argv if argv is not None else sys.argv[1:])])


@contextmanager
def scratch_root(directory: str, name: str) -> Iterator[str]:
    """A fresh directory for one variant's files under ``directory`` (``--dir``), removed afterwards."""
    os.makedirs(directory, exist_ok=True)
    root = tempfile.mkdtemp(prefix=f"lz-ckpt-{name}-", dir=directory)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def publish(text: str, out: Path | None, name: str) -> None:
    """Print a report and write it to ``out`` (default ``bench/out/checkpoint-<name>.md``)."""
    print(text)
    out = out or OUT_DIR / f"checkpoint-{name}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
