"""DeepSpeed ZeRO-1/2 checkpoints read without DeepSpeed (``lightning_zero.checkpoint.formats.deepspeed_in``), against
the checkpoints DeepSpeed 0.19.8 wrote under tests/fixtures/deepspeed/ and its own view of them
(``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``, recorded by make_fixtures.py): the state read
equals DeepSpeed's bit for bit; ``trainer.fit(ckpt_path=<DeepSpeed folder>)`` at 1, 2 and 3 ranks trains the next
10 steps as DeepSpeed did, within the tolerances of :data:`TOLERANCE`; the refusals name what and why."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_distributed
from deepspeed_cases import (
    CASES,
    CLIP,
    FIXTURES,
    HP_MAPPING_WRONG,
    STEPS_AFTER,
    STEPS_BEFORE,
    TinyNet,
    loader,
    param_groups,
    resume,
    rewrite_deepspeed_file,
    stitched,
)

from lightning_zero.checkpoint import CheckpointCorruptError, convert, read_lightning_checkpoint
from lightning_zero.checkpoint.formats.deepspeed_files import DynamicLossScaler
from lightning_zero.checkpoint.formats.deepspeed_in import _scaler_state
from lightning_zero.checkpoint.reader import MASTERS_KEY, META_KEY

LAYOUTS = {"raw": "raw", "lightning": "lightning.ckpt"}
ORDER = ["body.0.weight", "body.2.weight", "head.weight", "body.0.bias", "body.2.bias"]
"""The optimizer's parameters in its param groups' order (weights, then trained biases)."""
TOLERANCE = {"fp32": (1e-5, 1e-5), "bf16": (1e-3, 2e-2), "fp16": (1e-4, 5e-3)}
"""(masters, moments): the largest difference from DeepSpeed's continuation after 10 steps, as a fraction of the
tensor's largest magnitude. The loaded state is equal; the 10 steps are the same arithmetic on the same values,
not in the same order or precision. fp32: gloo sums the ranks' gradients in its own order (at 1 and 3 ranks the
batch is also split otherwise) and DeepSpeed clips by dividing where torch multiplies: about one ulp (6e-8) a
step, which Adam's m/sqrt(v) carries into the moments (observed at most 4.4e-8 / 2.6e-7). bf16 (8-bit mantissa, eps
7.8e-3): the forward, the backward and the gradients' reduction run in bf16 on both sides, in other orders, and
DeepSpeed keeps the buffer fp32 (its loss is fp32, bf16-true's bf16) (observed 1.3e-4 / 7.3e-3). fp16: 16-mixed
(autocast) against DeepSpeed's fp16 module (observed 1.1e-5 / 7.2e-4)."""


def expected(case: str, layout: str) -> dict[str, Any]:
    return torch.load(FIXTURES / case / "expected.pt", weights_only=True)[layout]


def folder(case: str, layout: str) -> str:
    return str(FIXTURES / case / LAYOUTS[layout])


def copy_of(tmp_path: Path, case: str = "zero2-fp32", layout: str = "raw") -> Path:
    target = tmp_path / LAYOUTS[layout]
    shutil.copytree(FIXTURES / case / LAYOUTS[layout], target)
    return target


def tag_of(path: Path) -> Path:
    return path / (path / "latest").read_text().strip()


# ---- the state read ---------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("case", CASES)
def test_the_state_read_equals_deepspeeds_own_bit_for_bit(case: str, layout: str) -> None:
    content = read_lightning_checkpoint(folder(case, layout))
    truth = expected(case, layout)["at_save"]
    state_dict, masters = content["state_dict"], content.get(MASTERS_KEY, {})
    assert list(state_dict) == list(truth["weights"])  # the module's names and order, buffer and frozen bias too
    for name, value in truth["weights"].items():
        assert value.dtype == state_dict[name].dtype and torch.equal(value, state_dict[name]), name
    optimizer = content["optimizer_states"][0]
    for index, name in enumerate(ORDER):
        master = masters.get(name, state_dict[name])
        assert master.dtype == torch.float32
        state = optimizer["state"][index]
        assert torch.equal(state["step"], torch.tensor(float(STEPS_BEFORE))), name
        if case in HP_MAPPING_WRONG:
            # DeepSpeed's own per-parameter view is wrong here; the fp32 module weights are the exact masters.
            assert torch.equal(master, truth["weights"][name]), name
            continue
        assert torch.equal(master, truth["params"][name]["master"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], truth["params"][name][key]), (name, key)
    groups = optimizer["param_groups"]
    assert [g["params"] for g in groups] == [[0, 1, 2], [3, 4]]
    assert [g["lr"] for g in groups] == truth["lrs"]
    expected_groups = param_groups(TinyNet())
    for group, saved in zip(expected_groups, groups):
        assert (saved["weight_decay"], saved["betas"], saved["initial_lr"]) == (
            group["weight_decay"], group["betas"], group["lr"])
    assert (MASTERS_KEY in content) == (case.split("-")[1] != "fp32")
    assert content[META_KEY]["source"]["stage"] == int(case[4])


def test_lightnings_loops_callbacks_and_schedulers_come_from_the_client_state() -> None:
    content = read_lightning_checkpoint(folder("zero2-bf16", "lightning"))
    assert content["global_step"] == STEPS_BEFORE
    loop = content["loops"]["fit_loop"]["epoch_loop.automatic_optimization.optim_progress"]
    assert loop["optimizer"]["step"]["total"]["completed"] == STEPS_BEFORE
    assert [k.split("{")[0] for k in content["callbacks"]] == ["ModelCheckpoint"]
    (scheduler,) = content["lr_schedulers"]
    assert scheduler["last_epoch"] == STEPS_BEFORE and scheduler["_last_lr"] == expected("zero2-bf16", "lightning")[
        "at_save"]["lrs"]
    assert content[META_KEY]["source"]["clip_grad"] == CLIP["lightning"]


def test_a_deepspeed_users_scheduler_and_step_come_from_the_engines_state() -> None:
    content = read_lightning_checkpoint(folder("zero1-fp32", "raw"))
    (scheduler,) = content["lr_schedulers"]  # DeepSpeed stepped it and saved it as `lr_scheduler`
    assert scheduler["last_epoch"] == STEPS_BEFORE
    assert content["global_step"] == STEPS_BEFORE and content["note"] == "any user state"
    assert "loops" not in content  # no Lightning loop state: a fit counts its steps from 0


def test_read_deepspeed_without_the_optimizer_reads_the_masters_only() -> None:
    from lightning_zero.checkpoint import read_deepspeed
    from lightning_zero.checkpoint.store import storage

    checkpoint = read_deepspeed(storage.resolve(folder("zero2-bf16", "raw")), optimizer=False)
    assert checkpoint.optimizer_state is None
    truth = expected("zero2-bf16", "raw")["at_save"]["params"]
    assert all(torch.equal(checkpoint.masters[name], truth[name]["master"]) for name in ORDER)
    assert checkpoint.source == {"format": "deepspeed", "stage": 2, "world_size": 2, "precision": "bf16",
                                 "version": "0.19.8", "tag": "global_step20", "clip_grad": CLIP["raw"],
                                 "loss_scale": 1.0}


def test_a_tag_folder_and_the_folder_naming_it_in_latest_read_the_same() -> None:
    whole = read_lightning_checkpoint(folder("zero2-fp32", "raw"))
    tag = read_lightning_checkpoint(str(tag_of(FIXTURES / "zero2-fp32" / "raw")))
    assert tag[META_KEY]["source"]["tag"] == "global_step20"
    for name, value in whole["state_dict"].items():
        assert torch.equal(value, tag["state_dict"][name])


def test_fp16s_dynamic_loss_scale_carries_over_as_lightnings_scaler_state() -> None:
    content = read_lightning_checkpoint(folder("zero2-fp16", "lightning"))
    assert content["MixedPrecision"]["scale"] == expected("zero2-fp16", "lightning")["at_save"]["loss_scale"] == 256.0
    assert content["MixedPrecision"]["growth_interval"] == 1000


@pytest.mark.parametrize("cur_iter, last_overflow", [(0, -1), (20, -1), (23, -1), (24, -1), (30, 17), (18, 17)])
def test_the_scaler_grows_after_as_many_clean_steps_as_deepspeeds_would(cur_iter: int, last_overflow: int) -> None:
    window = 4
    scaler = DynamicLossScaler()
    scaler.__setstate__({"cur_scale": 64.0, "cur_iter": cur_iter, "last_overflow_iter": last_overflow,
                         "scale_factor": 2.0, "scale_window": window, "dynamic": True})
    state = _scaler_state(scaler)
    assert state is not None
    tracker, deepspeed_scale, torch_scale = state["_growth_tracker"], 64.0, 64.0
    for _ in range(3 * window):  # clean updates: DeepSpeed's rule (DynamicLossScaler.update_scale) and GradScaler's
        stable = cur_iter - last_overflow - 1
        if stable > 0 and stable % window == 0:
            deepspeed_scale *= 2
        cur_iter += 1
        tracker += 1
        if tracker == state["growth_interval"]:
            torch_scale, tracker = torch_scale * state["growth_factor"], 0
        assert torch_scale == deepspeed_scale


# ---- convert -----------------------------------------------------------------------------------------


def test_convert_from_deepspeed_writes_a_lightning_file_plain_pytorch_resumes(tmp_path: Path) -> None:
    out = convert(folder("zero1-bf16", "lightning"), str(tmp_path / "model.ckpt"), source="deepspeed")
    saved = torch.load(out, weights_only=True)
    truth = expected("zero1-bf16", "lightning")["at_save"]
    model = TinyNet()  # fp32 (a bf16 model would have torch's load_state_dict cast the moments to bf16)
    model.load_state_dict(saved["state_dict"])  # strict: every weight, the frozen bias, the buffer
    optimizer = torch.optim.AdamW(param_groups(model))
    optimizer.load_state_dict(saved["optimizer_states"][0])  # as a plain resume (DDP) loads it
    names = {p: n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        assert torch.equal(state["exp_avg"], truth["params"][names[p]]["exp_avg"]), names[p]
    assert set(saved[MASTERS_KEY]) == set(ORDER)
    for name in ORDER:
        assert torch.equal(saved[MASTERS_KEY][name], truth["params"][name]["master"])


def test_the_convert_command_reads_a_deepspeed_folder_and_refuses_another_with_from(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_zero.cli import main

    assert main(["convert", "--from", "deepspeed", folder("zero2-fp32", "lightning"), str(tmp_path / "a.ckpt")]) == 0
    assert torch.load(tmp_path / "a.ckpt", weights_only=True)["global_step"] == STEPS_BEFORE
    assert main(["convert", "--from", "deepspeed", str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")]) == 1
    assert "is not a DeepSpeed checkpoint folder" in capsys.readouterr().err


# ---- refusals ----------------------------------------------------------------------------------------


def test_a_zero3_checkpoint_is_refused_naming_the_stage(tmp_path: Path) -> None:
    path = copy_of(tmp_path)
    tag = tag_of(path)
    (tag / "mp_rank_00_model_states.pt").rename(tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    with pytest.raises(ValueError, match="ZeRO stage 3 checkpoint .*zero_pp_rank_0_mp_rank_00_model_states"):
        read_lightning_checkpoint(str(path))


def test_a_zero3_config_is_refused_naming_the_stage(tmp_path: Path) -> None:
    path = copy_of(tmp_path)

    def stage3(content: dict[str, Any]) -> dict[str, Any]:
        content["ds_config"]["zero_optimization"]["stage"] = 3
        return content

    rewrite_deepspeed_file(tag_of(path) / "mp_rank_00_model_states.pt", stage3)
    with pytest.raises(ValueError, match="ZeRO stage 3 checkpoint"):
        read_lightning_checkpoint(str(path))


def test_tensor_parallel_files_are_refused(tmp_path: Path) -> None:
    path = copy_of(tmp_path)
    tag = tag_of(path)
    shutil.copy(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", tag / "zero_pp_rank_0_mp_rank_01_optim_states.pt")
    with pytest.raises(ValueError, match="tensor \\(model\\) parallelism .*mp_rank_01"):
        read_lightning_checkpoint(str(path))


class _Witness:
    """Unpickled, it would create a file (the payload a crafted checkpoint would carry)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.path}",))


def test_a_crafted_pickle_in_a_rank_file_never_runs(tmp_path: Path) -> None:
    path = copy_of(tmp_path)
    witness = tmp_path / "witness"
    rank_file = tag_of(path) / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"single_partition_of_fp32_groups": _Witness(str(witness))}}, rank_file)
    with pytest.raises(CheckpointCorruptError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt of DeepSpeed"
                                                     " checkpoint .* names the global (posix|os).system"):
        read_lightning_checkpoint(str(path))
    with pytest.raises(CheckpointCorruptError, match="names the global"):
        convert(str(path), str(tmp_path / "out.ckpt"), source="deepspeed", optimizer=False)
    assert not witness.exists()


def test_a_truncated_rank_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = copy_of(tmp_path)
    rank_file = tag_of(path) / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rank_file.write_bytes(rank_file.read_bytes()[: rank_file.stat().st_size // 2])
    with pytest.raises(CheckpointCorruptError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt .*truncated or damaged"):
        read_lightning_checkpoint(str(path))


def test_a_missing_rank_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = copy_of(tmp_path, "zero2-bf16")
    (tag_of(path) / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointCorruptError, match=r"saved by 2 data-parallel ranks but lacks the optimizer-state"
                                                     r" file of rank\(s\) \[1\]"):
        read_lightning_checkpoint(str(path))


def test_an_unknown_optimizers_state_is_refused_and_its_weights_still_convert(tmp_path: Path) -> None:
    path = copy_of(tmp_path)

    def as_sgd(content: dict[str, Any]) -> dict[str, Any]:
        base = content["optimizer_state_dict"]["base_optimizer_state"]
        base["state"] = {i: {"momentum_buffer": s["exp_avg"]} for i, s in base["state"].items()}
        for group in base["param_groups"]:
            group.pop("betas")
            group["momentum"] = 0.9
        return content

    for rank in (0, 1):
        rewrite_deepspeed_file(tag_of(path) / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", as_sgd)
    with pytest.raises(ValueError, match=r"holds \['momentum_buffer'\].*not Adam/AdamW's"):
        read_lightning_checkpoint(str(path))
    out = convert(str(path), str(tmp_path / "weights.ckpt"), source="deepspeed", optimizer=False)
    saved = torch.load(out, weights_only=True)
    assert "optimizer_states" not in saved
    for name, value in expected("zero2-fp32", "raw")["at_save"]["weights"].items():
        assert torch.equal(saved["state_dict"][name], value)


def test_validate_reads_a_deepspeed_folders_weights(in_process_trainer_group: None) -> None:
    from lightning.pytorch import Trainer

    from lightning_zero import ZeroLowLevelStrategy

    batches = torch.load(FIXTURES / "batches.pt", weights_only=True)
    module = TinyNet()
    trainer = Trainer(accelerator="cpu", devices=1, strategy=ZeroLowLevelStrategy(stage=2), logger=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(module, loader(batches, 0, 1, 0, 1), ckpt_path=folder("zero2-fp32", "lightning"), verbose=False)
    for name, value in expected("zero2-fp32", "lightning")["at_save"]["weights"].items():
        assert torch.equal(module.state_dict()[name], value), name


def test_load_from_checkpoint_reads_a_deepspeed_folder() -> None:
    module = TinyNet.load_from_checkpoint(folder("zero2-bf16", "lightning"))
    for name, value in expected("zero2-bf16", "lightning")["at_save"]["weights"].items():
        assert torch.equal(module.state_dict()[name], value.to(module.state_dict()[name].dtype)), name


# ---- trainer.fit(ckpt_path=<DeepSpeed folder>) -------------------------------------------------------

RESUMES = [  # (case, layout, world size, stage): every world size, both stages, every precision and layout
    ("zero2-fp32", "lightning", 2, 2),
    ("zero2-fp32", "lightning", 1, 2),
    ("zero1-fp32", "lightning", 3, 1),
    ("zero1-fp32", "lightning", 2, 1),
    ("zero2-bf16", "lightning", 3, 2),
    ("zero1-bf16", "lightning", 1, 1),
    ("zero2-fp16", "lightning", 2, 2),
    ("zero1-bf16-fp32accum", "lightning", 2, 1),
    ("zero2-fp32-rr", "lightning", 3, 2),
    ("zero2-fp32", "raw", 2, 1),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, layout, world_size, stage", RESUMES)
def test_fit_resumes_a_deepspeed_checkpoint_and_trains_as_deepspeed_did(
        tmp_path: Path, case: str, layout: str, world_size: int, stage: int) -> None:
    per_rank = run_distributed(resume, world_size, case, layout, stage, str(tmp_path), start_method="forkserver")
    loaded, after = stitched([r["loaded"] for r in per_rank]), stitched([r["after"] for r in per_rank])
    truth = expected(case, layout)
    first = STEPS_AFTER if layout == "raw" else STEPS_BEFORE + STEPS_AFTER
    assert per_rank[0]["steps"] == list(range(first - STEPS_AFTER + 1, first + 1))
    assert loaded["lrs"] == truth["at_save"]["lrs"] and after["lrs"] == truth["after"]["lrs"]
    assert per_rank[0]["scheduler"]["last_epoch"] == STEPS_BEFORE + STEPS_AFTER
    master_tol, moment_tol = TOLERANCE[case.split("-")[1]]
    for name in ORDER:
        got_loaded, got = loaded["params"][name], after["params"][name]
        assert torch.equal(got_loaded["step"], torch.tensor(float(STEPS_BEFORE)))
        assert torch.equal(got["step"], torch.tensor(float(STEPS_BEFORE + STEPS_AFTER)))
        if case in HP_MAPPING_WRONG:  # fp32: DeepSpeed's module weights are its exact masters
            assert torch.equal(got_loaded["master"], truth["at_save"]["weights"][name])
            _assert_close(got["master"], truth["after"]["weights"][name], master_tol, name)
            continue
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got_loaded[key], truth["at_save"]["params"][name][key]), (name, key)
            _assert_close(got[key], truth["after"]["params"][name][key], master_tol if key == "master" else moment_tol,
                          f"{name} {key}")
    if case.split("-")[1] == "fp16":
        assert per_rank[0]["loss_scale"] == truth["at_save"]["loss_scale"]
        assert per_rank[0]["loss_scale_after"] == truth["after"]["loss_scale"]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float, what: str) -> None:
    worst = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert worst <= tolerance * scale, f"{what}: differs by {worst:.3g}, {worst / scale:.3g} of its largest value"

