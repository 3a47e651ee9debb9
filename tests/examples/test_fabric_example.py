"""examples/fabric_gpt.py as its docstring runs it (``python examples/fabric_gpt.py``, Fabric starting 2 CPU
processes, bf16-true where the CPU has it): SIGKILL of the whole job after its first committed save, then the
same command resumes from the newest committed checkpoint and ends with the weights of an uninterrupted run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS, EVERY = 24, 4


def start(directory: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with open(log, "wb") as out:
        # Its own session: Fabric's launcher starts rank 1 as a child, and the kill takes both.
        return subprocess.Popen(
            [sys.executable, "examples/fabric_gpt.py", "--out-dir", str(directory), "--max-steps", str(STEPS),
             "--save-every", str(EVERY)],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )


def committed_steps(directory: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in directory.glob("step-*.ckpt") if (m := re.match(r"step-(\d+)", p.name)))


def checksum(log: Path) -> str:
    found = re.search(r"\[fabric_gpt\] finished at step (\d+): \d+ tokens, weights checksum (\S+)", log.read_text())
    assert found, log.read_text()[-3000:]
    assert int(found.group(1)) == STEPS
    return found.group(2)


@pytest.mark.slow
def test_killed_example_resumes_from_its_newest_committed_save_and_ends_as_an_uninterrupted_run(
        tmp_path: Path) -> None:
    uninterrupted = start(tmp_path / "whole", tmp_path / "whole.log")
    assert uninterrupted.wait(timeout=600) == 0, (tmp_path / "whole.log").read_text()[-4000:]

    directory = tmp_path / "killed"
    first = start(directory, tmp_path / "first.log")
    deadline = time.monotonic() + 300
    while not committed_steps(directory):
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint committed in 300 s"
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    time.sleep(0.5)  # the killed ranks' files are closed by now
    saved = committed_steps(directory)
    assert saved and saved[-1] < STEPS, f"the job was not killed before it finished: {saved}"

    second = start(directory, tmp_path / "second.log")
    assert second.wait(timeout=600) == 0, (tmp_path / "second.log").read_text()[-4000:]
    output = (tmp_path / "second.log").read_text()
    assert f"[fabric_gpt] resumed from {directory}/step-{saved[-1]:06d}.ckpt at step {saved[-1]} on 2 processes" \
        in output
    assert "tokens/s" in output
    # Resume is exact: the masters, the optimizer state and the step came back, and a step's batch and
    # learning rate depend on the step only.
    assert checksum(tmp_path / "second.log") == checksum(tmp_path / "whole.log")
    assert committed_steps(directory) == [STEPS - EVERY, STEPS]
