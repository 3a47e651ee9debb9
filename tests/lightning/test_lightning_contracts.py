"""Lightning's contracts held as DDP is held (DESIGN.md, Lightning's contracts): each test runs the same
Trainer script under ``ddp`` and under ZeRO at 2 processes and compares (tests/contract_cases.py).

The Lightning tests that state each contract: ``callbacks/test_stochastic_weight_avg.py`` (the averaged
weights are what is saved and loaded), ``trainer/test_trainer.py::test_trainer_access_in_configure_optimizers``
(no optimizer), ``checkpointing/test_torch_saving.py::test_model_torch_save`` (the Trainer pickles).
"""

from __future__ import annotations

import copy
import functools
import pickle
from typing import Any

import pytest
import torch
from _dist import run_distributed
from contract_cases import (
    Adapted,
    Backbone,
    adapter_epochs,
    adapter_reference,
    adapter_run,
    ema_run,
    finetuning_reference,
    finetuning_resume,
    finetuning_run,
    fit_from_a_save_outside_fit,
    gradient_norms,
    migrate_on_load,
    new_head_resume,
    no_optimizer_fit,
    optimizer_views,
    repeated_fits_groups,
    swa_resume,
    swa_run,
    threads_after_fit,
    versioned_names,
    written_weights,
)

pytestmark = pytest.mark.slow
WORLD = 2


def _on_ranks(fn: Any, *args: Any) -> list[Any]:
    return run_distributed(fn, WORLD, *args, start_method="forkserver")


def assert_close_dicts(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str,
                       atol: float = 1e-5) -> None:
    assert actual.keys() == expected.keys(), where
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=atol, rtol=1e-5, msg=f"{where}: {key}")


@functools.cache
def _written(root: str, strategy: str, lr: float, mode: str) -> list[dict[str, Any]]:
    return _on_ranks(written_weights, root, strategy, lr, mode)


@pytest.mark.parametrize("mode", ["sharded", "local", "full"])
def test_weights_written_into_the_module_are_kept_with_lr_zero(tmp_path: Any, mode: str) -> None:
    """Lightning's contract: the module's weights are the truth. With lr=0 nothing may move what a hook,
    load_state_dict or a ``.data`` write put there; under ZeRO the masters used to revert them."""
    zero = _written(str(tmp_path), "zero", 0.0, mode)
    weights = zero[0]["weights"]
    assert torch.equal(weights["net.hidden.weight"], torch.full_like(weights["net.hidden.weight"], 0.25))
    assert torch.equal(weights["net.frozen.weight"], torch.full_like(weights["net.frozen.weight"], -0.5))
    assert torch.equal(weights["net.head.bias"], torch.arange(11, dtype=torch.float32))
    assert torch.equal(weights["net.embed.bias"], torch.full_like(weights["net.embed.bias"], 0.75))
    assert float(weights["net.scale"]) == 2.5
    assert_close_dicts(zero[1]["weights"], weights, "rank 1 equals rank 0", atol=0.0)
    # The save after fit holds the module as it is, the write in on_train_end included.
    assert_close_dicts(zero[0]["saved"], weights, f"after-fit {mode} checkpoint", atol=0.0)


@pytest.mark.parametrize("mode", ["sharded", "full"])
def test_weights_written_during_training_reach_the_update_as_under_ddp(tmp_path: Any, mode: str) -> None:
    ddp = _written(str(tmp_path), "ddp", 0.1, "full")
    zero = _written(str(tmp_path), "zero", 0.1, mode)
    assert_close_dicts(zero[0]["weights"], ddp[0]["weights"], "weights after fit")
    assert_close_dicts(zero[0]["saved"], ddp[0]["saved"], "checkpoint after fit")


@pytest.mark.parametrize("mode", ["sharded", "local", "full"])
def test_stochastic_weight_averaging_saves_the_averaged_weights_as_under_ddp(tmp_path: Any, mode: str) -> None:
    ddp = _on_ranks(swa_run, str(tmp_path), "ddp", "full")[0]
    zero = _on_ranks(swa_run, str(tmp_path), "zero", mode)[0]
    assert_close_dicts(zero["weights"], ddp["weights"], "averaged weights after fit")
    assert_close_dicts(zero["after_fit"], ddp["after_fit"], "checkpoint after fit")
    assert_close_dicts(zero["after_fit"], zero["weights"], "checkpoint after fit = module", atol=0.0)
    assert_close_dicts(zero["last_epoch"], ddp["last_epoch"], "last epoch's checkpoint")
    # The averaged weights differ from the last epoch's: the comparison above can fail.
    assert not torch.allclose(ddp["after_fit"]["net.hidden.weight"], ddp["last_epoch"]["net.hidden.weight"])
    if mode == "full":
        assert_close_dicts(zero["load_from_checkpoint"], ddp["weights"], "load_from_checkpoint")


