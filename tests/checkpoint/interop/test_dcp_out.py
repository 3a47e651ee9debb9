"""Out to FSDP2 (``lightning_zero.checkpoint.to_dcp``, ``lightning-zero convert --to dcp``): a checkpoint
ZeroLowLevelStrategy stage 2 saved at 2 ranks, converted, loads into FSDP2 at 1, 2 and 3 ranks with
``set_state_dict``, parameters, moments and steps equal to ours bit for bit; FSDP2 then trains as our own
continuation does within :data:`TOLERANCE`; torch's own ``dcp_to_torch_save`` reads the folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_distributed
from dcp_out_cases import STEPS_AFTER, STEPS_BEFORE, continue_ours, fsdp2_continue, train_ours
from deepspeed_cases import FIXTURES, stitched

from lightning_zero.checkpoint import read_lightning_checkpoint, to_dcp
from lightning_zero.checkpoint.interop.dcp_out import LIGHTNING_STATE
from lightning_zero.checkpoint.reader import read_zero_tree

TRAINED = ["body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias", "head.weight"]
TOLERANCE = 1e-6
"""The largest difference between FSDP2's continuation at 1 and 3 ranks and ours at 2 after ``STEPS_AFTER`` steps,
as a fraction of the tensor's largest magnitude (parameters and moments). The loaded state is equal, and the steps
are the same AdamW arithmetic on the same values and batches; at another world size each rank averages another
slice of the batch and the ranks' gradients are summed in another grouping: an ulp (6e-8) now and then, which
Adam's m/sqrt(v) carries into the moments (observed at most 3.2e-8 for the parameters, 1.5e-7 for the moments).
At 2 ranks, where the slices and the sum are the same, FSDP2 trains to our values bit for bit."""


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Our run: 2 ranks of stage 2 save a ``sharded`` checkpoint, converted ``--to dcp``; then our own
    continuation from that checkpoint, whole."""
    root = tmp_path_factory.mktemp("ours")
    run_distributed(train_ours, 2, str(root), start_method="forkserver")
    to_dcp(str(root / "ours.ckpt"), str(root / "dcp"))
    per_rank = run_distributed(continue_ours, 2, str(root), start_method="forkserver")
    return {"root": root, "loaded": stitched([r["loaded"] for r in per_rank]),
            "after": stitched([r["after"] for r in per_rank])}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 1, 3])
def test_fsdp2_loads_the_converted_checkpoint_bit_for_bit_and_trains_on_as_we_do(
        ours: dict[str, Any], world_size: int) -> None:
    fsdp2 = run_distributed(fsdp2_continue, world_size, str(ours["root"] / "dcp"), start_method="forkserver")[0]
    saved = read_zero_tree(str(ours["root"] / "ours.ckpt"))
    saved_state = saved["optimizer"][0]["state"]
    assert fsdp2["global_step"] == STEPS_BEFORE
    for name, value in saved["model"].items():  # parameters (fp32 masters), the frozen bias, the buffer
        assert torch.equal(fsdp2["loaded"]["weights"][name], value), name
    for name in TRAINED:
        got = fsdp2["loaded"]["params"][name]
        assert torch.equal(got["step"], saved_state[name]["step"]) and got["step"].item() == STEPS_BEFORE
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[key], saved_state[name][key].reshape(got[key].shape)), (name, key)
        for key in ("master", "exp_avg", "exp_avg_sq"):  # our resume loaded the same values
            assert torch.equal(got[key], ours["loaded"]["params"][name][key]), (name, key)
    assert fsdp2["loaded"]["lrs"] == ours["loaded"]["lrs"] and fsdp2["after"]["lrs"] == ours["after"]["lrs"]
    assert fsdp2["after"]["lrs"] != fsdp2["loaded"]["lrs"]  # the StepLR stepped at 8: its state carried over
    for name in TRAINED:
        got, expected = fsdp2["after"]["params"][name], ours["after"]["params"][name]
        assert got["step"].item() == STEPS_BEFORE + STEPS_AFTER
        for key in ("master", "exp_avg", "exp_avg_sq"):
            if world_size == 2:
                assert torch.equal(got[key], expected[key]), (name, key)
                continue
            worst = (got[key] - expected[key]).abs().max().item()
            scale = expected[key].abs().max().item()
            assert worst <= TOLERANCE * scale, f"{name} {key}: {worst:.3g}, {worst / scale:.3g} of its largest value"


