"""Shape-aware optimizers through Fabric's front end (``Fabric(strategy="zero1"/"zero2")``): Muon for the matrices
with AdamW for the rest, and Adafactor, on 2 gloo ranks against one plain PyTorch process; and a ``fabric.save``
of a Muon+AdamW loop resumed by a fresh loop (``sharded``: the same world size bit for bit, 3 ranks against
PyTorch). The model (tests/shape_aware_cases.py) has matrices whose element counts divide by neither 2 nor 3,
an unused layer and a one-element parameter."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _dist import run_distributed
from fabric_cases import make_fabric
from shape_aware_cases import batch, initial_mixnet, make_optimizers, params, plain_train, reference

from lightning_zero.checkpoint import ZeroCheckpointIO

STEPS = 4
SAVE_AT = 2


def _loop(rank: int, world_size: int, stage: int, optimizer: str, plugins: list[Any] | None = None) -> tuple[Any, Any, list[Any]]:
    from lightning_zero.fabric import ZeroLowLevelStrategy

    fabric = make_fabric(rank, world_size, ZeroLowLevelStrategy(stage=stage, bucket_size_mb=0.0002), plugins=plugins)
    model = initial_mixnet()
    if rank != 0:  # setup gives every rank rank 0's weights
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    fmodel, *foptimizers = fabric.setup(model, *make_optimizers(optimizer, model))
    return fabric, fmodel, foptimizers


def _train(fabric: Any, model: Any, optimizers: list[Any], steps: range, rank: int, world_size: int) -> None:
    for step in steps:
        x, y = batch(step, world_size)
        fabric.backward(F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]))
        for optimizer in optimizers:
            optimizer.step()
        for optimizer in optimizers:
            optimizer.zero_grad()


def _fit(rank: int, world_size: int, stage: int, optimizer: str) -> dict[str, torch.Tensor]:
    fabric, model, optimizers = _loop(rank, world_size, stage, optimizer)
    _train(fabric, model, optimizers, range(STEPS), rank, world_size)
    fabric.strategy.teardown()
    return params(model.module)


def _save_and_continue(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    fabric, model, optimizers = _loop(rank, world_size, 2, "muon-adamw", [ZeroCheckpointIO(mode="sharded")])
    _train(fabric, model, optimizers, range(SAVE_AT), rank, world_size)
    fabric.save(path, {"model": model, "muon": optimizers[0], "adamw": optimizers[1]})
    _train(fabric, model, optimizers, range(SAVE_AT, STEPS), rank, world_size)
    fabric.strategy.teardown()  # Fabric never calls it: the save is finalized here
    return params(model.module)


def _load_and_continue(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    fabric, model, optimizers = _loop(rank, world_size, 2, "muon-adamw", [ZeroCheckpointIO(mode="sharded")])
    with torch.no_grad():  # what the load must overwrite
        for p in model.parameters():
            p.mul_(0.5)
    fabric.load(path, {"model": model, "muon": optimizers[0], "adamw": optimizers[1]})
    _train(fabric, model, optimizers, range(SAVE_AT, STEPS), rank, world_size)
    fabric.strategy.teardown()
    return params(model.module)


def _close(actual: dict[str, torch.Tensor], wanted: dict[str, torch.Tensor], where: str) -> None:
    assert actual.keys() == wanted.keys()
    for fqn, value in wanted.items():
        torch.testing.assert_close(actual[fqn], value, atol=1e-6, rtol=1e-5, msg=lambda m, f=fqn: f"{where} {f}: {m}")


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("optimizer", ["muon-adamw", "adafactor"])
def test_fabric_matches_one_pytorch_process(stage: int, optimizer: str) -> None:
    wanted = reference(optimizer, [2] * STEPS)
    for rank, got in enumerate(run_distributed(_fit, 2, stage, optimizer, start_method="forkserver")):
        _close(got, wanted, f"zero{stage} {optimizer} rank {rank}")


@pytest.mark.slow
def test_fabric_save_of_muon_resumes_exactly_and_reshards_to_three_ranks(tmp_path: Any) -> None:
    path = str(tmp_path / "muon.ckpt")
    uninterrupted = run_distributed(_save_and_continue, 2, path, start_method="forkserver")
    for rank, got in enumerate(run_distributed(_load_and_continue, 2, path, start_method="forkserver")):
        for fqn, value in uninterrupted[rank].items():
            assert torch.equal(got[fqn], value), f"rank {rank} {fqn}"
    model = initial_mixnet()
    wanted = plain_train(model, make_optimizers("muon-adamw", model), {s: 2 if s < SAVE_AT else 3 for s in range(STEPS)})
    for rank, got in enumerate(run_distributed(_load_and_continue, 3, path, start_method="forkserver")):
        _close(got, wanted, f"3 ranks, rank {rank}")