def test_fit_without_an_optimizer_runs_and_changes_nothing(tmp_path: Any) -> None:
    results = _on_ranks(no_optimizer_fit, str(tmp_path))
    for result in results:
        assert result["global_step"] == 0 or result["global_step"] == 3
        assert_close_dicts(result["after"], result["before"], "weights", atol=0.0)


def test_repeated_fits_leave_no_process_group_behind(tmp_path: Any) -> None:
    """Every group the package creates (the engine's gather group, the checkpoints' coordination group)
    ends with its fit: after each of three fits in one process only the default group is left."""
    counts = _on_ranks(repeated_fits_groups, str(tmp_path))
    for per_rank in counts:
        assert per_rank == [1, 1, 1, 1], per_rank


def test_trainer_pickles_and_deep_copies_after_fit(tmp_path: Any, in_process_trainer_group: None) -> None:
    from lifecycle_cases import EvalNet
    from lightning.pytorch import Trainer
    from lightning_cases import loader

    from lightning_zero import ZeroLowLevelStrategy

    trainer = Trainer(accelerator="cpu", devices=1, strategy=ZeroLowLevelStrategy(stage=2), max_steps=2,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=str(tmp_path), gradient_clip_val=1.0,
                      use_distributed_sampler=False)
    trainer.fit(EvalNet(), loader(2, 1, 1))
    restored = pickle.loads(pickle.dumps(trainer))
    assert restored.global_step == 2
    torch.save(trainer, tmp_path / "trainer.pt")
    assert copy.deepcopy(trainer).global_step == 2


@pytest.mark.parametrize("mode", ["sharded", "local", "full"])
def test_a_checkpoint_saved_outside_fit_starts_a_fit(tmp_path: Any, mode: str) -> None:
    """Saved after validate (whole tensors: no engine), resumed by fit (flat shards): it used to fail with
    a size mismatch blamed on damaged files."""
    for result in _on_ranks(fit_from_a_save_outside_fit, str(tmp_path), mode):
        assert_close_dicts(result["start"], result["saved"], "weights at the start of the resumed fit", atol=0.0)


@pytest.mark.parametrize("mode", ["sharded", "local", "full"])
def test_model_checkpoint_version_names_are_unique_under_async_saves(tmp_path: Any, mode: str) -> None:
    ddp = _on_ranks(versioned_names, str(tmp_path), "ddp", "full")[0]
    zero = _on_ranks(versioned_names, str(tmp_path), "zero", mode)[0]
    assert ddp["names"] == ["test-v1.ckpt", "test-v2.ckpt", "test-v3.ckpt", "test.ckpt"]
    assert zero["names"] == ddp["names"]
    # Every kept file is its own save: the four steps, none overwritten by a later one.
    assert sorted(zero["steps"].values()) == sorted(ddp["steps"].values()) == [1, 2, 3, 4]


@pytest.mark.parametrize("mode", ["sharded", "local", "full"])
def test_ema_checkpoints_hold_the_average_and_resume_as_under_ddp(tmp_path: Any, mode: str) -> None:
    ddp = _on_ranks(ema_run, str(tmp_path), "ddp", "full")[0]
    zero = _on_ranks(ema_run, str(tmp_path), "zero", mode)[0]
    assert_close_dicts(zero["saved_state_dict"], ddp["saved_state_dict"], "EMA average in the checkpoint")
    assert_close_dicts(zero["saved_current"], ddp["saved_current"], "current weights in the checkpoint")
    # The average is not the current weights: the comparison above tells them apart.
    assert not torch.allclose(ddp["saved_state_dict"]["net.hidden.weight"], ddp["saved_current"]["net.hidden.weight"])
    assert_close_dicts(zero["uninterrupted"], ddp["uninterrupted"], "weights after fit")
    # (Resumed mid-epoch from a loader that cannot resume, the runs differ; under ddp alike.)
    assert_close_dicts(zero["resumed"], ddp["resumed"], "weights after the resumed fit")


