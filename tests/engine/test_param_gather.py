"""The parameter all-gather after the step overlaps the next forward and is exact.

Two engines over the same model train side by side on 2 gloo ranks, one with
``overlap_param_gather`` and one without; every read through the module (an attribute, an
evaluation forward, ``state_dict``, ``finish_param_gather``) must see bit-identical weights, and
training must match plain PyTorch. Rank 1 skips a layer in odd steps, so the ranks' forwards wait
for different buckets.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from _dist import run_distributed
from engine_cases import (
    deep_early_exit_reference,
    deep_reference,
    run_collective_mid_step,
    run_gather_overlap,
)

WORLD_SIZE = 2
STEPS = 4


@functools.cache
def results() -> list[dict[str, Any]]:
    return run_distributed(run_gather_overlap, WORLD_SIZE, STEPS, start_method="forkserver")


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_gathers_are_still_pending_when_step_returns(rank: int) -> None:
    result = results()[rank]
    assert result["pending_after_step"]


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_reading_one_layer_waits_for_its_buckets_only(rank: int) -> None:
    result = results()[rank]
    assert result["first_layer_exact"]
    assert result["pending_after_first_layer"], "reading layer 0 finished the later layers' gathers too"


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
@pytest.mark.parametrize("read", ["eval", "state_dict", "finish"])
def test_every_read_sees_the_weights_of_a_non_overlapped_engine(rank: int, read: str) -> None:
    assert results()[rank][f"{read}_exact"]


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_state_dict_finishes_a_pending_gather(rank: int) -> None:
    assert results()[rank]["pending_before_state_dict"]


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_building_a_checkpoint_tree_leaves_the_gathers_in_flight(rank: int) -> None:
    assert results()[rank]["pending_after_checkpoint_tree"]


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_overlapped_training_is_bit_identical_to_gathering_in_the_step(rank: int) -> None:
    assert results()[rank]["bit_identical"]


def test_overlapped_training_matches_single_process_pytorch() -> None:
    expected = deep_reference(WORLD_SIZE, STEPS + 2)
    for rank, result in enumerate(results()):
        for fqn, value in expected.items():
            torch.testing.assert_close(result["params"][fqn], value, atol=1e-6, rtol=1e-5,
                                       msg=lambda m, r=rank, f=fqn: f"rank {r}, {f}: {m}")


@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_gathers_in_flight_never_exceed_the_bound(rank: int) -> None:
    result = results()[rank]
    assert result["buckets"] > 2 * result["max_in_flight_allowed"], "the model must queue gathers"
    assert result["in_flight"], "no gather was launched"
    assert max(result["in_flight"]) <= result["max_in_flight_allowed"]


@functools.cache
def mid_step_results() -> list[dict[str, Any]]:
    return run_distributed(run_collective_mid_step, WORLD_SIZE, STEPS, start_method="forkserver")


def test_collective_between_forward_and_backward_with_ranks_reading_different_layers_completes() -> None:
    # Rank 1 reads only three layers in odd steps, then every rank all-reduces on the default
    # group. Gathers launched by reads would hang here (rank 0 waiting in its forward for a gather
    # rank 1 never launched, rank 1 in the all-reduce); sharing the default group with the gathers
    # aborts gloo. The gathers' own program on their own group completes, and training is exact.
    expected, losses = deep_early_exit_reference(WORLD_SIZE, STEPS)
    results = mid_step_results()
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["losses"], losses, atol=1e-6, rtol=1e-6)
        for fqn, value in expected.items():
            torch.testing.assert_close(result["params"][fqn], value, atol=1e-6, rtol=1e-5,
                                       msg=lambda m, r=rank, f=fqn: f"rank {r}, {f}: {m}")


def test_a_checkpoint_tree_holds_the_module_parameters_of_the_moment(single_rank_group: None) -> None:
    """The tree takes the module's parameters without waiting for gathers, but at each save: a
    parameter no optimizer holds that is replaced after setup is saved as it is now, and tied
    weights appear once, as in ``named_parameters()``."""
    from torch import nn

    from lightning_zero.checkpoint.engine_tree import zero_state_dict
    from lightning_zero.engine import ZeroConfig, ZeroEngine

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    model[2].weight = model[0].weight  # tied
    model[1].requires_grad_(False)
    engine = ZeroEngine(model, [torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)],
                        ZeroConfig(stage=2))
    try:
        model[1].weight = nn.Parameter(torch.full((4, 4), 7.0), requires_grad=False)
        tree = zero_state_dict(engine, model, meta={})
        assert [name for name, _ in engine.named_parameters()] == [name for name, _ in model.named_parameters()]
        assert torch.equal(tree["model"]["1.weight"], torch.full((4, 4), 7.0))
        assert "2.weight" not in tree["model"]
    finally:
        engine.close()


def test_a_peer_that_stops_answering_fails_the_next_read_after_the_bound_not_never() -> None:
    from engine_cases import run_gather_peer_stops_answering

    wait_seconds = 2.0
    first, _ = run_distributed(run_gather_peer_stops_answering, 2, wait_seconds, start_method="forkserver")
    assert first["error"] is not None, "the read returned although rank 1 never sent its rows"
    assert "parameter all-gather failed" in first["error"] and "no answer within the process group timeout (0:00:02)" in first["error"], first
    assert wait_seconds <= first["seconds"] < 3 * wait_seconds, first
