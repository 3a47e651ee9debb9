"""examples/torchrun_loop.py under torchrun: SIGKILL of the whole job after its first committed save,
then the same command resumes from the newest committed checkpoint and runs to the end."""

from __future__ import annotations

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
STEPS, EVERY = 120, 10


def torchrun(directory: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
             "--master_port", str(free_port()), "examples/torchrun_loop.py", "--dir", str(directory),
             "--steps", str(STEPS), "--save-every", str(EVERY)],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
        )


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def committed_steps(directory: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in directory.glob("step-*.ckpt") if (m := re.match(r"step-(\d+)", p.name)))


@pytest.mark.slow
def test_killed_loop_resumes_from_its_newest_committed_save_and_finishes(tmp_path: Path) -> None:
    directory = tmp_path / "loop"
    first = torchrun(directory, tmp_path / "first.log")
    deadline = time.monotonic() + 300
    while not committed_steps(directory):
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint committed in 300 s"
        time.sleep(0.05)
    # The whole job at once: torchrun's workers run in their own sessions, so each is killed by pid.
    for pid in [*children(first.pid), first.pid]:
        os.kill(pid, signal.SIGKILL)
    first.wait(timeout=60)
    time.sleep(0.5)  # the killed workers' files are closed by now
    saved = committed_steps(directory)
    assert saved and saved[-1] < STEPS, f"the job was not killed before it finished: {saved}"

    second = torchrun(directory, tmp_path / "second.log")
    assert second.wait(timeout=600) == 0, (tmp_path / "second.log").read_text()[-4000:]
    output = (tmp_path / "second.log").read_text()
    assert f"[loop] resumed from {directory}/step-{saved[-1]:06d}.ckpt at step {saved[-1]} on 2 processes" in output
    assert f"[loop] finished at step {STEPS}" in output
    # Keep-last-2, and nothing left of the save the kill interrupted.
    assert committed_steps(directory) == [STEPS - EVERY, STEPS]
    assert sorted(p.name for p in (directory / "_zero_data").iterdir()) == [
        f"step-{s:06d}.ckpt" for s in (STEPS - EVERY, STEPS)]
