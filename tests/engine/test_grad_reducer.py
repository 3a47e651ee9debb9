"""The reducer's place in a backward is one ``ReduceState``, and a bucket is whole once constructed.

One gloo rank in this process: the states and the construction do not depend on the world size
(the multi-rank reductions are pinned by test_engine.py and test_hybrid.py).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_zero import ZeroConfig, ZeroEngine
from lightning_zero.engine.grad_bucket import GradBucket, PresenceCounts
from lightning_zero.engine.grad_reducer import ReduceState
from lightning_zero.engine.sharding import HybridLayout


def _engine(stage: int) -> tuple[nn.Linear, ZeroEngine]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return model, ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig(stage=stage))


def test_reducer_goes_idle_backward_flushed_idle_over_one_backward(single_rank_group: None) -> None:
    model, engine = _engine(stage=2)
    try:
        during: list[ReduceState] = []
        # Registered after the engine's hook, so it runs after it: the reducer is mid-backward.
        model.bias.register_post_accumulate_grad_hook(lambda _: during.append(engine.reducer.state))
        assert engine.reducer.state is ReduceState.IDLE
        model(torch.randn(2, 4)).sum().backward()
        assert during == [ReduceState.BACKWARD]
        assert engine.reducer.state is ReduceState.FLUSHED  # the queued flush ran at the end of backward
        engine.ensure_flushed()
        assert engine.reducer.state is ReduceState.IDLE
        engine.reducer.resolve_presence()
        assert all(sp.master.grad is not None for sp in engine.sharded_params.values())
    finally:
        engine.close()


def test_a_backward_without_hooks_here_is_flushed_by_ensure_flushed(single_rank_group: None) -> None:
    model, engine = _engine(stage=2)
    try:
        torch.randn(2, requires_grad=True).sum().backward()  # no parameter of the model took part
        assert engine.reducer.state is ReduceState.IDLE
        engine.ensure_flushed()  # the other ranks' collectives would be matched here
        assert engine.reducer.state is ReduceState.IDLE
        engine.reducer.resolve_presence()
        assert all(sp.master.grad is None and not sp.has_grad for sp in engine.sharded_params.values())
    finally:
        engine.close()


def test_no_sync_on_stage_1_leaves_the_state_alone(single_rank_group: None) -> None:
    model, engine = _engine(stage=1)
    try:
        with engine.no_sync():
            model(torch.randn(2, 4)).sum().backward()
            assert engine.reducer.state is ReduceState.IDLE
            engine.ensure_flushed()
        assert engine.reducer.state is ReduceState.IDLE
        assert model.weight.grad is not None  # accumulated locally, not reduced
    finally:
        engine.close()


def test_bucket_holds_its_hybrid_place_and_presence_counts_from_construction() -> None:
    params = [("a", nn.Parameter(torch.ones(5))), ("b", nn.Parameter(torch.ones(3)))]
    presence = PresenceCounts(p.device for _, p in params)
    bucket = GradBucket(0, params, HybridLayout(world_size=4, shard_group_size=2), rank=3, presence=presence)
    assert (bucket.shard_size, bucket.rank) == (2, 1)  # the shard group's size and place
    assert (bucket.replicas, bucket.replica_rank, bucket.average_over) == (2, 1, 4)
    assert bucket.communicates
    bucket.present_count.add_(torch.tensor([2.0, 0.0]))
    presence.mark_reduced()
    presence.resolve()
    assert [sp.has_grad for sp in bucket.params] == [True, False]
    frozen = GradBucket(1, params, HybridLayout(world_size=4, shard_group_size=2), rank=3)
    assert not frozen.communicates and frozen.present_count.tolist() == [0.0, 0.0]
