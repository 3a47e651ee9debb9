"""Optimizers under ZeRO: shape-aware ones (Muon, Adafactor, declared) exact on whole parameters,
elementwise ones on the even split, everything else refused at setup ([Note: optimizer kinds]).

Every equivalence compares N gloo ranks with one plain PyTorch process on the same global batch
(tests/shape_aware_cases.py). All runs of one world size share one process group (cached).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any
from unittest import mock

import pytest
import torch
from _dist import run_distributed
from shape_aware_cases import (
    ELEMENTWISE,
    AdamWithDefaults,
    AdamWithOwnStep,
    GlobalBatches,
    Lion,
    MixModule,
    Run,
    TrustRatioSGD,
    initial_mixnet,
    make_optimizers,
    plain_train,
    reference,
    resume,
    run_many,
    save_midway,
)

import lightning_zero
from lightning_zero import ZeroConfig, ZeroEngine, register_optimizer
from lightning_zero.engine.optimizer_kinds import optimizer_kind
from lightning_zero.engine.sharding import EvenShard

SHAPE_AWARE = ("muon-adamw", "muon-nesterov-off", "adafactor", "trust-ratio")
RUNS: dict[str, Run] = {
    **{f"{name}-stage{stage}": Run(name, stage=stage) for name in SHAPE_AWARE for stage in (1, 2)},
    **{f"{name}-stage2": Run(name) for name in ELEMENTWISE},
    "adamw-stage1": Run("adamw", stage=1),
    "lion-stage1": Run("lion", stage=1),
    **{f"{name}-gather-masters": Run(name, gather_masters=True) for name in ("muon-adamw", "adafactor")},
    **{f"{name}-clip": Run(name, clip_norm=0.05) for name in ("muon-adamw", "adafactor")},
    # One parameter per inner step() call: the bound on the step's full-size temporaries.
    **{f"{name}-one-at-a-time": Run(name, whole_step_group_mb=1e-6) for name in ("muon-adamw", "adafactor")},
    "trust-ratio-bounded": Run("trust-ratio", whole_step_group_mb=1e-6),
}
INITIAL = {n: p.detach().clone() for n, p in initial_mixnet().named_parameters()}


@functools.cache
def results(world_size: int, hybrid: bool = False) -> list[dict[str, dict[str, Any]]]:
    runs = RUNS if not hybrid else {name: replace(run, shard_group_size=2)
                                    for name, run in RUNS.items() if run.optimizer in SHAPE_AWARE}
    return run_distributed(run_many, world_size, runs, start_method="forkserver")


@functools.cache
def expected(optimizer: str, world_sizes: tuple[int, ...], clip_norm: float | None = None) -> dict[str, torch.Tensor]:
    return reference(optimizer, list(world_sizes), clip_norm)


def assert_params_close(actual: dict[str, torch.Tensor], wanted: dict[str, torch.Tensor], where: str) -> None:
    assert actual.keys() == wanted.keys()
    for fqn, value in wanted.items():
        torch.testing.assert_close(actual[fqn], value, atol=1e-6, rtol=1e-5, msg=lambda m, f=fqn: f"{where} {f}: {m}")


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", list(RUNS))
def test_parameters_match_single_process_pytorch(world_size: int, name: str) -> None:
    run = RUNS[name]
    wanted = expected(run.optimizer, (world_size,) * run.steps, run.clip_norm)
    for rank, result in enumerate(results(world_size)):
        assert_params_close(result[name]["params"], wanted, f"rank {rank}")


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, run in RUNS.items() if run.optimizer in SHAPE_AWARE])
def test_hybrid_2x2_matches_single_process_pytorch(name: str) -> None:
    wanted = expected(RUNS[name].optimizer, (4,) * RUNS[name].steps, RUNS[name].clip_norm)
    for rank, result in enumerate(results(4, hybrid=True)):
        assert_params_close(result[name]["params"], wanted, f"rank {rank}")


@pytest.mark.parametrize("optimizer", ["muon-adamw", "adafactor"])
def test_the_clipped_runs_clip_something(optimizer: str) -> None:
    clipped, unclipped = expected(optimizer, (2, 2, 2), 0.05), expected(optimizer, (2, 2, 2))
    assert any(not torch.allclose(clipped[n], unclipped[n], atol=1e-4) for n in unclipped)


@pytest.mark.parametrize("name", ["muon-adamw-stage2", "adafactor-stage2"])
def test_unused_parameter_is_untouched_and_the_others_move(name: str) -> None:
    params = results(2)[0][name]["params"]
    for fqn in ("unused.weight", "unused.bias"):
        assert torch.equal(params[fqn], INITIAL[fqn])
    for fqn in ("embed.weight", "hidden.weight", "out.weight", "scale"):
        assert not torch.allclose(params[fqn], INITIAL[fqn])


@pytest.mark.parametrize("world_size", [2, 3])
def test_shape_aware_state_is_split_evenly_between_steps(world_size: int) -> None:
    """Masters and momentum of Muon's matrices are even shards: no rank holds much more than the
    mean (the padding of a few tiny tensors is the difference), and the step's gather is what it costs."""
    per_rank = [result["muon-adamw-stage2"]["state_bytes"] for result in results(world_size)]
    assert max(per_rank) / (sum(per_rank) / world_size) < 1.15, per_rank
    chunks = sum(EvenShard(p.numel(), world_size).chunk for n, p in INITIAL.items()
                 if p.ndim == 2 and not n.startswith("unused"))
    for result in results(world_size):
        # Gradient and momentum of every trained matrix (fp32: the masters come from the module),
        # padded to whole chunks, from each of the other ranks; with the masters gathered, 3 of them.
        assert result["muon-adamw-stage2"]["gathered_bytes"] == 2 * 4 * chunks * (world_size - 1)
        assert result["muon-adamw-gather-masters"]["gathered_bytes"] == 3 * 4 * chunks * (world_size - 1)


