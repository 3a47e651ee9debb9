"""The whole job is SIGKILLed in the middle of a save (killed_job.py): the partial checkpoint is
never taken for a good one, ``ckpt_path="last"`` resumes from the newest complete checkpoint even
though no ``last*`` file survived, and the next successful save of that name removes the leftovers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_cases import assert_same_weights, fit, make_trainer
from lightning_cases import NetModule

from lightning_zero.checkpoint import (
    CheckpointNotFoundError,
    CheckpointSaveError,
    read_lightning_checkpoint,
    remove_incomplete,
)
from lightning_zero.checkpoint.store import storage

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def kill_a_job_mid_save(mode: str, dirpath: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), str(HERE)])}
    done = subprocess.run([sys.executable, str(HERE / "killed_job.py"), mode, str(dirpath)], env=env,
                          capture_output=True, text=True, timeout=300, start_new_session=True)
    assert done.returncode == -signal.SIGKILL, f"the job was not killed mid-save:\n{done.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["local", "sharded", "full"])
def test_a_job_killed_mid_save_resumes_from_the_newest_complete_checkpoint(tmp_path: Path, mode: str,
                                                                          uninterrupted: dict[str, Any]) -> None:
    ckpts = tmp_path / "ckpts"
    kill_a_job_mid_save(mode, ckpts)
    # The first epoch's checkpoint committed; the first last.ckpt was being written when all died.
    names = sorted(os.listdir(ckpts))
    assert "epoch=0-step=2.ckpt" in names and "last.ckpt" not in names, names
    if mode == "full":
        leftovers = [n for n in names if n.startswith("last.ckpt.tmp-")]
    else:
        leftovers = [str(p) for p in (ckpts / "_zero_data" / "last.ckpt").rglob("*") if p.is_file()]
    assert leftovers, "the kill came before any data of last.ckpt was written"
    # The partial save is not a checkpoint: loading its path says so.
    with pytest.raises((CheckpointNotFoundError, CheckpointSaveError), match=r"No checkpoint at .*last\.ckpt"):
        storage.read_marker(storage.resolve(str(ckpts / "last.ckpt")))
    # "last" resumes from epoch=0-step=2 (Lightning alone would start from step 0): a perturbed fresh
    # module ends equal to the uninterrupted run only if that checkpoint was really loaded.
    resumed = fit(make_trainer(mode, ckpts, 2), ckpt_path="last", perturb=True)
    assert_same_weights(resumed, uninterrupted, 'ckpt_path="last" after the kill')
    # The resumed run saved last.ckpt: the dead save's leftovers are gone.
    names = sorted(os.listdir(ckpts))
    assert "last.ckpt" in names and not [n for n in names if ".tmp-" in n], names
    if mode != "full":
        marker = storage.read_marker(storage.resolve(str(ckpts / "last.ckpt")))
        assert marker is not None
        (version,) = (ckpts / "_zero_data" / "last.ckpt").iterdir()
        assert marker["data"].endswith(version.name)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sharded", "full"])
def test_remove_incomplete_deletes_a_killed_saves_leftovers_and_keeps_every_committed_checkpoint(
        tmp_path: Path, mode: str) -> None:
    ckpts = tmp_path / "ckpts"
    kill_a_job_mid_save(mode, ckpts)
    committed = {p.name: p.read_bytes() for p in ckpts.iterdir() if p.is_file() and ".tmp-" not in p.name}
    removed = remove_incomplete(str(ckpts))
    assert removed, "nothing of the killed save was found"
    assert all("last.ckpt" in path for path in removed), removed
    assert {p.name: p.read_bytes() for p in ckpts.iterdir() if p.is_file()} == committed
    assert not (ckpts / "_zero_data" / "last.ckpt").exists()
    content = read_lightning_checkpoint(str(ckpts / "epoch=0-step=2.ckpt"))
    assert content["global_step"] == 2
    assert remove_incomplete(str(ckpts)) == []


@pytest.mark.slow
def test_a_weights_only_save_killed_mid_write_leaves_the_previous_file_of_that_name_intact(tmp_path: Path) -> None:
    """The plain file of a weights-only save is committed as a full file is: written under a temporary name
    and renamed. The second write of ``weights.ckpt`` dies half-way (the whole job SIGKILLed); the first is
    there, whole, for any reader."""
    ckpts = tmp_path / "ckpts"
    kill_a_job_mid_save("weights", ckpts)
    names = sorted(os.listdir(ckpts))
    assert "weights.ckpt" in names and [n for n in names if n.startswith("weights.ckpt.tmp-")], names
    content = torch.load(ckpts / "weights.ckpt", weights_only=True)
    assert content["global_step"] == 2  # epoch 0's save; epoch 1's was the one killed
    assert set(content["state_dict"]) == set(NetModule().state_dict())
