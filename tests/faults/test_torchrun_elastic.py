"""Elastic recovery under real torch elastic, nobody restarting anything by hand: two torchrun agents on
127.0.0.1 (``--nnodes=1:2 --nproc-per-node=2``, c10d rendezvous), each node with its own local-tier
directory, run examples/elastic.py (``ckpt_path="last"`` on every start). The second agent and its workers
are SIGKILLed between two saves; the first agent's rendezvous drops the dead node, it restarts its own two
workers at world size 2, they resume from the local tier resharded 4 -> 2 and finish the run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _dist import free_port

REPO = Path(__file__).resolve().parents[2]
NODE = REPO / "tests" / "elastic_torchrun_node.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
RDZV_CONF = "join_timeout=300,last_call_timeout=5,keep_alive_interval=2,keep_alive_max_attempt=3"
"""The dead node is dropped ~6 s after its last heartbeat; a rendezvous with fewer than 2 nodes closes 5 s
after the first joined (both agents start together, so the first one has both)."""


def agents(tmp: Path, names: list[str], script_args: list[str], *, port: int, run_id: str,
           sleep: float = 1.0, nnodes: str = "1:2", max_restarts: int = 3, extra_env: dict | None = None,
           node: Path = NODE) -> list[tuple[subprocess.Popen, Path]]:
    """One torchrun agent per name (the first hosts the rendezvous store), each in its own session, its
    output in tmp/<name>.log."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "WORLD_SIZE", "RANK", "LOCAL_"))}
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: see examples/elastic.py (restarted workers would read the dead
    # attempt's gloo addresses from the agent's shared store).
    env.update(PYTHONUNBUFFERED="1", ELASTIC_STEP_SLEEP=str(sleep), OMP_NUM_THREADS="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **(extra_env or {}))
    started = []
    for i, name in enumerate(names):
        log = tmp / f"{name}.log"
        cmd = [str(TORCHRUN), f"--nnodes={nnodes}", "--nproc-per-node=2", f"--max-restarts={max_restarts}",
               "--monitor-interval=0.5", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               f"--rdzv-id={run_id}", f"--rdzv-conf=is_host={int(i == 0)},{RDZV_CONF}", str(node), *script_args]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, env={**env, "ELASTIC_NODE_NAME": name}, stdout=out,
                                    stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        started.append((proc, log))
    return started


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts each worker in its own session: killing the agent's
    process group alone leaves them running)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_node(proc: subprocess.Popen) -> float:
    """SIGKILL an agent's process group and every worker it started, as a node's death; returns the time."""
    below = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    killed = time.time()
    proc.wait()
    return killed


def wait_for(log: Path, pattern: str, proc: subprocess.Popen, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text())
        if found:
            return found
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} in {log.name} (agent exit {proc.poll()}):\n{log.read_text()[-6000:]}")


def reports(report: Path) -> dict[int, dict]:
    return {int(p.name.split(".")[-2]): json.loads(p.read_text()) for p in report.parent.glob(f"{report.name}.*.json")
            if p.name.split(".")[-2].isdigit()}


STEPS = 8
KILL_AFTER = 3


@pytest.mark.slow
def test_torchrun_agent_restarts_the_survivors_which_resume_resharded_from_the_local_tier(tmp_path):
    report = tmp_path / "report"
    args = ["--root", str(tmp_path / "durable"), "--local-tier", str(tmp_path / "tier_{node}"), "--steps", str(STEPS),
            "--persist-every", "100", "--report", str(report)]
    (a, a_log), (b, b_log) = agents(tmp_path, ["a", "b"], args, port=free_port(), run_id=f"t{os.getpid()}")
    try:
        saved = wait_for(a_log, rf"SAVED node=a step=({KILL_AFTER}) world=4", a, timeout=240)
        killed = kill_node(b)
        a.wait(timeout=300)
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                kill_node(proc)
    log = a_log.read_text()
    assert a.returncode == 0, log[-8000:]
    saved_step = int(saved.group(1))
    # The survivor's newest start: world size 2, resumed from the local tier resharded from 4 ranks.
    runs = reports(report)
    restart = max(runs)
    assert restart >= 1, runs
    first = runs[restart]
    load = first["last_load"]
    assert first["world_size"] == 2 and load is not None, (runs, log[-8000:])
    assert load["tier"] == "local" and load["resharded_from"] == 4, load
    assert saved_step <= load["step"] <= saved_step + 1 and 0 <= load["steps_lost"] <= 1, load  # saves every step
    assert "resharded from 4 to 2 ranks" in log
    assert first["first_step"] == load["step"] + 1
    # The recovery's timeline as last_load keeps it ([Note: a recovery's timeline]): the parts add up, the
    # restart is torch elastic's first, and the restart part spans the kill (the newest save came before it).
    assert load["restarts"] == restart
    timeline = [load["restart_s"], load["startup_s"], load["seconds"], load["first_step_s"]]
    assert all(part is not None and part > 0 for part in timeline), load
    assert first["failure_to_step_s"] == pytest.approx(sum(timeline))
    assert load["ended_at"] - load["seconds"] - load["startup_s"] == pytest.approx(first["process_started"], abs=0.05)
    assert json.loads((report.parent / f"report.{restart}.end.json").read_text())["final_step"] == STEPS
    assert re.search(rf"SAVED node=a step={STEPS - 1} world=2", log), log[-8000:]
    first["killed"] = killed
    recovered = first["first_step_done"] - killed
    (tmp_path / "recovery.json").write_text(json.dumps({"kill_to_first_step_s": recovered,
                                                        "worker_start_to_first_step_s":
                                                            first["first_step_done"] - first["process_started"],
                                                        **load}))
    print(f"kill -> first completed step: {recovered:.1f} s (worker start -> first step"
          f" {first['first_step_done'] - first['process_started']:.1f} s); last_load: {load}")
