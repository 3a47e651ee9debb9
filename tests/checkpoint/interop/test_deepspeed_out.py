"""Back to DeepSpeed (``lightning_zero.checkpoint.to_deepspeed``, ``lightning-zero convert --to deepspeed``), without
DeepSpeed: a DeepSpeed 0.19.8 fixture converted in to a ``full`` Lightning file and out again at its own world size
gives DeepSpeed's own files tensor for tensor, key for key, but for what the writer leaves out by design (the loss
scaler, ``clip_grad``, the run's config); at other world sizes, and from a checkpoint of our own engine, the folder
reads back to the source's parameters, moments and steps exactly; the refusals name what and why.
(clients/deepspeed/check.py loads such folders into real DeepSpeed and trains on.)"""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import CONSOLE, run_distributed
from dcp_out_cases import train_ours
from deepspeed_cases import FIXTURES

from lightning_zero.checkpoint import convert, read_lightning_checkpoint, to_deepspeed
from lightning_zero.checkpoint.formats.deepspeed_files import (
    STAND_INS,
    FragmentAddress,
    StaticLossScaler,
    ZeroStage,
)
from lightning_zero.checkpoint.interop.named_state import read_named
from lightning_zero.checkpoint.reader import META_KEY

REPO = Path(__file__).resolve().parents[3]
SAME_SIZE = ["zero2-fp32", "zero1-fp32", "zero2-bf16", "zero1-bf16"]
"""Fixtures whose files DeepSpeed's ZeRO-1/2 optimizer wrote (the layout to_deepspeed writes): compared file for file."""
READ_BACK = SAME_SIZE + ["zero2-fp32-rr", "zero1-bf16-fp32accum"]
"""Every fixture but fp16 (refused): round-robin and BF16_Optimizer sources convert to the plain ZeRO layout."""
LEFT_OUT = {"loss_scaler", "dynamic_loss_scale", "clip_grad"}
"""What a rank file leaves to the loading run's config (deepspeed_out's docstring); DeepSpeed's loader falls back to
its own for each (``sd.get(LOSS_SCALER, self.loss_scaler)``, ...)."""


def load(path: Path) -> Any:
    """One DeepSpeed file, read as deepspeed_in reads it: only DeepSpeed's own global names admitted."""
    with torch.serialization.safe_globals(STAND_INS):
        return torch.load(path, map_location="cpu", weights_only=True)


def plain(value: Any) -> Any:
    """DeepSpeed's objects as comparable values (a stand-in's class included, so an int is not a ZeroStage)."""
    if isinstance(value, FragmentAddress):
        return ("fragment_address", value.numel, value.start)
    if isinstance(value, ZeroStage):
        return ("ZeroStageEnum", int(value))
    if isinstance(value, StaticLossScaler):
        return (type(value).__name__, value.fields)
    return value


def differences(ours: Any, theirs: Any, path: str = "") -> list[str]:
    """Where two files' contents differ: a key only one holds, a tensor of another dtype, shape or value (exactly),
    any other value (containers' types and order included)."""
    ours, theirs = plain(ours), plain(theirs)
    if isinstance(ours, dict) and isinstance(theirs, dict):
        found = [f"{path}.{k} only in ours" for k in ours if k not in theirs]
        found += [f"{path}.{k} only in DeepSpeed's" for k in theirs if k not in ours]
        if [k for k in ours if k in theirs] != [k for k in theirs if k in ours]:
            found.append(f"{path}: keys in another order")
        return found + [d for k in ours if k in theirs for d in differences(ours[k], theirs[k], f"{path}.{k}")]
    if isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor):
        same = ours.dtype == theirs.dtype and ours.shape == theirs.shape and torch.equal(ours, theirs)
        return [] if same else [f"{path}: {ours.dtype}{list(ours.shape)} vs {theirs.dtype}{list(theirs.shape)}"]
    if isinstance(ours, (list, tuple)) and type(ours) is type(theirs) and len(ours) == len(theirs):
        return [d for i, (a, b) in enumerate(zip(ours, theirs)) for d in differences(a, b, f"{path}[{i}]")]
    return [] if type(ours) is type(theirs) and ours == theirs else [f"{path}: {ours!r} vs {theirs!r}"]


def full_file(tmp_path: Path, case: str) -> str:
    """Fixture ``case``'s Lightning folder converted in: one ``full`` Lightning file."""
    return convert(str(FIXTURES / case / "lightning.ckpt"), str(tmp_path / f"{case}.ckpt"))


