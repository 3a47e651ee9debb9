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


# ---- checkpoints of hybrid engines ----------------------------------------------------------


def save_hybrid(rank: int, world_size: int, root: str, shard_group_size: int | None,
                modes: tuple[str, ...] = ("sharded", "full", "local"), steps: int = 3) -> dict[str, Any]:
    """Train at this layout, save ``<root>/<mode>.ckpt`` in each mode; the full state and, per mode,
    the bytes this rank wrote."""
    from checkpoint_cases import build, gather_full_state, train

    from lightning_zero.checkpoint import engine_tree, last_save_stats, save

    model, engine = build(rank, world_size, shard_group_size=shard_group_size)
    train(model, engine, range(steps), rank, world_size)
    written = {}
    for mode in modes:
        save(engine_tree.zero_state_dict(engine, model), f"{root}/{mode}.ckpt", mode=mode)
        stats = last_save_stats()
        written[mode] = stats.bytes_written if stats is not None else None
    full = gather_full_state(engine)
    engine.close()
    return {"full": full, "written": written}


def load_hybrid(rank: int, world_size: int, paths: list[str], state_names: list[str],
                shard_group_size: int | None, extra_steps: int = 2) -> dict[str, Any]:
    """For each path: load into a fresh engine of this layout; what it holds (or the error's text)."""
    from checkpoint_cases import load_and_gather

    return load_and_gather(rank, world_size, paths, state_names, extra_steps, shard_group_size)


def save_and_load_by_group(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """2 x 2 hybrid: shard group 1 (ranks 2, 3) alone saves, coordinated by rank 3, over its own gloo
    group (SageMaker's ``process_group``/``coordinator_rank``); then every rank loads the sharded copy
    over the whole world, and each shard group loads the local copy over its own group."""
    import torch.distributed as dist
    from checkpoint_cases import build, gather_full_state, train

    from lightning_zero.checkpoint import async_save, engine_tree, load, maybe_finalize_async_calls

    groups = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
    mine = groups[rank // 2]
    model, engine = build(rank, world_size, shard_group_size=2)
    train(model, engine, range(3), rank, world_size)
    expected = gather_full_state(engine)
    errors: dict[str, str] = {}
    for name, kwargs in {"coordinator-outside": {"process_group": mine, "coordinator_rank": (rank + 2) % 4},
                         "full-with-group": {"process_group": mine, "mode": "full"}}.items():
        try:
            async_save(engine_tree.zero_state_dict(engine, model), f"{root}/never-{name}.ckpt", **kwargs)
        except ValueError as exc:
            errors[name] = str(exc)
    if rank >= 2:
        for mode in ("sharded", "local"):
            async_save(engine_tree.zero_state_dict(engine, model), f"{root}/{mode}.ckpt", mode=mode,
                       process_group=mine, coordinator_rank=3)
            maybe_finalize_async_calls(blocking=True, process_group=mine, coordinator_rank=3)
    dist.barrier()
    engine.close()
    loaded = {}
    for mode, kwargs in {"sharded": {}, "local": {"process_group": mine}}.items():
        fresh_model, fresh = build(rank, world_size, perturb=1.0, shard_group_size=2)
        engine_tree.materialize_optimizer_state(fresh.optimizers[0], set(expected["state"]))
        content = load(engine_tree.zero_state_dict(fresh, fresh_model, for_load=True), f"{root}/{mode}.ckpt",
                       **kwargs)
        engine_tree.apply_param_groups(fresh.optimizers[0], content["optimizer"][0]["param_groups"])
        fresh.publish_masters()
        loaded[mode] = gather_full_state(fresh)
        fresh.close()
    return {"expected": expected, "loaded": loaded, "errors": errors}
