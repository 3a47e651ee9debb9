"""A bucket of many parameters packs its gradients and copies its gathered parameters back in grouped foreach copies
([Note: one copy a bucket] in engine/grad_bucket.py): blocks with and without padding, a gradient missing on one
rank, more parameters than one copy takes. Training must match plain PyTorch."""

from __future__ import annotations

import pytest
import torch
from _dist import run_distributed
from engine_cases import many_params_reference, run_many_params

STEPS = 4


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_bucket_of_many_parameters_trains_as_plain_pytorch(world_size: int) -> None:
    results = run_distributed(run_many_params, world_size, STEPS, start_method="forkserver")
    expected = many_params_reference(world_size, STEPS)
    for params in results:
        assert params.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_gradients_of_a_backward_that_keeps_its_graph_are_packed_by_value() -> None:
    """``backward(create_graph=True)`` gives gradients with a history; the buckets take their values (an in-place
    copy of them into a split of the buffer once raised inside the gradient hook)."""
    results = run_distributed(run_many_params, 2, 2, True, start_method="forkserver")
    expected = many_params_reference(2, 2, skip=False)
    for params in results:
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)