def rank_file(folder: Path, rank: int, bf16: bool) -> Path:
    return folder / "checkpoint" / f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def state_of(path: str) -> dict[str, Any]:
    """A checkpoint as Lightning reads it, without the package's meta (which records the source's format)."""
    return {k: v for k, v in read_lightning_checkpoint(path).items() if k != META_KEY}


# ---- a. at the fixture's world size: DeepSpeed's own files --------------------------------------------


@pytest.mark.parametrize("case", SAME_SIZE)
def test_out_at_the_same_world_size_writes_deepspeeds_own_files(tmp_path: Path, case: str) -> None:
    stage, bf16 = int(case[4]), case.endswith("bf16")
    out = Path(to_deepspeed(full_file(tmp_path, case), str(tmp_path / "out"), world_size=2, stage=stage))
    theirs_root = FIXTURES / case / "lightning.ckpt"
    assert (out / "latest").read_text() == (theirs_root / "latest").read_text() == "checkpoint"
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == sorted(
        p.name for p in (theirs_root / "checkpoint").iterdir())
    for rank in (0, 1):
        ours, theirs = load(rank_file(out, rank, bf16)), load(rank_file(theirs_root, rank, bf16))
        zero, their_zero = ours["optimizer_state_dict"], theirs["optimizer_state_dict"]
        # Everything DeepSpeed's optimizer saves, bit for bit: the fp32 partitions, exp_avg/exp_avg_sq over the
        # whole partition, the groups' steps and hyper-parameters, group_paddings, partition_count, zero_stage,
        # param_slice_mappings, param_alignment_paddings, ds_version; the loss scaler and clipping left out.
        assert differences(zero, their_zero) == [f".{k} only in DeepSpeed's" for k in their_zero if k in LEFT_OUT]
        assert set(their_zero) - set(zero) == LEFT_OUT
        assert zero["partition_count"] == [2, 2] and zero["zero_stage"] == stage
        assert sum(p.numel() for p in zero["single_partition_of_fp32_groups"]) > 0
        assert zero["base_optimizer_state"]["state"][0]["step"].item() == 20
        # The run's config stays the loading run's: only what describes the files' layout is recorded.
        assert ours["ds_config"] == {k: theirs["ds_config"][k] for k in ("zero_optimization", "bf16")
                                     if k in theirs["ds_config"]}
        assert "gradient_clipping" in theirs["ds_config"] and "gradient_clipping" not in ours["ds_config"]
        assert set(ours) == set(theirs) == {"optimizer_state_dict", "ds_config", "ds_version"}
        assert ours["ds_version"] == theirs["ds_version"] == "0.19.8"
    ours, theirs = load(out / "checkpoint" / "mp_rank_00_model_states.pt"), load(
        theirs_root / "checkpoint" / "mp_rank_00_model_states.pt")
    # The module in its training dtype, buffer_names, param_shapes, frozen parameters, dp_world_size, global_steps
    # and Lightning's client state (loops, callbacks, lr_schedulers) as DeepSpeedStrategy saved them; global_samples
    # DeepSpeed's loader derives (global_steps x train_batch_size) where a file has none.
    assert differences({k: v for k, v in ours.items() if k != "ds_config"},
                       {k: v for k, v in theirs.items() if k != "ds_config"}) == [".global_samples only in DeepSpeed's"]
    assert list(ours["param_shapes"][0]) == ["body.0.weight", "body.2.weight", "head.weight"]
    assert ours["buffer_names"] == ["offset"] and ours["dp_world_size"] == 2
    assert (ours["frozen_param_shapes"] is None) == (stage == 1)
    assert ours["module"]["body.0.weight"].dtype == (torch.bfloat16 if bf16 else torch.float32)
    assert ours["ds_config"]["zero_optimization"] == {"stage": stage}


def test_the_files_name_deepspeeds_classes_and_none_of_ours(tmp_path: Path) -> None:
    """DeepSpeed's own torch.load builds its fragment_address and ZeroStageEnum from the names in the pickle."""
    out = Path(to_deepspeed(full_file(tmp_path, "zero2-fp32"), str(tmp_path / "out")))
    with zipfile.ZipFile(rank_file(out, 0, False)) as archive:
        pickled = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    assert b"deepspeed.utils.tensor_fragment\nfragment_address" in pickled
    assert b"deepspeed.runtime.zero.config\nZeroStageEnum" in pickled
    assert b"lightning_zero" not in pickled