@pytest.mark.parametrize("mode", ["sharded", "local", "full"])
@pytest.mark.parametrize("how", ["hook", "exclude"])
def test_adapter_checkpoints_leave_the_frozen_base_out_and_resume_exactly(tmp_path: Any, mode: str, how: str) -> None:
    result = _on_ranks(adapter_run, str(tmp_path), mode, how)[0]
    assert result["saved_keys"] == ["adapter.bias", "adapter.weight"]
    assert_close_dicts(result["resumed"], result["uninterrupted"], "resumed = uninterrupted", atol=0.0)


@pytest.mark.parametrize("mode", ["sharded", "local", "full"])
def test_strict_loading_decides_whether_weights_the_checkpoint_lacks_are_an_error(tmp_path: Any, mode: str) -> None:
    strict = _on_ranks(new_head_resume, str(tmp_path / "strict"), mode, True)
    assert all(r["error"] is not None and "extra.weight" in r["error"] and "strict_loading" in r["error"]
               for r in strict), strict
    lenient = _on_ranks(new_head_resume, str(tmp_path / "lenient"), mode, False)
    for result in lenient:
        assert result["error"] is None and result["global_step"] == 2


def test_optimizer_param_groups_show_the_module_parameters_and_clip_by_value_as_ddp(tmp_path: Any) -> None:
    """Callbacks map the optimizer's parameters to the module's names (BaseFinetuning, SWA, LR monitors):
    the groups hold the module's parameters, as under ddp; Lightning's clipping by value reaches the
    shards (it clipped the module's gradients, which ZeRO does not keep)."""
    ddp = _on_ranks(optimizer_views, str(tmp_path), "ddp")[0]
    zero = _on_ranks(optimizer_views, str(tmp_path), "zero")[0]
    assert zero["names"] == ddp["names"]
    assert_close_dicts(zero["weights"], ddp["weights"], "weights clipped by value")


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("filter_trainable", [True, False])
def test_base_finetuning_unfreezes_the_backbone_as_plain_pytorch(tmp_path: Any, filter_trainable: bool,
                                                                 stage: int) -> None:
    """Lightning's BaseFinetuning (callbacks/test_finetuning_callback.py): unfreezing during fit, by
    add_param_group or by requires_grad alone, trains the backbone from then on as one PyTorch process does
    (the engine rebuilds its buckets: [Note: rebuilding]); before, BaseFinetuning failed with a KeyError
    and a backbone unfrozen in place silently never trained."""
    expected = finetuning_reference(WORLD, filter_trainable)
    results = _on_ranks(finetuning_run, str(tmp_path), filter_trainable, stage)
    for result in results:
        assert_close_dicts(result, expected, "weights after unfreezing at epoch 1")
    initial = Backbone(filter_trainable).state_dict()
    assert not torch.allclose(results[0]["net.embed.weight"], initial["net.embed.weight"])  # it trained


@pytest.mark.parametrize("stage", [1, 2])
def test_gradient_norms_for_logging_equal_ddp_s(tmp_path: Any, stage: int) -> None:
    """Lightning's grad_norm in on_before_optimizer_step (trainer/test_trainer.py, the docs' recipe) logs
    nothing under ZeRO; ZeroLowLevelStrategy.grad_norm gives ddp's figures under the same keys."""
    ddp = _on_ranks(gradient_norms, str(tmp_path), "ddp", stage)
    zero = _on_ranks(gradient_norms, str(tmp_path), "zero", stage)
    for rank in range(WORLD):
        assert zero[rank]["lightning"] == [{}, {}, {}]  # what users got: no parameter has .grad
        assert len(zero[rank]["norms"]) == len(ddp[rank]["norms"]) == 3
        for ours, theirs in zip(zero[rank]["norms"], ddp[rank]["norms"], strict=True):
            assert ours.keys() == theirs.keys() and len(ours) > 2
            for key in theirs:
                assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("mode", ["sharded", "local", "full"])
def test_swa_with_a_custom_scheduler_resumes_as_under_ddp(tmp_path: Any, mode: str) -> None:
    """callbacks/test_stochastic_weight_avg.py::test_swa_resume_training_from_checkpoint_custom_scheduler:
    SWA restores its scheduler in on_fit_start, so the callbacks' state must be back before it (it used
    to fail with KeyError: 'lr_lambdas')."""
    ddp = _on_ranks(swa_resume, str(tmp_path), "ddp", "full")[0]
    zero = _on_ranks(swa_resume, str(tmp_path), "zero", mode)[0]
    assert_close_dicts(zero["uninterrupted"], ddp["uninterrupted"], "uninterrupted")
    assert_close_dicts(zero["resumed"], ddp["resumed"], "resumed")
    assert_close_dicts(zero["resumed"], zero["uninterrupted"], "resumed = uninterrupted", atol=1e-6)


