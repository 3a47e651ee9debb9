"""Hybrid sharding cases: 4 gloo ranks as shard groups of N, against plain single-process PyTorch."""

from __future__ import annotations

from typing import Any

import torch
from engine_cases import Case, initial_model, make_optimizer, run_zero

from lightning_zero import ZeroConfig, ZeroEngine


def run_hybrid_cases(rank: int, world_size: int, cases: dict[str, Case]) -> dict[str, Any]:
    """Every case in one process group, then what a bad ``shard_group_size`` raises on this rank."""
    results: dict[str, Any] = {name: run_zero(rank, world_size, case) for name, case in cases.items()}
    errors = {}
    for size in (3, world_size + 1):
        model = initial_model()
        try:
            ZeroEngine(model, [make_optimizer("sgd", model)], ZeroConfig(shard_group_size=size))
        except ValueError as exc:
            errors[size] = str(exc)
    results["errors"] = errors
    # The process group still works: a bad size raised before any collective.
    value = torch.ones(1)
    torch.distributed.all_reduce(value)
    results["after_error"] = float(value)
    return results