def test_a_deepspeed_folder_converts_out_directly_at_its_own_world_size_and_stage(tmp_path: Path) -> None:
    """No intermediate file: world size and stage default to the source's (2, ZeRO-1), and the files are the same."""
    direct = Path(to_deepspeed(str(FIXTURES / "zero1-fp32" / "lightning.ckpt"), str(tmp_path / "direct")))
    via_file = Path(to_deepspeed(full_file(tmp_path, "zero1-fp32"), str(tmp_path / "via")))
    for name in ("mp_rank_00_model_states.pt", *(rank_file(direct, r, False).name for r in (0, 1))):
        assert differences(load(direct / "checkpoint" / name), load(via_file / "checkpoint" / name)) == [], name
    assert load(rank_file(direct, 0, False))["optimizer_state_dict"]["zero_stage"] == 1
    assert len(list((direct / "checkpoint").iterdir())) == 3


# ---- b. at other world sizes: read back equal ------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("case", READ_BACK)
def test_out_at_another_world_size_reads_back_equal(tmp_path: Path, case: str, world_size: int) -> None:
    source = full_file(tmp_path, case)
    out = Path(to_deepspeed(source, str(tmp_path / "out"), world_size=world_size))
    back, expected = state_of(str(out)), state_of(source)
    # Every weight (bf16 module, fp32 masters), every moment and step, the param groups, Lightning's state.
    assert differences(back, expected) == []
    assert [s["step"].item() for s in back["optimizer_states"][0]["state"].values()] == [20.0] * 5
    bf16 = "bf16" in case
    files = sorted((out / "checkpoint").iterdir())
    assert [p.name for p in files] == sorted(["mp_rank_00_model_states.pt"] + [
        rank_file(out, r, bf16).name for r in range(world_size)])
    model_states = load(out / "checkpoint" / "mp_rank_00_model_states.pt")
    assert model_states["dp_world_size"] == world_size
    numels = [sum(torch.Size(s).numel() for s in group.values()) for group in model_states["param_shapes"]]
    assert numels == [35 + 30 + 18, 5 + 6]
    zeros = [load(rank_file(out, r, bf16))["optimizer_state_dict"] for r in range(world_size)]
    for group, numel in enumerate(numels):
        size = -(-numel // (2 * world_size)) * 2  # padded to a multiple of 2 x world size, one equal part each
        held = [z["single_partition_of_fp32_groups"][group].numel() + z["group_paddings"][group] for z in zeros]
        assert held == [size] * world_size
        assert sum(z["single_partition_of_fp32_groups"][group].numel() for z in zeros) == numel
        assert all(z["base_optimizer_state"]["state"][group]["exp_avg"].numel() == size for z in zeros)
        assert all(z["partition_count"][group] == world_size for z in zeros)
    assert all(int(z["zero_stage"]) == int(case[4]) for z in zeros)  # the source's stage by default


def test_read_deepspeed_of_the_output_gives_the_sources_masters_and_moments(tmp_path: Path) -> None:
    from lightning_zero.checkpoint import read_deepspeed
    from lightning_zero.checkpoint.store import storage

    source = read_named(full_file(tmp_path, "zero2-bf16"))
    back = read_deepspeed(storage.resolve(to_deepspeed(str(FIXTURES / "zero2-bf16" / "lightning.ckpt"),
                                                       str(tmp_path / "out"), world_size=3, stage=1)))
    assert back.source["world_size"] == 3 and back.source["stage"] == 1 and back.source["precision"] == "bf16"
    assert back.group_names == [["body.0.weight", "body.2.weight", "head.weight"], ["body.0.bias", "body.2.bias"]]
    assert back.optimizer_state is not None
    for index, name in enumerate(n for group in back.group_names for n in group):
        assert torch.equal(back.masters[name], source.model[name]), name
        assert back.state_dict[name].dtype == torch.bfloat16
        state, expected = back.optimizer_state["state"][index], source.optimizer["state"][name]  # type: ignore[index]
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], expected[key]), (name, key)