def test_a_closure_optimizer_is_refused_at_setup_through_the_trainer(tmp_path: Any,
                                                                     in_process_trainer_group: None) -> None:
    """core/test_lightning_optimizer.py's LBFGS: refused at setup with the reason, as Lightning's DeepSpeed
    strategy refuses it, instead of an internal TypeError after the first backward."""
    from lifecycle_cases import EvalNet
    from lightning.pytorch import Trainer
    from lightning_cases import loader

    from lightning_zero import ZeroLowLevelStrategy

    class WithLBFGS(EvalNet):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.LBFGS(self.parameters(), lr=0.1)

    trainer = Trainer(accelerator="cpu", devices=1, strategy=ZeroLowLevelStrategy(stage=2), max_steps=2,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=str(tmp_path), use_distributed_sampler=False)
    with pytest.raises(ValueError, match=r"LBFGS\) cannot run under ZeRO: it needs a closure"):
        trainer.fit(WithLBFGS(), loader(2, 1, 1))


def test_no_thread_of_the_package_outlives_fit(tmp_path: Any) -> None:
    for result in _on_ranks(threads_after_fit, str(tmp_path)):
        assert result["threads"] == [] and result["threads_after_save"] == [] and result["saved_step"] == 2, result


@pytest.mark.parametrize("strategy", ["ddp_spawn", "zero2"])
def test_a_spawned_fit_leaves_no_thread_in_the_launching_process(tmp_path: Any, strategy: str) -> None:
    """checkpointing/test_torch_saving.py::test_model_torch_save_ddp_cpu (and the SWA/EMA spawn tests), whose
    conftest fails a test that leaves a thread: the spawn launcher removes the workers' weights file through
    the checkpoint IO in this process. DDP is the control."""
    import threading

    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_zero import ZeroLowLevelStrategy

    before = set(threading.enumerate())
    chosen = strategy if strategy == "ddp_spawn" else ZeroLowLevelStrategy(stage=2, start_method="spawn")
    trainer = Trainer(default_root_dir=tmp_path, max_steps=2, limit_val_batches=0, strategy=chosen,
                      accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False)
    model = BoringModel()
    initial = model.layer.weight.detach().clone()
    trainer.fit(model)
    assert trainer.state.finished
    assert not torch.equal(model.layer.weight, initial), "the trained weights did not come back from the workers"
    left = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
    assert left == [], f"{strategy}: threads left in the launching process: {left}"
    assert not list(tmp_path.glob(".temp*.ckpt")), "the workers' weights file was not removed"


@pytest.mark.parametrize("mode", ["sharded", "local", "full"])
def test_on_load_checkpoint_migrates_renamed_layers_before_the_weights_are_applied(tmp_path: Any, mode: str) -> None:
    """trainer/connectors/test_checkpoint_connector.py: the module's on_load_checkpoint sees the checkpoint
    before its weights are applied and strict_loading judges the result: a hook renaming old layer names
    resumes fit and validate (a KeyError for missing keys before)."""
    for result in _on_ranks(migrate_on_load, str(tmp_path), mode, "rename"):
        assert result["error"] is None, result["error"]
        assert_close_dicts(result["start"], result["saved"], "fit resumed through the renaming hook", atol=0.0)
        assert_close_dicts(result["validated"], result["saved"], "validate through the renaming hook", atol=0.0)


@pytest.mark.parametrize("mode", ["sharded", "full"])
def test_a_weight_the_hook_drops_keeps_the_module_value(tmp_path: Any, mode: str) -> None:
    for result in _on_ranks(migrate_on_load, str(tmp_path), mode, "drop"):
        assert result["error"] is None, result["error"]
        expected = {**result["saved"], "body.head.bias": result["own"]["body.head.bias"]}
        assert not torch.equal(result["saved"]["body.head.bias"], result["own"]["body.head.bias"])
        assert_close_dicts(result["start"], expected, "the dropped weight is the module's own", atol=0.0)
        assert_close_dicts(result["validated"], expected, "validate", atol=0.0)


