"""Every YAML in ``configs/`` runs through the ``lightning-zero`` console command, from the repository
root, for two steps, and writes the checkpoints it promises (the S3 one into the local moto server).

The only change made to a config is its save frequency (the configs save every 10-30 steps; here every
step or two) and a smaller model; both go through a copy of the file, so the shipped YAML, its
interpolations included, is what runs. The interpolation of ``${trainer.default_root_dir}`` under a
command-line override is tested in test_cli.py.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import yaml
from _dist import CONSOLE

if TYPE_CHECKING:
    from s3_server import S3  # the type of the s3 fixture (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
SMALL_MODEL = ["--model.init_args.width", "32", "--model.init_args.depth", "1", "--model.init_args.heads", "2"]
STEPS = 2


def every_step(config: str, tmp_path: Path, every: list[int]) -> Path:
    """A copy of ``configs/<config>`` whose ModelCheckpoint callbacks save every ``every[i]`` steps."""
    data = yaml.safe_load((REPO / "configs" / config).read_text())
    checkpoints = [c for c in data["trainer"]["callbacks"] if c["class_path"].endswith("ModelCheckpoint")]
    assert len(checkpoints) == len(every)
    for callback, n in zip(checkpoints, every):
        callback["init_args"]["every_n_train_steps"] = n
    copy = tmp_path / config
    copy.write_text(yaml.safe_dump(data, sort_keys=False))
    return copy


def lightning_zero(config: Path, root: Path, *args: str, env: dict[str, str] | None = None) -> str:
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    environment.update(env or {})
    done = subprocess.run([CONSOLE, "fit", "--config", str(config),
                           "--trainer.max_steps", str(STEPS), "--trainer.default_root_dir", str(root), *SMALL_MODEL,
                           "--trainer.enable_model_summary", "false", *args],
                          cwd=REPO, env=environment, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{config.name} exited {done.returncode}:\n{output[-4000:]}"
    return output


def marker(path: Path | bytes) -> dict[str, Any]:
    """A commit marker as plain ``torch.load`` reads it: Lightning's fields, and ours (mode, world size)."""
    import io

    from lightning_zero.checkpoint.store.storage import MARKER_KEY

    content = torch.load(io.BytesIO(path) if isinstance(path, bytes) else path, weights_only=True)
    return {**content, **content[MARKER_KEY]}


@pytest.mark.slow
@pytest.mark.parametrize(("config", "stage", "dtype"), [("zero1.yaml", 1, "float32"), ("zero2.yaml", 2, "float32"),
                                                       ("zero2_bf16.yaml", 2, "bfloat16")])
def test_strategy_configs_train_and_save_a_sharded_checkpoint(tmp_path: Path, config: str, stage: int,
                                                              dtype: str) -> None:
    root = tmp_path / "run"
    lightning_zero(every_step(config, tmp_path, [STEPS]), root)
    [saved_config] = root.rglob("config.yaml")  # LightningCLI's copy, in the default logger's directory
    assert yaml.safe_load(saved_config.read_text())["trainer"]["strategy"]["init_args"]["stage"] == stage
    last = root / "checkpoints" / f"epoch=0-step={STEPS}.ckpt"
    saved = marker(last)
    assert saved["mode"] == "sharded" and saved["world_size"] == 2 and saved["global_step"] == STEPS
    from lightning_zero.checkpoint import read_lightning_checkpoint

    weights = read_lightning_checkpoint(str(last), optimizer=False)["state_dict"]
    assert {str(v.dtype) for v in weights.values()} == {f"torch.{dtype}"}


@pytest.mark.slow
def test_sharded_local_then_resume_config_continues_from_the_saved_step_at_another_world_size(tmp_path: Path) -> None:
    root = tmp_path / "run"
    lightning_zero(every_step("sharded_local.yaml", tmp_path, [1]), root)
    checkpoints = root / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("*.ckpt")) == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt",
                                                                   "last.ckpt"]
    assert os.readlink(checkpoints / "last.ckpt") == "epoch=0-step=2.ckpt"
    output = lightning_zero(every_step("resume.yaml", tmp_path, [1]), root, "--trainer.max_steps", str(STEPS + 1),
                            "--trainer.devices", "1")  # resharded 2 -> 1
    assert f"Restored all states from the checkpoint at {checkpoints / 'last.ckpt'}" in output
    assert marker(checkpoints / f"epoch=0-step={STEPS + 1}.ckpt")["world_size"] == 1
    assert os.readlink(checkpoints / "last.ckpt") == f"epoch=0-step={STEPS + 1}.ckpt"  # re-pointed, no last-v1
    assert not (checkpoints / "last-v1.ckpt").exists()


