"""Hostile files and leaked secrets.

A checkpoint someone downloaded may carry a pickle that runs code: every load path (``load``,
the one-process reader behind ``convert`` and ``load_from_checkpoint``) refuses it without running it.
Credentials given in ``storage_options`` (Python or a LightningCLI YAML) appear in no file of the
checkpoint, no marker, no saved ``config.yaml``, no error message and no repr.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from fault_cases import tree

from lightning_zero.checkpoint import (
    CheckpointCorruptError,
    CheckpointSaveError,
    ZeroCheckpointIO,
    load,
    read_lightning_checkpoint,
    save,
)

if TYPE_CHECKING:
    from s3_server import S3  # the type of the s3 fixture (tests/conftest.py)

pytestmark = pytest.mark.usefixtures("one_rank")  # one in-process gloo rank (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]


class RunsCode:
    """Unpickling this creates ``witness``."""

    def __init__(self, witness: Path) -> None:
        self.witness = witness

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.witness,))


def version_dir(path: Path) -> Path:
    (version,) = (path.parent / "_zero_data" / path.name).iterdir()
    return version


def crafted(witness: Path, with_tensor: bool = True) -> bytes:
    """A torch.save file (zip) whose pickle builds :class:`RunsCode` (a marker has no tensor)."""
    import io

    buffer = io.BytesIO()
    torch.save({"state_dict": {"w": torch.zeros(3)} if with_tensor else {}, "payload": RunsCode(witness)}, buffer)
    return buffer.getvalue()


def target_of(mode: str, path: Path) -> Path:
    if mode == "full":
        return path
    if mode == "local":
        return version_dir(path) / "rank00000-of-00001.pt"
    return version_dir(path) / "objects.pt"


@pytest.mark.parametrize("mode", ["local", "sharded", "full"])
def test_a_crafted_pickle_in_a_checkpoint_file_never_runs(tmp_path: Path, mode: str) -> None:
    path = tmp_path / f"{mode}.ckpt"
    save(tree(1.0), str(path), mode=mode)
    witness = tmp_path / "code-ran"
    target_of(mode, path).write_bytes(crafted(witness))
    with pytest.raises(CheckpointCorruptError, match=r"is not a valid checkpoint: its .* holds getattr.*not"
                                                     r" unpickled") as error:
        load(tree(0.0), str(path))
    assert "weights_only=False will likely succeed" not in str(error.value)
    with pytest.raises((CheckpointCorruptError, ValueError, KeyError)):
        read_lightning_checkpoint(str(path))
    assert not witness.exists(), "a load path ran the pickle's code"


def test_a_crafted_commit_marker_never_runs(tmp_path: Path) -> None:
    path = tmp_path / "sharded.ckpt"
    save(tree(1.0), str(path), mode="sharded")
    witness = tmp_path / "code-ran"
    path.write_bytes(crafted(witness, with_tensor=False))
    with pytest.raises(CheckpointCorruptError, match=r"is not a valid checkpoint: its commit marker holds getattr"):
        load(tree(0.0), str(path))
    assert not witness.exists()


def test_a_crafted_trainer_state_with_valid_checksums_never_runs(tmp_path: Path) -> None:
    """The attacker rebuilt the file with matching CRCs: the trainer blob is still loaded weights-only."""
    import io

    witness = tmp_path / "code-ran"
    buffer = io.BytesIO()
    torch.save({"epoch": 0, "payload": RunsCode(witness)}, buffer)
    state = {**tree(1.0), "trainer": buffer.getvalue(), "model": {}}
    path = tmp_path / "local.ckpt"
    save(state, str(path), mode="local")
    with pytest.raises(CheckpointCorruptError, match=r"trainer state .* is not loaded: checkpoints are read with"
                                                     r" weights_only=True"):
        read_lightning_checkpoint(str(path))
    assert not witness.exists()


# ---- credentials ---------------------------------------------------------------------------------

KEY, SECRET = "AKIALEAKCHECK0000042", "s3cr3t-Do-Not-Leak-0042"


def secret_options(s3: S3) -> dict[str, Any]:
    """moto accepts any key pair while it does not enforce IAM. Keys in ``storage_options`` are s3fs's:
    s3torchconnector refuses them (tests/checkpoint/store/test_s3_clients.py) and reads a profile instead."""
    if s3.client_name != "s3fs":
        pytest.skip("s3torchconnector takes no keys in storage_options")
    return {"endpoint_url": s3.endpoint_url, "key": KEY, "secret": SECRET}


@pytest.mark.s3
@pytest.mark.parametrize("mode", ["local", "sharded", "full"])
def test_credentials_appear_in_no_checkpoint_file_error_or_repr(s3: S3, mode: str) -> None:
    prefix = s3.fresh_prefix(f"secrets-{mode}")
    options = secret_options(s3)
    save(tree(1.0), f"{prefix}/last.ckpt", mode=mode, storage_options=options)
    for key in s3.keys(prefix):
        data = s3.read(s3.url(key))
        assert KEY.encode() not in data and SECRET.encode() not in data, f"{key} holds the credentials"
    plugin = ZeroCheckpointIO(mode=mode, storage_options=options)
    assert SECRET not in repr(plugin) and KEY not in repr(plugin)
    from lightning_zero.checkpoint import async_save, maybe_finalize_async_calls

    async_save(tree(1.0), "s3://no-such-bucket-secrets/last.ckpt", mode=mode, storage_options=options)
    with pytest.raises(CheckpointSaveError) as error:
        maybe_finalize_async_calls(blocking=True)
    assert SECRET not in str(error.value) and KEY not in str(error.value)


CLI_CONFIG = """
seed_everything: 7
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 2
  enable_progress_bar: false
  default_root_dir: {root}
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args:
      save_dir: {root}
      name: run
      version: 0
  strategy:
    class_path: lightning_zero.ZeroLowLevelStrategy
  plugins:
    - class_path: lightning_zero.ZeroCheckpointIO
      init_args:
        mode: sharded
        storage_options:
          endpoint_url: {endpoint}
          key: {key}
          secret: {secret}
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        dirpath: {dirpath}
        every_n_train_steps: 1
        save_last: true