@pytest.mark.parametrize("world_size", [2, 3])
def test_muon_and_adafactor_step_a_group_at_a_time_and_declared_ones_at_once(world_size: int) -> None:
    trained = [n for n, p in INITIAL.items() if not n.startswith("unused")]
    matrices = [n for n in trained if INITIAL[n].ndim == 2]
    for result in results(world_size):
        assert result["muon-adamw-one-at-a-time"]["groups_stepped"] == [len(matrices), None]
        assert result["muon-adamw-stage2"]["groups_stepped"] == [1, None]
        assert result["adafactor-one-at-a-time"]["groups_stepped"] == [len(trained)]
        assert result["trust-ratio-bounded"]["groups_stepped"] == [1]


def test_whole_step_group_mb_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"whole_step_group_mb must be > 0 \(or None: .*got 0"):
        ZeroConfig(whole_step_group_mb=0)


# ---- checkpoints -------------------------------------------------------------------------------

CHECKPOINTED = ("muon-adamw", "adafactor")
MODES = ("local", "sharded", "full")


@functools.cache
def saved(root: str, optimizer: str) -> list[dict[str, torch.Tensor]]:
    return run_distributed(save_midway, 2, Run(optimizer), root, MODES, start_method="forkserver")


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("shape_aware_checkpoints"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("optimizer", CHECKPOINTED)
def test_resume_equals_the_uninterrupted_run(checkpoint_root: str, optimizer: str, mode: str) -> None:
    uninterrupted = saved(f"{checkpoint_root}/{optimizer}", optimizer)
    resumed = run_distributed(resume, 2, Run(optimizer), f"{checkpoint_root}/{optimizer}/{mode}.ckpt",
                              start_method="forkserver")
    for rank in range(2):
        for fqn, value in uninterrupted[rank].items():
            assert torch.equal(resumed[rank][fqn], value), f"rank {rank} {fqn}"


@pytest.mark.parametrize("mode", ["sharded", "full"])
@pytest.mark.parametrize("optimizer", CHECKPOINTED)
def test_resume_on_three_ranks_continues_like_pytorch(checkpoint_root: str, optimizer: str, mode: str) -> None:
    """Saved by 2 ranks after 2 steps, resumed by 3: steps 2 and 3 see 3 ranks' global batches."""
    saved(f"{checkpoint_root}/{optimizer}", optimizer)
    resumed = run_distributed(resume, 3, Run(optimizer), f"{checkpoint_root}/{optimizer}/{mode}.ckpt",
                              start_method="forkserver")
    wanted = expected(optimizer, (2, 2, 3, 3))
    for rank, params in enumerate(resumed):
        assert_params_close(params, wanted, f"rank {rank}")


@pytest.mark.parametrize("optimizer", CHECKPOINTED)
def test_a_converted_checkpoint_resumes_plain_pytorch(checkpoint_root: str, optimizer: str) -> None:
    """The whole-tensor view of a sharded checkpoint (what ``lightning-zero convert`` writes) holds
    PyTorch's own optimizer state: plain Muon/AdamW/Adafactor load it and continue like the run."""
    from lightning_zero.checkpoint.reader import read_zero_tree, to_lightning

    uninterrupted = saved(f"{checkpoint_root}/{optimizer}", optimizer)
    content = to_lightning(read_zero_tree(f"{checkpoint_root}/{optimizer}/sharded.ckpt"))
    model = initial_mixnet()
    model.load_state_dict(content["state_dict"])
    opts = make_optimizers(optimizer, model)
    for opt, state in zip(opts, content["optimizer_states"], strict=True):
        opt.load_state_dict(state)
    assert_params_close(plain_train(model, opts, {2: 2, 3: 2}), uninterrupted[0], "plain PyTorch")


# ---- refusal and declaration --------------------------------------------------------------------


def _model_params() -> list[torch.nn.Parameter]:
    return list(initial_mixnet().parameters())


def test_lbfgs_is_refused_as_needing_a_closure_and_whole_parameters() -> None:
    with pytest.raises(ValueError, match=r"Optimizer 0 \(LBFGS\) cannot run under ZeRO: it needs a closure.*"
                                         r"whole-parameter view.*not supported"):
        optimizer_kind(torch.optim.LBFGS(_model_params()))


def test_sparse_adam_is_refused() -> None:
    with pytest.raises(ValueError, match=r"SparseAdam.*sparse gradients"):
        optimizer_kind(torch.optim.SparseAdam(_model_params()))


class Unknown(torch.optim.Optimizer):
    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})


