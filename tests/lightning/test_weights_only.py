"""``weights_only`` as Lightning's entry points take it (``trainer.fit(..., ckpt_path=..., weights_only=...)``),
held to what DDP does with the same checkpoint: Lightning's own
``tests_pytorch/callbacks/test_callbacks.py::test_resume_callback_state_saved_by_type_stateful``.

None (Lightning's default) and True refuse a checkpoint whose non-tensor state holds an object (here a
callback keyed by its class), naming it and the way out; False, a caller who trusts the file, resumes it.
The same through ``lightning-zero convert --no-weights-only``; a crafted pickle never runs by default.
"""

from __future__ import annotations

import functools
import io
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_distributed
from client_cases import WEIGHTS_ONLY_RUNS, weights_only_resumes

from lightning_zero.checkpoint import CheckpointCorruptError, read_lightning_checkpoint

pytestmark = pytest.mark.slow
TESTS = Path(__file__).resolve().parents[1]  # the convert command unpickles client_cases from there


@functools.cache
def outcomes(root: str) -> list[dict[str, Any]]:
    return run_distributed(weights_only_resumes, 2, root, start_method="forkserver")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("weights-only"))


@pytest.mark.parametrize("run", [f"{s}-{m}" for s, m in WEIGHTS_ONLY_RUNS])
def test_weights_only_false_resumes_an_object_in_the_callback_state_as_under_ddp(root: str, run: str) -> None:
    for rank, result in enumerate(outcomes(root)):
        assert result[f"{run}-False"] == 111, f"rank {rank}: {result[f'{run}-False']}"


@pytest.mark.parametrize("run", [f"{s}-{m}" for s, m in WEIGHTS_ONLY_RUNS])
@pytest.mark.parametrize("weights_only", [None, True])
def test_the_default_and_true_refuse_it_as_under_ddp(root: str, run: str, weights_only: bool | None) -> None:
    for rank, result in enumerate(outcomes(root)):
        outcome = result[f"{run}-{weights_only}"]
        assert isinstance(outcome, str), f"rank {rank}: {run} resumed with weights_only={weights_only}"
        assert "TypeKeyedState" in outcome, outcome
        if not run.startswith("ddp"):  # ours names the way out (torch's own message under DDP)
            assert "weights_only=False" in outcome and "trust" in outcome, outcome


def test_convert_honours_no_weights_only(root: str, tmp_path: Path) -> None:
    outcomes(root)
    source = str(Path(root) / "weights-only-zero2-sharded.ckpt")
    with pytest.raises(CheckpointCorruptError, match="TypeKeyedState"):
        read_lightning_checkpoint(source)
    command = [sys.executable, "-m", "lightning_zero", "convert", source, str(tmp_path / "out.ckpt")]
    refused = subprocess.run(command, capture_output=True, text=True, cwd=TESTS)
    assert refused.returncode == 1 and "--no-weights-only" in refused.stderr, refused.stderr
    trusted = subprocess.run([*command, "--no-weights-only"], capture_output=True, text=True,
                             cwd=TESTS)
    assert trusted.returncode == 0, trusted.stderr
    content = torch.load(tmp_path / "out.ckpt", weights_only=False)
    assert [v for k, v in content["callbacks"].items() if "TypeKeyedState" in str(k)] == [{"state": 111}]


class _Crafted:
    def __reduce__(self) -> Any:
        return (exec, ("import pathlib; pathlib.Path('RAN').write_text('ran')",))


def test_a_crafted_pickle_in_a_full_file_never_runs_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "crafted.ckpt"
    buffer = io.BytesIO()
    torch.save({"state_dict": {}, "callbacks": {"x": _Crafted()}}, buffer)
    path.write_bytes(buffer.getvalue())
    with pytest.raises(CheckpointCorruptError, match="not unpickled"):
        read_lightning_checkpoint(str(path))
    assert not (tmp_path / "RAN").exists()
    assert pickle.dumps  # the module is used for the crafted object's protocol only
