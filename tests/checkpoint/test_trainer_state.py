"""The trainer-state blob (checkpoint/trainer_state.py): loaded on CPU, never unpickling arbitrary objects."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_cases import build, train

from lightning_zero.checkpoint import (
    CheckpointCorruptError,
    convert,
    load_zero_state_dict,
    save,
    zero_state_dict,
)
from lightning_zero.checkpoint.trainer_state import read_trainer_state, trainer_state_blob


class RunsCode:
    """A pickle that creates a file when unpickled: proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.marker, "w"))




@pytest.mark.parametrize("mode", ["local", "sharded"])
def test_a_crafted_trainer_state_never_runs_and_says_the_file_is_refused(one_rank: None, tmp_path: Path,
                                                                         mode: str) -> None:
    proof = tmp_path / "code-ran"
    model, engine = build(0, 1)
    train(model, engine, range(1), 0, 1)
    tree = zero_state_dict(engine, model)
    tree["trainer"] = trainer_state_blob({"epoch": 0, "hyper_parameters": {"evil": RunsCode(str(proof))}})
    path = str(tmp_path / f"{mode}.ckpt")
    save(tree, path, mode=mode)
    fresh_model, fresh = build(0, 1, perturb=1.0)
    # The name pickle gives `open` is the interpreter's (io.open up to Python 3.11, _io.open from 3.12).
    opener = re.escape(f"{open.__module__}.{open.__qualname__}")
    with pytest.raises(CheckpointCorruptError, match=rf"trainer state .* holds {opener}.*weights_only=True"):
        load_zero_state_dict(fresh, fresh_model, path)
    with pytest.raises(CheckpointCorruptError, match=r"weights_only=True"):
        convert(path, str(tmp_path / "out.ckpt"))
    assert not proof.exists(), "the crafted pickle ran"


def test_trainer_state_loads_on_cpu() -> None:
    blob = trainer_state_blob({"callbacks": {"ModelCheckpoint": {"best_model_score": torch.tensor(0.5)}}})
    state = read_trainer_state(blob, "x")
    assert state["callbacks"]["ModelCheckpoint"]["best_model_score"].device.type == "cpu"
