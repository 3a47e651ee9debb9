"""Trainer-level save and resume on a local path: 2 ranks of ZeRO-2, every checkpoint mode.

One epoch (2 steps) is saved with ``ModelCheckpoint(save_last=True)``; a fresh Trainer with a
perturbed module resumes from ``last.ckpt`` for epoch 2 and must end bit-identical to an
uninterrupted 2-epoch run (weights, so also optimizer state, LR scheduler and loop position,
which all shape the last two steps). Ranks are forked from the test fork server.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from checkpoint_cases import (
    MODES,
    CountingStrategy,
    assert_same_weights,
    fit,
    make_trainer,
)
from engine_cases import global_batch, initial_model, make_optimizer
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning_cases import NetModule, loader

from lightning_zero.checkpoint.store import storage

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def first_epoch(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The checkpoint directory of a 1-epoch run in ``mode`` (run once per mode). The ``local``
    run records the collectives of each save (``counts/``)."""
    made: dict[str, Path] = {}

    def run(mode: str) -> Path:
        if mode not in made:
            root = tmp_path_factory.mktemp(f"{mode}_run")
            counts = root / "counts"
            counts.mkdir()
            strategy = CountingStrategy(str(counts), stage=2, start_method="forkserver") if mode == "local" else None
            fit(make_trainer(mode, root / "ckpts", 1, strategy=strategy))
            made[mode] = root
        return made[mode] / "ckpts"

    return run


@pytest.mark.parametrize("mode", MODES)
def test_resume_from_last_ckpt_equals_the_uninterrupted_run(
        first_epoch: Callable[[str], Path], uninterrupted: dict[str, torch.Tensor], tmp_path: Path, mode: str) -> None:
    ckpts = first_epoch(mode)
    resumed = fit(make_trainer(mode, tmp_path, 2), ckpt_path=str(ckpts / "last.ckpt"), perturb=True)
    assert_same_weights(resumed, uninterrupted, f"{mode}: resumed vs uninterrupted")
    # The resumed run saved epoch 2 where it was told to.
    assert (tmp_path / "epoch=1-step=4.ckpt").exists() and (tmp_path / "last.ckpt").exists()


@pytest.mark.parametrize("mode", MODES)
def test_each_save_writes_a_marker_or_file_and_one_data_version(first_epoch: Callable[[str], Path], mode: str) -> None:
    ckpts = first_epoch(mode)
    names = ["epoch=0-step=2.ckpt", "last.ckpt"]
    if mode == "full":
        assert sorted(p.name for p in ckpts.iterdir()) == names
        return
    assert sorted(p.name for p in ckpts.iterdir()) == ["_zero_data", *names]
    for name in names:
        marker = storage.read_marker(storage.resolve(str(ckpts / name)))
        assert marker["mode"] == mode and marker["world_size"] == 2
        assert [v.name for v in (ckpts / "_zero_data" / name).iterdir()] == [marker["data"].rsplit("/", 1)[-1]]


def test_local_save_through_the_strategy_makes_no_collective_on_the_training_thread(
        first_epoch: Callable[[str], Path]) -> None:
    counts = first_epoch("local").parent / "counts"
    for rank in range(2):
        saves = [json.loads(line) for line in (counts / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [Path(s["path"]).name for s in saves] == ["epoch=0-step=2.ckpt", "last.ckpt"]
        # The coordination group is a gloo group made with new_group (a collective) once per
        # process: at strategy setup, or by the first save of a process that has none yet.
        assert set(saves[0]["main"]) <= {"new_group"}, f"rank {rank}, first save: {saves[0]['main']}"
        for save in saves[1:]:
            assert save["main"] == [], f"rank {rank}, {save['path']}: {save['main']}"


# ---- the full-mode file without lightning_zero ---------------------------------------------


def plain_pytorch_after_one_epoch() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """What 2 ranks of data parallelism compute in epoch 1, in one process of plain PyTorch:
    the mean of the per-slice losses over the global batch, AdamW, StepLR every step."""
    model = initial_model()
    opt = make_optimizer("adamw", model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    for step in range(2):
        opt.zero_grad()
        x, y = global_batch(step, 0, 2)
        loss = sum(F.mse_loss(model(xs), ys) for xs, ys in zip(x.chunk(2), y.chunk(2))) / 2
        loss.backward()
        opt.step()
        sched.step()
    return model, opt


def test_full_checkpoint_is_a_plain_pytorch_file(first_epoch: Callable[[str], Path]) -> None:
    path = first_epoch("full") / "last.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["epoch"] == 0 and checkpoint["global_step"] == 2
    assert len(checkpoint["optimizer_states"]) == 1 and len(checkpoint["lr_schedulers"]) == 1
    reference, reference_opt = plain_pytorch_after_one_epoch()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(checkpoint["state_dict"][f"net.{name}"], value, atol=1e-6, rtol=1e-5)

    # The optimizer state is PyTorch's per-parameter form: a plain AdamW over the same param
    # groups accepts it, and holds what plain PyTorch holds after the same steps.
    module = NetModule()
    plain = make_optimizer("adamw", module.net)
    plain.load_state_dict(checkpoint["optimizer_states"][0])
    expected = reference_opt.state_dict()
    loaded = plain.state_dict()
    assert [g["params"] for g in loaded["param_groups"]] == [g["params"] for g in expected["param_groups"]]
    assert [g["lr"] for g in loaded["param_groups"]] == pytest.approx([g["lr"] for g in expected["param_groups"]])
    assert loaded["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(loaded["state"][index][key], value, atol=1e-6, rtol=1e-5,
                                       msg=lambda m, i=index, k=key: f"param {i} {k}: {m}")


def test_full_checkpoint_loads_into_the_module_without_the_strategy(first_epoch: Callable[[str], Path]) -> None:
    path = first_epoch("full") / "last.ckpt"
    module = NetModule.load_from_checkpoint(path)
    state_dict = torch.load(path, weights_only=True)["state_dict"]
    assert_same_weights({k: v for k, v in module.state_dict().items()}, state_dict, "load_from_checkpoint")


def test_plain_ddp_resumes_from_a_full_checkpoint(first_epoch: Callable[[str], Path], tmp_path: Path,
                                                         uninterrupted: dict[str, torch.Tensor]) -> None:
    # Plain DDP with find_unused_parameters: one rank skips Net.branch, no rank uses Net.dropped.
    # Forked workers: spawned ones can abort at interpreter exit inside gloo, plain DDP's too
    # (see tests/lightning/test_strategy.py). Workers from the fork server gave a different `net.scale`
    # after this resume in one check, unexplained so far; plain fork matches the uninterrupted run.
    strategy = DDPStrategy(find_unused_parameters=True, start_method="fork")
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2,
                      use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    module = NetModule(scheduler=True)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
    trainer.fit(module, loader(2, 1, 2), ckpt_path=str(first_epoch("full") / "last.ckpt"))
    # DDP all-reduces where ZeRO reduce-scatters: equal up to float rounding.
    for name, value in uninterrupted.items():
        torch.testing.assert_close(module.state_dict()[name], value, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