def test_an_unknown_optimizer_is_refused_naming_it_and_the_declaration() -> None:
    with pytest.raises(ValueError, match=r"Optimizer 1 \(test_shape_aware_optimizers\.Unknown\) is unknown to ZeRO.*"
                                         r"register_optimizer\(Unknown, kind='elementwise'\)"):
        optimizer_kind(Unknown(_model_params()), index=1)


def test_a_subclass_that_overrides_step_is_refused_and_one_that_sets_defaults_is_not() -> None:
    with pytest.raises(ValueError, match=r"subclasses Adam but overrides AdamWithOwnStep\.step.*register_optimizer"):
        optimizer_kind(AdamWithOwnStep(_model_params()))
    torch.optim.Adam(_model_params())  # torch patches a profiling wrapper into the classes it builds
    assert optimizer_kind(AdamWithDefaults(_model_params())) == "elementwise"


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_elementwise_optimizers_are_known(name: str) -> None:
    assert optimizer_kind(ELEMENTWISE[name](_model_params())) == "elementwise"


def test_muon_adafactor_and_declared_ones_get_whole_parameters() -> None:
    params = [p for p in _model_params() if p.ndim == 2]
    assert optimizer_kind(torch.optim.Muon(params)) == "shape_aware"
    assert optimizer_kind(torch.optim.Adafactor(params)) == "shape_aware"
    assert optimizer_kind(TrustRatioSGD(params)) == "shape_aware"
    assert optimizer_kind(Lion(params)) == "elementwise"


def test_register_optimizer_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="takes a torch.optim.Optimizer subclass, got 'Lion'"):
        register_optimizer("Lion")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"kind must be one of \('elementwise', 'shape_aware'\), got 'matrix'"):
        register_optimizer(Lion, kind="matrix")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="LBFGS cannot be declared 'elementwise'"):
        register_optimizer(torch.optim.LBFGS)
    assert lightning_zero.register_optimizer is register_optimizer


def refused_before_any_collective(rank: int, world_size: int) -> dict[str, Any]:
    """Build an engine over AdamW and LBFGS with every collective watched."""
    import torch.distributed as dist

    from lightning_zero.engine import collectives as comm

    calls: list[str] = []

    def watched(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"{name} before the optimizers were validated")
        return call

    model = initial_mixnet()
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    patches = [mock.patch.object(dist, n, watched(n)) for n in ("broadcast", "all_reduce", "all_gather_object")]
    patches.append(mock.patch.object(comm, "new_group", watched("new_group")))
    for patch in patches:
        patch.start()
    try:
        ZeroEngine(model, [torch.optim.AdamW(rest), torch.optim.LBFGS(matrices)], ZeroConfig(2))
    except ValueError as exc:
        return {"error": str(exc), "calls": calls}
    finally:
        for patch in patches:
            patch.stop()
    return {"error": None, "calls": calls}


