"""Fabric(strategy="zero1"/"zero2"): a Fabric loop on N gloo ranks against one process of plain PyTorch.

Every case of a world size runs in one start of the ranks (``run_fabric_cases``): starting processes is the
slow part on 2 CPU cores. The loop is Fabric's own: ``fabric.setup``, ``fabric.backward``,
``fabric.no_backward_sync`` for accumulation, ``fabric.clip_gradients``, ``optimizer.step()``.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import pytest
import torch
from _dist import run_distributed
from fabric_cases import FabricCase, run_fabric_cases, run_reference
from lightning.fabric import Fabric

import lightning_zero  # noqa: F401  (registers the strategies)
from lightning_zero.fabric import ZeroLowLevelStrategy


def _both_stages(name: str, case: FabricCase) -> dict[str, FabricCase]:
    return {f"{name}-zero1": replace(case, strategy="zero1"), f"{name}-zero2": replace(case, strategy="zero2")}


EXACT_CASES: dict[str, FabricCase] = {
    # Two param groups (AdamW, different decay and lr), a StepLR scheduler, a tied weight, a frozen layer and
    # a layer never called (Net in engine_cases.py).
    **_both_stages("adamw", FabricCase()),
    **_both_stages("sgd-momentum", FabricCase(optimizer="sgd")),
    **_both_stages("accumulate", FabricCase(accumulate=3)),
    **_both_stages("clip-norm", FabricCase(clip_norm=0.05)),
    **_both_stages("clip-value", FabricCase(optimizer="sgd", clip_value=0.01)),
    **_both_stages("everything", FabricCase(accumulate=2, clip_norm=0.05, branch_on_rank0_only=True)),
    **_both_stages("setup-module-then-optimizers", FabricCase(setup="separate", accumulate=2, clip_norm=0.05)),
    **_both_stages("one-bucket", FabricCase(bucket_size_mb=None, accumulate=2)),
    # Hybrid sharding: optimizer state sharded within groups of one rank, replicated across them.
    **_both_stages("hybrid", FabricCase(shard_group_size=1, accumulate=2, clip_norm=0.05)),
    # fabric.setup(model, opt_a, opt_b): one engine shards both; each is clipped by its own global norm.
    **_both_stages("two-optimizers", FabricCase(optimizer="two-adamw", accumulate=2, clip_norm=0.05)),
}
DDP_CASES: dict[str, FabricCase] = {
    # Fabric's own DDP strategy on the same loop, for the ZeRO runs of the same name to match.
    "everything-ddp": FabricCase(strategy="ddp", accumulate=2, clip_norm=0.05, branch_on_rank0_only=True),
    "two-optimizers-ddp": FabricCase(strategy="ddp", optimizer="two-adamw", accumulate=2, clip_norm=0.05),
    # BatchNorm: statistics of each rank's slice, rank 0's running buffers broadcast before every forward.
    "batchnorm-ddp": FabricCase(strategy="ddp", model="batchnorm", accumulate=2),
    # Rank 0 alone in eval() (and sampling without gradients) from the second step on: no collective may
    # depend on a rank's own mode; the ranks keep broadcasting and reducing together, as under DDP.
    "rank0-eval-ddp": FabricCase(strategy="ddp", model="batchnorm", accumulate=2, rank0_eval=True),
}
# Per-slice batch statistics: equal to DDP, not to one process over the whole batch.
BATCHNORM_CASES = {**_both_stages("batchnorm", FabricCase(model="batchnorm", accumulate=2)),
                   **_both_stages("rank0-eval", FabricCase(model="batchnorm", accumulate=2, rank0_eval=True))}
LOW_PRECISION_CASES: dict[str, FabricCase] = {
    **_both_stages("bf16-true", FabricCase(precision="bf16-true", accumulate=2, clip_norm=0.05)),
    **_both_stages("bf16-mixed", FabricCase(precision="bf16-mixed", accumulate=2, clip_norm=0.05)),
    **_both_stages("16-mixed", FabricCase(precision="16-mixed", accumulate=2, clip_norm=0.05)),
}
CASES = {**EXACT_CASES, **LOW_PRECISION_CASES, **DDP_CASES, **BATCHNORM_CASES}


@functools.cache
def results(world_size: int) -> list[dict[str, dict[str, Any]]]:
    return run_distributed(run_fabric_cases, world_size, CASES, start_method="forkserver")


@functools.cache
def reference(name: str, world_size: int) -> dict[str, Any]:
    return run_reference(CASES[name], world_size)


def assert_params_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rank: int,
                        atol: float = 1e-6, rtol: float = 1e-5) -> None:
    assert actual.keys() == expected.keys()
    for fqn, value in expected.items():
        torch.testing.assert_close(actual[fqn].to(value.dtype), value, atol=atol, rtol=rtol,
                                   msg=lambda m, f=fqn: f"rank {rank}, {f}: {m}")


def test_strategy_names_are_registered_in_fabric() -> None:
    for name, stage in (("zero1", 1), ("zero2", 2), ("zero_low_level", 2)):
        fabric = Fabric(accelerator="cpu", devices=2, strategy=name)
        assert isinstance(fabric.strategy, ZeroLowLevelStrategy)
        assert fabric.strategy.stage == stage


def test_bad_stage_is_a_value_error_at_construction() -> None:
    with pytest.raises(ValueError, match="stage"):
        ZeroLowLevelStrategy(stage=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(EXACT_CASES))
def test_two_ranks_match_one_pytorch_process(name: str) -> None:
    expected = reference(name, 2)
    for rank, result in enumerate(results(2)):
        outcome = result[name]
        assert_params_close(outcome["params"], expected["params"], rank)
        assert outcome["params_are_masters"]
        assert outcome["master_dtypes"] == ["torch.float32"]


@pytest.mark.parametrize("ddp_name", list(DDP_CASES))
@pytest.mark.parametrize("stage", [1, 2])
def test_two_ranks_match_fabrics_ddp_strategy(ddp_name: str, stage: int) -> None:
    name = ddp_name.replace("-ddp", f"-zero{stage}")
    for rank, result in enumerate(results(2)):
        assert_params_close(result[name]["params"], result[ddp_name]["params"], rank)
        assert_params_close(result[name]["buffers"], result[ddp_name]["buffers"], rank)
        assert result[name]["norms"] == pytest.approx(result[ddp_name]["norms"], rel=1e-5)


def test_several_optimizers_share_one_engine() -> None:
    assert [result["two-optimizers-zero2"]["engines"] for result in results(2)] == [1, 1]


@pytest.mark.parametrize("name", [n for n, c in EXACT_CASES.items() if c.clip_norm is not None])
def test_clip_gradients_returns_the_global_norm(name: str) -> None:
    expected = reference(name, 2)["norms"]
    for result in results(2):
        assert result[name]["norms"] == pytest.approx(expected, rel=1e-5)


def test_each_rank_holds_about_half_of_the_optimizer_state() -> None:
    # Every parameter the optimizer holds, the frozen one too (its master is checkpointed).
    total = sum(p.numel() for p in _net().parameters())
    numels = [result["adamw-zero2"]["shard_numel"] for result in results(2)]
    assert sum(numels) == total
    assert max(numels) - min(numels) <= 13  # the padding: at most one element per parameter (13 tensors)


@pytest.mark.parametrize("name", list(LOW_PRECISION_CASES))
def test_low_precision_keeps_fp32_masters_and_follows_pytorch(name: str) -> None:
    case = CASES[name]
    expected = reference(name, 2)
    for rank, result in enumerate(results(2)):
        outcome = result[name]
        assert outcome["master_dtypes"] == ["torch.float32"]
        assert outcome["params_are_masters"], "the parameters must be the masters cast to their dtype"
        # bf16/fp16 arithmetic in forward and backward: close to fp32 PyTorch, not equal.
        assert_params_close(outcome["params"], expected["params"], rank, atol=3e-2, rtol=3e-2)
        # The norms clip_gradients returns are of the unscaled gradients (16-mixed: the scaler's factor is out).
        assert outcome["norms"] == pytest.approx(expected["norms"], rel=3e-2)
        if case.precision == "16-mixed":
            assert outcome["scaler"] == "ShardScaler", "fp16's scaler must unscale the shards and agree on inf"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXACT_CASES))
def test_three_ranks_match_one_pytorch_process(name: str) -> None:
    expected = reference(name, 3)
    for rank, result in enumerate(results(3)):
        assert_params_close(result[name]["params"], expected["params"], rank)


def _net() -> torch.nn.Module:
    from engine_cases import Net

    return Net()


@pytest.fixture
def strategy(single_rank_group: None) -> ZeroLowLevelStrategy:
    """The strategy on its own, in a world of one rank in this process (no Fabric, no launch)."""
    from lightning.fabric.accelerators import CPUAccelerator
    from lightning.fabric.plugins.environments import LightningEnvironment

    return ZeroLowLevelStrategy(accelerator=CPUAccelerator(), parallel_devices=[torch.device("cpu")],
                                cluster_environment=LightningEnvironment())


def test_a_second_setup_optimizers_call_for_a_module_is_refused_with_the_fix(strategy: ZeroLowLevelStrategy) -> None:
    model = _net()
    strategy.setup_module(model)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    strategy.setup_optimizer(torch.optim.SGD(weights, lr=0.1))
    with pytest.raises(RuntimeError, match=r"fabric.setup\(model, opt_a, opt_b\)"):
        strategy.setup_optimizer(torch.optim.SGD(rest, lr=0.1))
    strategy.teardown()


def test_an_optimizer_of_no_set_up_module_is_refused(strategy: ZeroLowLevelStrategy) -> None:
    with pytest.raises(RuntimeError, match="set up the module first"):
        strategy.setup_optimizer(torch.optim.SGD(_net().parameters(), lr=0.1))


def test_load_raw_into_an_optimizer_is_refused(strategy: ZeroLowLevelStrategy, tmp_path: Any) -> None:
    with pytest.raises(NotImplementedError, match="optimizer state is sharded"):
        strategy.load_checkpoint(tmp_path / "x.ckpt", torch.optim.SGD(_net().parameters(), lr=0.1))


def test_a_plain_checkpoint_io_is_refused_at_save(strategy: ZeroLowLevelStrategy, tmp_path: Any) -> None:
    from lightning.fabric.plugins import TorchCheckpointIO

    strategy.checkpoint_io = TorchCheckpointIO()
    with pytest.raises(TypeError, match="ZeroCheckpointIO"):
        strategy.save_checkpoint(tmp_path / "x.ckpt", {"model": _net()})