def test_a_hook_computes_from_a_full_checkpoint_and_is_told_why_it_cannot_from_a_sharded_one(tmp_path: Any) -> None:
    full = _on_ranks(migrate_on_load, str(tmp_path / "full"), "full", "compute")
    for result in full:
        assert result["error"] is None, result["error"]
        assert torch.count_nonzero(result["start"]["body.head.bias"]) == 0
    sharded = _on_ranks(migrate_on_load, str(tmp_path / "sharded"), "sharded", "compute")
    for result in sharded:
        assert result["error"] is not None and "placeholders" in result["error"] and "convert" in result["error"]


@pytest.mark.parametrize("mode", ["sharded", "full"])
def test_adapter_checkpoint_saved_on_two_processes_resumes_exactly_on_three(tmp_path: Any, mode: str) -> None:
    """The LoRA habit across world sizes: the adapters-only checkpoint of an epoch on 2 processes resumes on
    3 (the adapters' optimizer state resharded 2 -> 3, the base from the module) and ends where one PyTorch
    process does after the same batches."""
    _on_ranks(adapter_epochs, str(tmp_path), mode, 1, None)
    resumed = run_distributed(adapter_epochs, 3, str(tmp_path), mode, 2, str(tmp_path / "adapter-epochs" / "epoch=0.ckpt"),
                              start_method="forkserver")
    expected = adapter_reference([WORLD, 3])
    for weights in resumed:
        assert_close_dicts(weights, expected, "adapters resumed on 3 processes")
    assert not torch.allclose(expected["adapter.weight"], Adapted(drop_base=True).adapter.weight)  # they trained


def test_stage_1_with_full_gradients_shows_param_grad_as_ddp(tmp_path: Any) -> None:
    """ZeroLowLevelStrategy(stage=1, full_gradients=True): param.grad holds the averaged whole gradient
    after backward, so Lightning's own grad_norm (and anything reading .grad) sees ddp's figures."""
    ddp = _on_ranks(gradient_norms, str(tmp_path), "ddp", 1)
    zero = _on_ranks(gradient_norms, str(tmp_path), "zero", 1, True)
    for rank in range(WORLD):
        for ours, theirs in zip(zero[rank]["lightning"], ddp[rank]["lightning"], strict=True):
            assert ours.keys() == theirs.keys() and len(ours) > 2
            for key in theirs:
                assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), key
        assert_close_dicts(zero[rank]["weights"], ddp[rank]["weights"], "weights")


@functools.cache
def _finetuned(root: str, strategy: str, mode: str, stage: int) -> dict[str, Any]:
    return _on_ranks(finetuning_resume, root, strategy, mode, stage)[0]


@pytest.mark.parametrize(("mode", "stage"), [("sharded", 2), ("local", 2), ("sharded", 1)])
def test_a_resume_gets_back_the_param_groups_a_finetuning_callback_added(tmp_path_factory: Any, mode: str,
                                                                        stage: int) -> None:
    """callbacks/test_finetuning_callback.py::test_base_finetuning_internal_optimizer_metadata: BaseFinetuning
    added a param group per epoch; the resume from epoch 1's checkpoint starts from its weights with its
    groups, learning rates and Adam steps, and trains on as DDP's resume does (DDP the control)."""
    root = str(tmp_path_factory.getbasetemp() / "finetuning")
    ddp = _finetuned(root, "ddp", "sharded", 2)
    zero = _finetuned(root, "zero", mode, stage)
    assert ddp["groups"] == [["layer.0.weight", "layer.0.bias"], ["layer.1.weight", "layer.1.bias"],
                             ["layer.2.weight", "layer.2.bias"]], ddp["groups"]
    assert zero["groups"] == ddp["groups"] and zero["lrs"] == ddp["lrs"], (zero["groups"], zero["lrs"])
    assert zero["steps"] == ddp["steps"], (zero["steps"], ddp["steps"])
    assert_close_dicts(zero["start"], zero["saved"], f"{mode}: the resume starts from the checkpoint", atol=0.0)
    assert_close_dicts(zero["uninterrupted"], ddp["uninterrupted"], f"{mode}: the uninterrupted fit")
    assert_close_dicts(zero["resumed"], ddp["resumed"], f"{mode}: the resumed fit")


def test_a_full_file_with_added_param_groups_is_refused_naming_the_cause(tmp_path_factory: Any) -> None:
    """A ``full`` file numbers its groups' parameters (torch's layout): the groups BaseFinetuning added cannot
    be matched by name, and the resume says so instead of blaming the file."""
    error = _finetuned(str(tmp_path_factory.getbasetemp() / "finetuning"), "zero", "full", 2)["error"]
    assert error is not None and "param groups" in error and "BaseFinetuning" in error, error
