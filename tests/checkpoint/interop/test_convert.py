"""``lightning-zero convert`` and the other ways out of a ZeRO checkpoint, checked against the trained model.

Each run is one epoch (2 steps) of 2 ZeRO-2 ranks saving ``last.ckpt`` through
``ZeroCheckpointIO(mode)``. A tiny random GPT-2 (tests/hf_cases.py) is exported as a Hugging Face
folder from checkpoints of every mode and from the live module: ``from_pretrained`` must
give the trained module's logits exactly. The engine cases' NetModule is converted to one Lightning
file: its weights and optimizer state must equal what the run saved (a ``full`` checkpoint of the
same deterministic run is the reference for the optimizer's per-parameter form).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from _dist import CONSOLE
from checkpoint_cases import assert_same_weights, fit, make_trainer
from hf_cases import GPT2Module, fixed_input, token_loader
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from lightning_cases import NetModule, loader
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from lightning_zero import ZeroCheckpointIO, ZeroLowLevelStrategy
from lightning_zero.checkpoint import convert, save_pretrained

if TYPE_CHECKING:
    from s3_server import S3  # the type of the s3 fixture (tests/conftest.py)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]


@torch.no_grad()
def logits_of(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    out = model(fixed_input())
    return out.logits if hasattr(out, "logits") else out


def safetensors_keys(folder: Path) -> list[str]:
    keys: list[str] = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            keys.extend(f.keys())
    return keys


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, GPT2Module]]:
    """``(checkpoint dir, trained module)`` of a 2-step GPT-2 run in ``mode`` (run once per mode)."""
    made: dict[str, tuple[Path, GPT2Module]] = {}

    def run(mode: str) -> tuple[Path, GPT2Module]:
        if mode not in made:
            ckpts = tmp_path_factory.mktemp(f"gpt2_{mode}")
            module = GPT2Module()
            make_trainer(mode, ckpts, 1).fit(module, token_loader(2))
            made[mode] = ckpts, module
        return made[mode]

    return run


@pytest.fixture(scope="module")
def net_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, dict[str, torch.Tensor]]]:
    """``(checkpoint dir, trained weights)`` of a 2-step NetModule run in ``mode`` (once per mode)."""
    made: dict[str, tuple[Path, dict[str, torch.Tensor]]] = {}

    def run(mode: str) -> tuple[Path, dict[str, torch.Tensor]]:
        if mode not in made:
            ckpts = tmp_path_factory.mktemp(f"net_{mode}")
            made[mode] = ckpts, fit(make_trainer(mode, ckpts, 1))
        return made[mode]

    return run


# ---- to a Hugging Face folder -----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sharded", "local", "full"])
def test_hf_folder_from_checkpoint_gives_the_trained_logits(gpt2_run: Any, tmp_path: Path, mode: str) -> None:
    ckpts, module = gpt2_run(mode)
    folder = tmp_path / "hf"
    convert(str(ckpts / "last.ckpt"), str(folder), to="hf")
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert json.loads((folder / "config.json").read_text())["model_type"] == "gpt2"
    loaded = AutoModelForCausalLM.from_pretrained(str(folder))
    assert torch.equal(logits_of(loaded), logits_of(module))
    # The run really trained: the export is not the initial model.
    assert not torch.equal(logits_of(loaded), logits_of(GPT2Module()))


def test_hf_folder_stores_tied_weights_once(gpt2_run: Any, tmp_path: Path) -> None:
    ckpts, module = gpt2_run("sharded")
    convert(str(ckpts / "last.ckpt"), str(tmp_path), to="hf")
    keys = safetensors_keys(tmp_path)
    assert len(keys) == len(set(keys))
    assert module.model.lm_head.weight is module.model.transformer.wte.weight
    assert set(keys) == set(module.model.state_dict()) - {"lm_head.weight"}


def test_hf_folder_above_max_shard_size_is_an_indexed_set_that_loads_identically(gpt2_run: Any, tmp_path: Path) -> None:
    ckpts, module = gpt2_run("sharded")
    convert(str(ckpts / "last.ckpt"), str(tmp_path), to="hf", max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and "model.safetensors" not in shards
    assert sorted(set(index["weight_map"].values())) == shards
    assert set(index["weight_map"]) == set(safetensors_keys(tmp_path)) == set(module.model.state_dict()) - {"lm_head.weight"}
    assert torch.equal(logits_of(AutoModelForCausalLM.from_pretrained(str(tmp_path))), logits_of(module))


def test_save_pretrained_of_the_live_module_gives_the_trained_logits(gpt2_run: Any, tmp_path: Path) -> None:
    _, module = gpt2_run("sharded")
    save_pretrained(module, str(tmp_path))
    assert (tmp_path / "config.json").is_file() and (tmp_path / "model.safetensors").is_file()
    assert torch.equal(logits_of(AutoModelForCausalLM.from_pretrained(str(tmp_path))), logits_of(module))


def test_hf_folder_of_a_bf16_true_run_keeps_bf16_and_the_trained_logits(tmp_path: Path) -> None:
    trainer = Trainer(accelerator="cpu", devices=2, strategy=ZeroLowLevelStrategy(stage=2, start_method="forkserver"),
                      plugins=[ZeroCheckpointIO(mode="sharded")], precision="bf16-true",
                      callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), save_last=True)], max_epochs=1,
                      use_distributed_sampler=False, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=str(tmp_path))
    module = GPT2Module()
    trainer.fit(module, token_loader(2))
    # The main process got rank 0's bf16 weights upcast; cast back, they are the trained bf16 values.
    module.to(torch.bfloat16)
    convert(str(tmp_path / "ckpts" / "last.ckpt"), str(tmp_path / "hf"), to="hf")
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert torch.equal(logits_of(loaded), logits_of(module))


def test_hf_export_of_a_module_without_transformers_model_names_the_fix(net_run: Any, tmp_path: Path) -> None:
    ckpts, _ = net_run("sharded")
    with pytest.raises(ValueError, match="no Hugging Face config.*--to lightning"):
        convert(str(ckpts / "last.ckpt"), str(tmp_path / "hf"), to="hf")


# ---- to one Lightning file --------------------------------------------------------------------


def assert_same_tree(actual: Any, expected: Any, where: str) -> None:
    """Equal nested containers, tensors bit for bit (keys and their types included)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and list(actual) == list(expected), f"{where}: keys {list(actual)}"
        for key, value in expected.items():
            assert_same_tree(actual[key], value, f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_tree(a, e, f"{where}/{i}")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


@pytest.mark.parametrize("mode", ["local", "sharded"])
def test_convert_to_lightning_gives_a_plain_file_with_the_trained_state(net_run: Any, tmp_path: Path, mode: str) -> None:
    ckpts, trained = net_run(mode)
    out = tmp_path / "model.ckpt"
    assert convert(str(ckpts / "last.ckpt"), str(out)).endswith("model.ckpt")
    content = torch.load(out, weights_only=True)
    assert_same_weights(NetModule.load_from_checkpoint(str(out)).state_dict(), trained, f"{mode}: load_from_checkpoint")
    # PyTorch's per-parameter form, equal to what a `full` save of the same (deterministic) run holds.
    full_ckpts, full_trained = net_run("full")
    assert_same_weights(full_trained, trained, "local/sharded/full runs are the same run")
    reference = torch.load(full_ckpts / "last.ckpt", weights_only=True)
    for optimizer_state in content["optimizer_states"]:
        assert all(isinstance(k, int) for k in optimizer_state["state"])
        assert all(isinstance(i, int) for g in optimizer_state["param_groups"] for i in g["params"])
    assert_same_tree(content["optimizer_states"], reference["optimizer_states"], f"{mode}: optimizer_states")
    for key in ("lr_schedulers", "epoch", "global_step", "loops"):
        assert_same_tree(content[key], reference[key], f"{mode}: {key}")
    assert content["global_step"] == 2


def test_plain_ddp_resumes_from_a_converted_file_like_the_uninterrupted_run(
        net_run: Any, tmp_path: Path, uninterrupted: dict[str, torch.Tensor]) -> None:
    ckpts, _ = net_run("sharded")
    converted = tmp_path / "model.ckpt"
    convert(str(ckpts / "last.ckpt"), str(converted))
    # As tests/checkpoint/lightning/test_checkpoint_resume.py resumes plain DDP from a `full` file (fork: see there).
    trainer = Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(find_unused_parameters=True, start_method="fork"),
                      max_epochs=2, use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    module = NetModule(scheduler=True)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
    trainer.fit(module, loader(2, 1, 2), ckpt_path=str(converted))
    # DDP all-reduces where ZeRO reduce-scatters: equal up to float rounding.
    for name, value in uninterrupted.items():
        torch.testing.assert_close(module.state_dict()[name], value, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("mode", ["local", "sharded"])
def test_load_from_checkpoint_reads_a_commit_marker_directly(net_run: Any, mode: str) -> None:
    ckpts, trained = net_run(mode)
    marker = ckpts / "last.ckpt"
    assert "state_dict" not in torch.load(marker, weights_only=True)  # only the small commit marker
    assert_same_weights(NetModule.load_from_checkpoint(str(marker)).state_dict(), trained, f"{mode} marker")


def test_console_convert_as_a_user_types_it(net_run: Any, tmp_path: Path) -> None:
    ckpts, trained = net_run("sharded")
    out = tmp_path / "model.ckpt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([CONSOLE, "convert", str(ckpts / "last.ckpt"), str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert str(out) in done.stdout
    content = torch.load(out, weights_only=True)
    assert_same_weights(content["state_dict"], trained, "lightning-zero convert")


# ---- S3 -----------------------------------------------------------------------------------------


@pytest.mark.s3
def test_console_convert_and_load_from_checkpoint_read_an_s3_checkpoint(s3: S3, tmp_path: Path) -> None:
    prefix = s3.fresh_prefix("convert-src")
    trained = fit(make_trainer("sharded", prefix, 1, storage_options=s3.storage_options))
    out = tmp_path / "model.ckpt"
    # Credentials and endpoint from the environment (AWS_*, as conftest.py exports them), as a user has them.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    client = [] if s3.client_name == "s3fs" else ["--storage-option", f"client={s3.client_name}"]
    done = subprocess.run([CONSOLE, "convert", f"{prefix}/last.ckpt", str(out), *client],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert_same_weights(torch.load(out, weights_only=True)["state_dict"], trained, "convert from s3://")
    # And without converting, straight from the marker on S3 (credentials from the environment).
    assert_same_weights(NetModule.load_from_checkpoint(f"{prefix}/last.ckpt").state_dict(), trained,
                        "load_from_checkpoint(s3://...)")


@pytest.mark.s3
@pytest.mark.parametrize("to", ["lightning", "hf"])
def test_convert_writes_to_s3(gpt2_run: Any, s3: S3, tmp_path: Path, to: str) -> None:
    ckpts, module = gpt2_run("sharded")
    dst = s3.fresh_prefix(f"convert-{to}") + ("/model.ckpt" if to == "lightning" else "/hf")
    assert convert(str(ckpts / "last.ckpt"), dst, to=to, dst_storage_options=s3.storage_options) == dst
    if to == "lightning":
        (tmp_path / "model.ckpt").write_bytes(s3.read(dst))
        content = torch.load(tmp_path / "model.ckpt", weights_only=True)
        assert_same_weights(content["state_dict"], module.state_dict(), "to s3://")
        return
    keys = s3.keys(dst)
    assert {k.rsplit("/", 1)[-1] for k in keys} >= {"config.json", "model.safetensors"}
    for key in keys:
        (tmp_path / key.rsplit("/", 1)[-1]).write_bytes(s3.read(f"s3://{s3.bucket}/{key}"))
    assert torch.equal(logits_of(AutoModelForCausalLM.from_pretrained(str(tmp_path))), logits_of(module))