def test_the_engine_refuses_on_every_rank_before_any_collective() -> None:
    for result in run_distributed(refused_before_any_collective, 2, start_method="forkserver"):
        assert result["calls"] == []
        assert result["error"] is not None and result["error"].startswith("Optimizer 1 (LBFGS) cannot run under ZeRO")


# ---- through the Trainer ----------------------------------------------------------------------


def _fit(optimizer: str, stage: int, steps: int = 3) -> dict[str, torch.Tensor]:
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from lightning_zero import ZeroLowLevelStrategy

    module = MixModule(optimizer)
    trainer = Trainer(
        accelerator="cpu", devices=2, max_epochs=1, use_distributed_sampler=False, logger=False,
        strategy=ZeroLowLevelStrategy(stage=stage, bucket_size_mb=0.0003, start_method="forkserver"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(GlobalBatches(steps, 2), batch_size=None, shuffle=False))
    return {n: p.detach().clone() for n, p in module.net.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize(("optimizer", "stage"), [("muon-adamw", 2), ("adafactor", 1)])
def test_trainer_on_two_processes_matches_pytorch(optimizer: str, stage: int) -> None:
    assert_params_close(_fit(optimizer, stage), expected(optimizer, (2, 2, 2)), "rank 0")


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", CHECKPOINTED)
def test_hybrid_checkpoint_resumes_exactly_and_reshards_to_a_flat_world(checkpoint_root: str, optimizer: str) -> None:
    """Saved by 2x2 hybrid ranks after 2 steps: resumed by the same layout (``local``: bit for bit) and by
    2 flat ranks (``sharded``: steps 2 and 3 on 2 ranks' batches, like PyTorch)."""
    hybrid = Run(optimizer, shard_group_size=2)
    root = f"{checkpoint_root}/hybrid-{optimizer}"
    uninterrupted = run_distributed(save_midway, 4, hybrid, root, ("local", "sharded"), start_method="forkserver")
    resumed = run_distributed(resume, 4, hybrid, f"{root}/local.ckpt", start_method="forkserver")
    for rank in range(4):
        for fqn, value in uninterrupted[rank].items():
            assert torch.equal(resumed[rank][fqn], value), f"rank {rank} {fqn}"
    flat = run_distributed(resume, 2, Run(optimizer), f"{root}/sharded.ckpt", start_method="forkserver")
    for rank, params in enumerate(flat):
        assert_params_close(params, expected(optimizer, (4, 4, 2, 2)), f"rank {rank}")


def _fit_checkpointed(optimizer: str, mode: str, root: str, max_epochs: int, ckpt_path: str | None) -> dict[str, Any]:
    """2 steps an epoch (global batches 0 and 1) on 2 processes, ``last.ckpt`` saved every epoch."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from lightning_zero import ZeroCheckpointIO, ZeroLowLevelStrategy

    module = MixModule(optimizer)
    if ckpt_path is not None:  # a resume equals the run only if the checkpoint was really loaded
        with torch.no_grad():
            for p in module.parameters():
                p.add_(1.0)
    trainer = Trainer(
        accelerator="cpu", devices=2, max_epochs=max_epochs, use_distributed_sampler=False, logger=False,
        strategy=ZeroLowLevelStrategy(stage=2, bucket_size_mb=0.0003, start_method="forkserver"),
        plugins=[ZeroCheckpointIO(mode=mode, async_save=True)],
        callbacks=[ModelCheckpoint(dirpath=root, save_last=True)], enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(GlobalBatches(2, 2), batch_size=None, shuffle=False), ckpt_path=ckpt_path)
    return {n: p.detach().clone() for n, p in module.net.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize(("optimizer", "mode"), [("muon-adamw", "sharded"), ("adafactor", "local")])
def test_trainer_resume_from_last_continues_like_pytorch(tmp_path: Any, optimizer: str, mode: str) -> None:
    _fit_checkpointed(optimizer, mode, str(tmp_path), 1, None)
    resumed = _fit_checkpointed(optimizer, mode, str(tmp_path), 2, str(tmp_path / "last.ckpt"))
    model = initial_mixnet()
    opts = make_optimizers(optimizer, model)
    plain_train(model, opts, {0: 2, 1: 2})
    assert_params_close(resumed, plain_train(model, opts, {0: 2, 1: 2}), "rank 0")