model:
  class_path: examples.tiny_gpt.TinyGPT
  init_args:
    vocab: 64
    context: 8
    width: 16
    depth: 1
    heads: 2
data:
  class_path: examples.tiny_gpt.PatternData
  init_args:
    context: 8
    batch_size: 4
"""


@pytest.mark.s3
@pytest.mark.slow
def test_credentials_in_a_cli_yaml_are_masked_in_the_saved_config_and_appear_nowhere_else(
        s3: S3, tmp_path: Path) -> None:
    secret_options(s3)  # s3fs's keys in the YAML
    prefix = s3.fresh_prefix("cli-secrets")
    config = tmp_path / "config.yaml"
    config.write_text(CLI_CONFIG.format(root=tmp_path / "run", endpoint=s3.endpoint_url, key=KEY, secret=SECRET,
                                        dirpath=prefix))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "lightning_zero", "fit", "--config", str(config)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    logs = done.stdout + done.stderr
    assert SECRET not in logs and KEY not in logs, "the credentials were logged"
    saved = list((tmp_path / "run").rglob("config.yaml"))
    assert saved, "LightningCLI saved no config"
    for path in [*saved, *(tmp_path / "run").rglob("hparams.yaml")]:
        text = path.read_text()
        assert SECRET not in text and KEY not in text, f"{path} holds the credentials"
    assert "***" in saved[0].read_text()
    keys = s3.keys(prefix)
    assert any(k.endswith("last.ckpt") for k in keys), keys
    for key in keys:
        data = s3.read(s3.url(key))
        assert KEY.encode() not in data and SECRET.encode() not in data, f"{key} holds the credentials"
