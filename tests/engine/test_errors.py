"""Bad input fails with a ValueError that names the fix, before any collective can hang."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_zero import ZeroConfig, ZeroEngine, ZeroLowLevelStrategy

STAGE_MESSAGE = r"stage must be 1 \(sharded optimizer state\) or 2"


@pytest.mark.parametrize("stage", [3, 0, "2", True, 1.5, None])
def test_strategy_rejects_stage_other_than_1_or_2(stage: object) -> None:
    with pytest.raises(ValueError, match=STAGE_MESSAGE):
        ZeroLowLevelStrategy(stage=stage)  # type: ignore[arg-type]


def test_stage_3_error_points_to_fsdp() -> None:
    with pytest.raises(ValueError, match=r"got 3\. Stage 3 .* FSDPStrategy"):
        ZeroLowLevelStrategy(stage=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("stage", [1, 2])
def test_stage_1_and_2_are_accepted(stage: int) -> None:
    assert ZeroLowLevelStrategy(stage=stage).stage == stage  # type: ignore[arg-type]


@pytest.mark.parametrize("bucket_size_mb", [0, -1.0])
def test_bucket_size_must_be_positive(bucket_size_mb: float) -> None:
    with pytest.raises(ValueError, match="bucket_size_mb must be > 0"):
        ZeroConfig(stage=2, bucket_size_mb=bucket_size_mb)


def test_engine_without_process_group_says_to_initialize_one() -> None:
    assert not dist.is_initialized()
    model = nn.Linear(3, 3)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig())


def test_strategy_engine_is_unavailable_outside_fit() -> None:
    strategy = ZeroLowLevelStrategy(stage=2)
    with pytest.raises(RuntimeError, match="from the setup of `trainer.fit`"):
        _ = strategy.engine
    with pytest.raises(RuntimeError, match="once `trainer.fit` has set the strategy up"):
        _ = strategy.optimizer_shard_numel


@pytest.mark.usefixtures("single_rank_group")
def test_optimizer_over_a_foreign_parameter_names_the_fix() -> None:
    model = nn.Linear(3, 3)
    stray = nn.Parameter(torch.zeros(5, 2))
    opt = torch.optim.SGD([{"params": model.parameters()}, {"params": [stray]}], lr=0.1)
    with pytest.raises(ValueError, match=r"param group 1, holds a parameter of shape \(5, 2\) that is not a"
                                         r" parameter of the model.*self\.parameters\(\)"):
        ZeroEngine(model, [opt], ZeroConfig())


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize("module_type", [nn.Embedding, nn.EmbeddingBag])
def test_sparse_embedding_is_rejected_at_setup(module_type: type[nn.Module]) -> None:
    model = nn.Sequential(module_type(10, 4, sparse=True), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"Module '0' produces sparse gradients.*sparse=False"):
        ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig())


class FunctionalSparseEmbedding(nn.Module):
    """Sparse gradients the module check cannot see: only backward finds them."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return F.embedding(index, self.table, sparse=True)


@pytest.mark.usefixtures("single_rank_group")
def test_sparse_gradient_from_a_functional_call_is_rejected_in_backward() -> None:
    model = FunctionalSparseEmbedding()
    engine = ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig())
    with pytest.raises(ValueError, match=r"'table' has a sparse gradient.*nn\.Embedding\(sparse=False\)"):
        model(torch.tensor([1, 2])).sum().backward()
    engine.close()


@pytest.mark.usefixtures("single_rank_group")
def test_parameter_in_two_optimizers_is_rejected() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    second = torch.optim.Adam(model[1].parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"'1\.weight' is in optimizer 0 and optimizer 1.*one optimizer only"):
        ZeroEngine(model, [first, second], ZeroConfig())


@pytest.mark.usefixtures("single_rank_group")
def test_optimizer_with_existing_state_is_rejected() -> None:
    model = nn.Linear(3, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match=r"Adam already holds optimizer state.*Create the optimizer fresh"):
        ZeroEngine(model, [opt], ZeroConfig())


@pytest.mark.usefixtures("single_rank_group")
def test_non_contiguous_parameter_is_rejected() -> None:
    model = nn.Linear(3, 4)
    model.weight = nn.Parameter(torch.randn(3, 4).t())
    assert not model.weight.is_contiguous()
    with pytest.raises(ValueError, match=r"'weight' is not contiguous.*\.contiguous\(\)"):
        ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig())


@pytest.mark.usefixtures("single_rank_group")
def test_valid_setup_in_a_one_rank_world_trains() -> None:
    # The fixture's world works: the rejections above are the inputs', not the setup's.
    model = nn.Linear(3, 1)
    engine = ZeroEngine(model, [torch.optim.SGD(model.parameters(), lr=0.1)], ZeroConfig())
    before = model.weight.detach().clone()
    model(torch.ones(2, 3)).sum().backward()
    engine.ensure_flushed()
    engine.optimizers[0].step()
    assert engine.optimizer_shard_numel == 4
    assert not torch.equal(model.weight, before)
    engine.close()
