"""Every collective the engine issues gets tensors on its process group's device.

On a CPU machine every tensor is on the CPU, so equality alone proves nothing. The audit
(``engine_cases.run_device_audit``) therefore trains with torch's default device set to
``meta``: a tensor the engine creates without naming a device (``torch.tensor(flags)``,
``torch.zeros(())`` as a fallback) lands on ``meta`` and is caught at the collective (or breaks
the arithmetic), exactly the tensors that would be on the wrong device under NCCL.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from _dist import run_distributed
from engine_cases import Case, run_device_audit, run_reference

from lightning_zero.engine import collectives as comm

WORLD_SIZE = 2


@functools.cache
def audit(stage: int) -> list[dict[str, Any]]:
    return run_distributed(run_device_audit, WORLD_SIZE, stage, start_method="forkserver")


@pytest.mark.parametrize("stage", [1, 2])
def test_no_collective_receives_a_tensor_off_its_group_device(stage: int) -> None:
    for rank, result in enumerate(audit(stage)):
        assert result["violations"] == [], f"rank {rank}: {result['violations']}"
        assert result["devices"] == ["cpu"]


@pytest.mark.parametrize("stage", [1, 2])
def test_engine_without_parameters_takes_its_device_from_the_group(stage: int) -> None:
    assert all(r["fallback_device"] == "cpu" for r in audit(stage))


@pytest.mark.parametrize("stage", [1, 2])
def test_audited_training_still_matches_pytorch(stage: int) -> None:
    # Guards the audit against a run that trained nothing (the meta default is only a trap).
    expected = run_reference(WORLD_SIZE, Case(optimizer="sgd", steps=3, clip_norm=0.05))
    for result in audit(stage):
        for fqn, value in expected.items():
            torch.testing.assert_close(result["params"][fqn], value, atol=1e-6, rtol=1e-5)


def test_gloo_group_serves_the_cpu_and_emulates_reduce_scatter(single_rank_group: None) -> None:
    assert comm.group_device(None) == torch.device("cpu")
    assert not comm.has_native_reduce_scatter(None)