def test_the_layout_is_get_state_dicts_with_lightnings_state_beside_it(ours: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    folder = ours["root"] / "dcp"
    keys = set(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    assert {"model.body.0.weight", "model.head.bias", "model.offset", "optimizer.state.body.0.weight.exp_avg",
            "optimizer.state.head.weight.exp_avg_sq", "optimizer.state.body.2.bias.step",
            "optimizer.param_groups.0.lr", "optimizer.param_groups.1.params"} <= keys
    assert not any(key.startswith("optimizer.state.head.bias") for key in keys)  # frozen: no optimizer state
    rest = torch.load(folder / LIGHTNING_STATE, weights_only=True)
    assert rest["global_step"] == STEPS_BEFORE and rest["lr_schedulers"] and "loops" in rest
    assert not {"state_dict", "optimizer_states"} & set(rest)


@pytest.mark.slow
def test_torchs_dcp_to_torch_save_reads_the_converted_folder(ours: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    subprocess.run([sys.executable, "-m", "torch.distributed.checkpoint.format_utils", "dcp_to_torch",
                    str(ours["root"] / "dcp"), str(out)], check=True, capture_output=True)
    content = torch.load(out, weights_only=True)
    saved = read_zero_tree(str(ours["root"] / "ours.ckpt"))
    assert set(content["model"]) == set(saved["model"])
    for name, value in saved["model"].items():
        assert torch.equal(content["model"][name], value), name
    assert torch.equal(content["optimizer"]["state"]["head.weight"]["exp_avg"],
                       saved["optimizer"][0]["state"]["head.weight"]["exp_avg"].reshape(3, 6))


def test_torchs_tool_reads_a_sharded_checkpoints_data_folder_which_the_marker_names(
        ours: dict[str, Any], tmp_path: Path) -> None:
    """A ``sharded`` checkpoint's path is its commit marker (a file); its DCP folder is the one the marker's
    ``data`` names, relative to the marker's folder. There torch's tool reads our own layout (flat 1-D shards
    keyed ``model/<fqn>``, ``optimizer/<i>/state/<fqn>/<key>``), which is not FSDP2's: that is ``--to dcp``."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    marker = ours["root"] / "ours.ckpt"
    with pytest.raises(CheckpointException) as failure:
        dcp_to_torch_save(str(marker), str(tmp_path / "no.pt"))
    # The marker is a file, not a DCP folder: torch's reader fails on it (each torch words its error its own
    # way, "Not a directory" on 2.13, another on 2.9) and writes nothing.
    assert marker.is_file() and failure.value.failures and not (tmp_path / "no.pt").exists()
    data = marker.parent / torch.load(marker, weights_only=True)["lightning_zero"]["data"]
    dcp_to_torch_save(str(data), str(tmp_path / "ours.pt"))
    content = torch.load(tmp_path / "ours.pt", weights_only=True)
    saved = read_zero_tree(str(marker))
    assert torch.equal(content["model/head.weight"].reshape(3, 6), saved["model"]["head.weight"])
    assert torch.equal(content["optimizer/0/state/head.weight/exp_avg"].reshape(3, 6),
                       saved["optimizer"][0]["state"]["head.weight"]["exp_avg"].reshape(3, 6))


def test_a_deepspeed_folder_converts_with_its_moments_keyed_by_name(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    src = str(FIXTURES / "zero2-fp32-rr" / "lightning.ckpt")  # round-robin: the groups' order unshuffled
    to_dcp(src, str(tmp_path / "dcp"))
    content = read_lightning_checkpoint(src)
    order = ["body.0.weight", "body.2.weight", "head.weight", "body.0.bias", "body.2.bias"]
    targets = {f"optimizer.state.{name}.exp_avg": torch.empty_like(content["optimizer_states"][0]["state"][i]["exp_avg"])
               for i, name in enumerate(order)}
    dcp.load(targets, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for i, name in enumerate(order):
        assert torch.equal(targets[f"optimizer.state.{name}.exp_avg"],
                           content["optimizer_states"][0]["state"][i]["exp_avg"]), name


def test_a_full_file_without_parameter_names_is_refused_unless_without_the_optimizer(
        ours: dict[str, Any], tmp_path: Path) -> None:
    from lightning_zero.checkpoint import convert

    full = tmp_path / "model.ckpt"
    convert(str(ours["root"] / "ours.ckpt"), str(full))
    with pytest.raises(ValueError, match="by index, without the parameters' names"):
        to_dcp(str(full), str(tmp_path / "dcp"))
    to_dcp(str(full), str(tmp_path / "weights"), optimizer=False)
    assert LIGHTNING_STATE in {p.name for p in (tmp_path / "weights").iterdir()}


def test_an_existing_folder_is_refused(ours: dict[str, Any]) -> None:
    with pytest.raises(FileExistsError, match="writes a new folder"):
        to_dcp(str(ours["root"] / "ours.ckpt"), str(ours["root"] / "dcp"))


def test_a_full_file_whose_groups_record_param_names_converts_with_its_optimizer_state(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.named_parameters())  # its groups record param_names
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    torch.save({"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "global_step": 1},
               tmp_path / "model.ckpt")
    to_dcp(str(tmp_path / "model.ckpt"), str(tmp_path / "dcp"))
    targets = {"optimizer.state.bias.exp_avg": torch.empty(2), "model.weight": torch.empty(2, 3)}
    dcp.load(targets, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert torch.equal(targets["optimizer.state.bias.exp_avg"], optimizer.state[model.bias]["exp_avg"])
    assert torch.equal(targets["model.weight"], model.weight.detach())


def test_the_convert_command_writes_a_dcp_folder(ours: dict[str, Any], tmp_path: Path) -> None:
    from lightning_zero.cli import main

    assert main(["convert", "--to", "dcp", str(ours["root"] / "ours.ckpt"), str(tmp_path / "dcp")]) == 0
    assert LIGHTNING_STATE in {p.name for p in (tmp_path / "dcp").iterdir()}
    assert main(["convert", "--to", "dcp", str(ours["root"] / "ours.ckpt"), str(tmp_path / "dcp")]) == 1
