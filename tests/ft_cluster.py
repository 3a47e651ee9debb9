"""A fault-tolerant job on 127.0.0.1 for the tests and bench/fault_tolerance.py: torchft's lighthouse and
one torchrun job per replica group (tests/faults/ft_job.py), each group's output in ``root/g<i>.log`` and
its per-step reports in ``root/g<i>_r<rank>.jsonl``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _dist import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent / "faults"))
from test_torchrun_elastic import descendants  # noqa: E402  (every process below an agent)

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "faults" / "ft_job.py"
BIN = Path(sys.executable).parent
HEARTBEAT_MS = 1000


def torchft_installed() -> bool:
    return (BIN / "torchft_lighthouse").exists()


def signal_tree(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to an agent's process group and every worker below it."""
    below = descendants(proc.pid)
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    for pid in below:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class FTCluster:
    """The lighthouse and the groups of one fault-tolerant job."""

    def __init__(self, root: Path, *, groups: int, ranks: int = 2, steps: int = 30, step_sleep: float = 0.0,
                 timeout_s: float = 5.0, min_replicas: int = 1, env: dict[str, str] | None = None,
                 join_timeout_ms: int = 1000) -> None:
        self.root, self.groups, self.ranks = root, groups, ranks
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("MASTER_", "WORLD_SIZE", "RANK", "LOCAL_", "TORCHELASTIC"))}
        # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: workers torchrun restarts would otherwise read the dead attempt's
        # gloo addresses from the agent's store (the fault-tolerance guide's launch lines say so too).
        self.env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", FT_OUT=str(root), FT_GROUPS=str(groups),
                        FT_STEPS=str(steps), FT_STEP_SLEEP=str(step_sleep), FT_TIMEOUT=str(timeout_s),
                        TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{self.port}", **(env or {}))
        self.min_replicas, self.join_timeout_ms = min_replicas, join_timeout_ms
        self.lighthouse: subprocess.Popen | None = None
        self.procs: dict[int, subprocess.Popen] = {}
        self.launches: dict[int, int] = {}

    def start_lighthouse(self) -> None:
        with open(self.root / "lighthouse.log", "a") as out:
            self.lighthouse = subprocess.Popen(
                [str(BIN / "torchft_lighthouse"), "--min_replicas", str(self.min_replicas), "--bind",
                 f"[::]:{self.port}", "--quorum_tick_ms", "100", "--heartbeat_timeout_ms", str(HEARTBEAT_MS),
                 "--join_timeout_ms", str(self.join_timeout_ms)], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def launch(self, group: int, max_restarts: int = 0, extra_env: dict[str, str] | None = None) -> None:
        self.launches[group] = self.launches.get(group, 0) + 1
        log = self.root / f"g{group}.log"
        cmd = [str(BIN / "torchrun"), "--nnodes", "1", "--nproc-per-node", str(self.ranks), "--rdzv-backend",
               "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", f"g{group}",
               "--max-restarts", str(max_restarts), "--monitor-interval", "0.1", str(JOB)]
        with open(log, "a") as out:
            self.procs[group] = subprocess.Popen(cmd, env={**self.env, "REPLICA_GROUP_ID": str(group), **(extra_env or {})},
                                                 stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)

    def start(self) -> FTCluster:
        self.start_lighthouse()
        for group in range(self.groups):
            self.launch(group)
        return self

    def kill(self, group: int, sig: int = signal.SIGKILL) -> float:
        """``sig`` to a group (its agent and workers); returns the time."""
        at = time.time()
        signal_tree(self.procs[group], sig)
        return at

    def reports(self, group: int, rank: int = 0) -> list[dict[str, Any]]:
        path = self.root / f"g{group}_r{rank}.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def committed(self, group: int, rank: int = 0) -> list[dict[str, Any]]:
        return [r for r in self.reports(group, rank) if r.get("committed", True)]

    def wait_for(self, condition: Any, timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if condition():
                return
            for group, proc in self.procs.items():
                if proc.poll() not in (None, 0) and proc.returncode != -signal.SIGKILL:
                    raise AssertionError(f"group {group} failed ({proc.returncode}) while waiting for {what}:\n"
                                         + self.log_tail(group))
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}\n"
                             + "\n".join(self.log_tail(g) for g in self.procs))

    def step_of(self, group: int) -> int:
        done = self.committed(group)
        return done[-1]["global_step"] if done else 0

    def wait_exit(self, group: int, timeout: float) -> int:
        return self.procs[group].wait(timeout)

    def log_tail(self, group: int, lines: int = 40) -> str:
        path = self.root / f"g{group}.log"
        text = path.read_text(errors="replace").splitlines() if path.exists() else []
        keep = [line for line in text if "[INFO]" not in line and "deprecated" not in line]
        return f"--- g{group}.log ---\n" + "\n".join(keep[-lines:])

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                signal_tree(proc, signal.SIGKILL)
        if self.lighthouse is not None and self.lighthouse.poll() is None:
            os.killpg(self.lighthouse.pid, signal.SIGKILL)
        for proc in [*self.procs.values(), *([self.lighthouse] if self.lighthouse else [])]:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> FTCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
