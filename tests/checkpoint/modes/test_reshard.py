"""``sharded`` checkpoints load at another world size: 3 -> 2, 2 -> 3 and 2 -> 1 ranks.

The reference is the full state (master weights, exp_avg, exp_avg_sq, step, lr) rebuilt
from the saving ranks' shards with all_gather_object (``checkpoint_cases.gather_full_state``),
compared with the same reconstruction on the loading ranks. Training trajectories at different
world sizes legitimately differ (the Net has a per-slice branch), so the continuation is
compared with a load of a ``full`` checkpoint of the same state at the same new world size.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_distributed
from checkpoint_cases import assert_same_state, load_and_gather, save_and_gather

from lightning_zero.engine.sharding import EvenShard

Saved = tuple[Path, dict[str, Any]]


@pytest.fixture(scope="module")
def saved_at(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Saved]:
    """``sharded.ckpt`` and ``full.ckpt`` of 3 AdamW steps at a world size, with the full state."""
    made: dict[int, Saved] = {}

    def at(world_size: int) -> Saved:
        if world_size not in made:
            root = tmp_path_factory.mktemp(f"saved_at_{world_size}")
            full = run_distributed(save_and_gather, world_size, str(root), start_method="forkserver")
            for rank in range(1, world_size):
                assert_same_state(full[rank], full[0], f"rank {rank} gathered another state than rank 0")
            made[world_size] = (root, full[0])
        return made[world_size]

    return at


@pytest.mark.parametrize(("saved_ws", "loaded_ws"), [(3, 2), (2, 3), (2, 1)], ids=["3to2", "2to3", "2to1"])
def test_sharded_checkpoint_reshards_master_weights_and_optimizer_state(
        saved_at: Callable[[int], Saved], saved_ws: int, loaded_ws: int) -> None:
    root, saved = saved_at(saved_ws)
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(saved["state"]["hidden.weight"])
    sharded, full = str(root / "sharded.ckpt"), str(root / "full.ckpt")
    results = run_distributed(load_and_gather, loaded_ws, [sharded, full], sorted(saved["state"]),
                              start_method="forkserver")
    numels = {fqn: value.numel() for fqn, value in saved["master"].items()}
    for rank, result in enumerate(results):
        where = f"{saved_ws}->{loaded_ws} ranks, rank {rank}"
        # Each rank holds the even shard of the *new* world size, and the shards add up to
        # exactly the saved tensors.
        assert result[sharded]["shard_numel"] == sum(EvenShard(n, loaded_ws).shard_numel(rank) for n in numels.values())
        assert_same_state(result[sharded]["loaded"], saved, where)
        for fqn, value in saved["master"].items():
            assert torch.equal(result[sharded]["params"][fqn], value), f"{where}: model weight {fqn}"
        # The resharded state trains on exactly like the same state from a full checkpoint.
        for fqn, value in result[full]["after_steps"].items():
            assert torch.equal(result[sharded]["after_steps"][fqn], value), f"{where}: {fqn} after 2 more steps"
        assert any(not torch.equal(result[sharded]["after_steps"][f], saved["master"][f]) for f in numels)