# ---- c. a checkpoint of our own engine -------------------------------------------------------------


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ZeroLowLevelStrategy stage 2 at 2 ranks, ``sharded`` (tests/dcp_out_cases.py)."""
    root = tmp_path_factory.mktemp("ours")
    run_distributed(train_ours, 2, str(root), start_method="forkserver")
    return root / "ours.ckpt"


@pytest.mark.parametrize("world_size, stage", [(None, None), (3, 1)])
def test_our_engines_checkpoint_converts_out_and_back_in_equal(
        ours: Path, tmp_path: Path, world_size: int | None, stage: int | None) -> None:
    out = Path(to_deepspeed(str(ours), str(tmp_path / "out"), world_size=world_size, stage=stage))
    model_states = load(out / "checkpoint" / "mp_rank_00_model_states.pt")
    assert model_states["dp_world_size"] == (world_size or 2)  # None: the world size that saved it
    zero = load(rank_file(out, 0, False))["optimizer_state_dict"]
    assert int(zero["zero_stage"]) == (stage or 2)
    # ZeRO-2 keeps the frozen bias beside the module, ZeRO-1 does not; the buffer is no parameter.
    assert model_states["buffer_names"] == ["offset"]
    assert (model_states["frozen_param_shapes"] or {}) == ({} if stage == 1 else {"head.bias": torch.Size([3])})
    source, back = read_named(str(ours)), read_named(str(out))
    assert list(back.model) == list(source.model)
    for name, value in source.model.items():
        assert value.dtype == back.model[name].dtype and torch.equal(back.model[name], value), name
    assert source.optimizer is not None and back.optimizer is not None
    assert set(back.optimizer["state"]) == set(source.optimizer["state"]) == {
        "body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias", "head.weight"}
    for name, state in source.optimizer["state"].items():
        shape = source.model[name].shape
        assert state["step"].item() == back.optimizer["state"][name]["step"].item() == 6, name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(back.optimizer["state"][name][key], state[key].reshape(shape)), (name, key)
    for group, back_group in zip(source.optimizer["param_groups"], back.optimizer["param_groups"]):
        assert back_group == group
    for key in ("global_step", "epoch", "loops", "lr_schedulers"):
        assert differences(back.rest[key], source.rest[key]) == [], key


# ---- d. refusals -----------------------------------------------------------------------------------


def test_an_existing_folder_is_refused_and_an_empty_one_is_written(tmp_path: Path) -> None:
    source = full_file(tmp_path, "zero2-fp32")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "latest").write_text("global_step9")
    with pytest.raises(FileExistsError, match="'.*taken' exists: convert --to deepspeed writes a new folder"):
        to_deepspeed(source, str(tmp_path / "taken"))
    assert sorted(p.name for p in (tmp_path / "taken").iterdir()) == ["latest"]  # nothing written beside it
    (tmp_path / "empty").mkdir()
    to_deepspeed(source, str(tmp_path / "empty"))
    assert (tmp_path / "empty" / "latest").read_text() == "checkpoint"


def test_without_the_optimizer_nothing_is_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--no-optimizer: DeepSpeedStrategy's resume loads every rank's optimizer"):
        convert(full_file(tmp_path, "zero2-fp32"), str(tmp_path / "out"), to="deepspeed", optimizer=False)
    model = torch.nn.Linear(3, 2)
    torch.save({"state_dict": model.state_dict(), "global_step": 0}, tmp_path / "weights.ckpt")
    with pytest.raises(ValueError, match="holds no optimizer state"):
        to_deepspeed(str(tmp_path / "weights.ckpt"), str(tmp_path / "out"), world_size=1)
    assert not (tmp_path / "out").exists()


def test_fp16_is_refused_naming_the_loss_scale(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"trained with fp16 loss scaling \(MixedPrecision: scale 256.0\)"):
        to_deepspeed(str(FIXTURES / "zero2-fp16" / "lightning.ckpt"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def _plain_file(tmp_path: Path, optimizer_of: Any, steps: int = 1) -> str:
    """A plain PyTorch/Lightning file whose optimizer was built from ``named_parameters()`` (it names them)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = optimizer_of(model)
    for _ in range(steps):
        model(torch.randn(5, 3)).sum().backward()
        optimizer.step()
    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "global_step": steps},
               path)
    return str(path)


