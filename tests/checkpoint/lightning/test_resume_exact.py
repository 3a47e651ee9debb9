"""A resumed run equals the uninterrupted one bit for bit, in every mode and precision: every
checkpoint holds the exact fp32 masters, not only the (rounded) low-precision weights."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from _dist import run_distributed
from lifecycle_cases import STEPS, fit_steps

pytestmark = pytest.mark.slow


@functools.cache
def uninterrupted(precision: str) -> dict[str, torch.Tensor]:
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        return run_distributed(fit_steps, 2, root, "sharded", precision, STEPS, start_method="forkserver")[0]


@pytest.mark.parametrize("precision", ["bf16-true", "32-true"])
@pytest.mark.parametrize("mode", ["local", "sharded", "full"])
def test_resumed_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path: Path, mode: str, precision: str) -> None:
    run_distributed(fit_steps, 2, str(tmp_path), mode, precision, 2, None, True, start_method="forkserver")
    path = str(tmp_path / "ckpts" / "epoch=0-step=2.ckpt")
    resumed = run_distributed(fit_steps, 2, str(tmp_path / "resume"), mode, precision, STEPS, path,
                              start_method="forkserver")[0]
    expected = uninterrupted(precision)
    assert resumed.keys() == expected.keys()
    for name, value in expected.items():
        assert resumed[name].dtype == value.dtype
        assert torch.equal(resumed[name], value), f"{mode}/{precision}: {name} differs"