@pytest.mark.slow
def test_frequent_and_archive_config_writes_both_callbacks_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "run"
    lightning_zero(every_step("frequent_and_archive.yaml", tmp_path, [1, 2]), root)
    recent, archive = root / "checkpoints" / "recent", root / "checkpoints" / "archive"
    assert sorted(p.name for p in recent.glob("*.ckpt")) == ["epoch=0-step=2.ckpt", "last.ckpt"]  # top 1
    assert sorted(p.name for p in archive.glob("*.ckpt")) == ["epoch=0-step=2.ckpt"]
    assert marker(archive / "epoch=0-step=2.ckpt")["mode"] == "sharded"


@pytest.mark.slow
@pytest.mark.s3
def test_sharded_s3_config_writes_to_the_bucket_from_the_environment(tmp_path: Path, s3: S3) -> None:
    # BUCKET, AWS_ENDPOINT_URL and the credentials come from the environment, as the config says (for either
    # client: s3torchconnector takes the endpoint from the environment as s3fs does).
    config = every_step("sharded_s3.yaml", tmp_path, [STEPS])
    if s3.client_name != "s3fs":
        data = yaml.safe_load(config.read_text())
        data["trainer"]["plugins"][0]["init_args"]["storage_options"] = {"client": s3.client_name}
        config.write_text(yaml.safe_dump(data, sort_keys=False))
    output = lightning_zero(config, tmp_path / "run", env={"BUCKET": s3.bucket, "AWS_ENDPOINT_URL": s3.endpoint_url})
    keys = s3.keys("tiny_gpt/checkpoints/")
    assert f"tiny_gpt/checkpoints/epoch=0-step={STEPS}.ckpt" in keys and "tiny_gpt/checkpoints/last.ckpt" in keys
    assert any(k.startswith("tiny_gpt/checkpoints/_zero_data/") for k in keys)
    assert marker(s3.read(s3.url(f"tiny_gpt/checkpoints/epoch=0-step={STEPS}.ckpt")))["mode"] == "sharded"
    assert "Traceback" not in output


@pytest.mark.slow
def test_hybrid_config_shards_within_pairs_and_saves_one_copy(tmp_path: Path) -> None:
    root = tmp_path / "run"
    lightning_zero(every_step("hybrid.yaml", tmp_path, [STEPS]), root)
    saved = marker(root / "checkpoints" / f"epoch=0-step={STEPS}.ckpt")
    assert saved["mode"] == "sharded" and saved["world_size"] == 4 and saved["shard_group_size"] == 2
    from lightning_zero.checkpoint import read_lightning_checkpoint

    # Readable whole in one process, like any sharded checkpoint.
    whole = read_lightning_checkpoint(str(root / "checkpoints" / f"epoch=0-step={STEPS}.ckpt"))
    assert whole["global_step"] == STEPS and whole["optimizer_states"][0]["state"]


@pytest.mark.slow
def test_tiered_config_saves_every_step_locally_and_persists_the_last_one(tmp_path: Path) -> None:
    root = tmp_path / "run"
    lightning_zero(every_step("tiered.yaml", tmp_path, [1]), root)
    local = root / "local_tier" / "node0"
    assert sorted(p.name for p in local.glob("*.ckpt")) == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]
    assert marker(local / "epoch=0-step=2.ckpt")["mode"] == "local"
    assert marker(local / "epoch=0-step=2.ckpt")["tier"]["ranks"] == [0, 1]
    # persist_every: 10: only the last save of fit reached the durable tier, in sharded form
    durable = root / "checkpoints"
    assert sorted(p.name for p in durable.glob("*.ckpt")) == ["epoch=0-step=2.ckpt"]
    assert marker(durable / "epoch=0-step=2.ckpt")["mode"] == "sharded"
    output = lightning_zero(every_step("tiered.yaml", tmp_path, [1]), root, "--ckpt_path", "last",
                            "--trainer.max_steps", str(STEPS + 1))
    assert "resumes from the local tier" in output
    assert (local / f"epoch=0-step={STEPS + 1}.ckpt").exists()