def test_an_optimizer_other_than_adam_is_refused(tmp_path: Path) -> None:
    source = _plain_file(tmp_path, lambda m: torch.optim.SGD(m.named_parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match=r"'0.weight''s optimizer state holds \['momentum_buffer'\], not Adam/AdamW's"):
        to_deepspeed(source, str(tmp_path / "out"), world_size=2)


def test_parameters_of_one_group_at_different_steps_are_refused(tmp_path: Path) -> None:
    def late_start(model: torch.nn.Module) -> torch.optim.Optimizer:
        optimizer = torch.optim.AdamW(model.named_parameters())
        model(torch.randn(5, 3)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model[0].requires_grad_(False)  # the next step has no gradient for the first layer
        return optimizer

    with pytest.raises(ValueError, match=r"were stepped \[1.0, 3.0\] times"):
        to_deepspeed(_plain_file(tmp_path, late_start, steps=2), str(tmp_path / "out"), world_size=2)


def test_a_file_that_records_no_world_size_needs_one_and_then_converts(tmp_path: Path) -> None:
    source = _plain_file(tmp_path, lambda m: torch.optim.AdamW(m.named_parameters()))
    with pytest.raises(ValueError, match="records no data-parallel world size: pass the one DeepSpeed will resume"):
        to_deepspeed(source, str(tmp_path / "out"))
    out = to_deepspeed(source, str(tmp_path / "out"), world_size=2)
    assert differences(read_named(out).optimizer, read_named(source).optimizer) == []


def test_a_frozen_parameter_of_a_file_that_names_no_parameters_is_saved_as_zero2_saves_one(tmp_path: Path) -> None:
    """A plain file cannot tell a frozen parameter from a buffer; DeepSpeed's ZeRO-2 load copies every frozen
    parameter from ``frozen_param_fragments`` by name (a KeyError where it is missing), so each untrained floating
    tensor is written there, and among the buffers too (where zero_to_fp32.py finds a buffer)."""
    def frozen_bias(model: torch.nn.Module) -> torch.optim.Optimizer:
        model[1].bias.requires_grad_(False)
        model.register_buffer("count", torch.tensor(7))
        return torch.optim.AdamW((n, p) for n, p in model.named_parameters() if p.requires_grad)

    out = Path(to_deepspeed(_plain_file(tmp_path, frozen_bias), str(tmp_path / "out"), world_size=2))
    model_states = load(out / "checkpoint" / "mp_rank_00_model_states.pt")
    assert list(model_states["frozen_param_fragments"]) == list(model_states["frozen_param_shapes"]) == ["1.bias"]
    assert torch.equal(model_states["frozen_param_fragments"]["1.bias"], model_states["module"]["1.bias"])
    assert model_states["buffer_names"] == ["count", "1.bias"]
    assert [list(group) for group in model_states["param_shapes"]] == [["0.weight", "0.bias", "1.weight"]]


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be 1 or 2 .*ZeRO-3"):
        to_deepspeed("any", str(tmp_path / "out"), stage=3)
    with pytest.raises(ValueError, match="positive number of ranks, got 0"):
        to_deepspeed("any", str(tmp_path / "out"), world_size=0)
    with pytest.raises(ValueError, match=r"world_size=..., stage=...\) apply to to='deepspeed' only"):
        convert("any", str(tmp_path / "out"), world_size=2)


def test_the_convert_command_writes_a_folder_and_refuses_with_the_message(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_zero.cli import main

    src = str(FIXTURES / "zero2-bf16" / "lightning.ckpt")
    assert main(["convert", src, str(tmp_path / "out"), "--to", "deepspeed", "--world-size", "3", "--stage", "1"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'out'}"
    assert load(tmp_path / "out" / "checkpoint" / "mp_rank_00_model_states.pt")["dp_world_size"] == 3
    assert main(["convert", src, str(tmp_path / "out"), "--to", "deepspeed"]) == 1
    assert capsys.readouterr().err.startswith("lightning-zero convert: error: ")
    assert main(["convert", src, str(tmp_path / "no"), "--to", "deepspeed", "--no-optimizer"]) == 1
    assert "--no-optimizer" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # argparse: ZeRO-3 is no choice
        main(["convert", src, str(tmp_path / "no"), "--to", "deepspeed", "--stage", "3"])
    assert exited.value.code == 2 and "invalid choice: 3" in capsys.readouterr().err


@pytest.mark.slow
def test_the_console_command_refuses_fp16_with_exit_1_and_no_traceback(tmp_path: Path) -> None:
    done = subprocess.run([CONSOLE, "convert", str(FIXTURES / "zero2-fp16" /
                           "lightning.ckpt"), str(tmp_path / "out"), "--to", "deepspeed", "--world-size", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip().startswith("lightning-zero convert: error: ")
    assert "trained with fp16 loss scaling" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()
