"""The ``lightning-zero`` console command exactly as the README prints it, from the repository root.

Per mode: ``fit --config configs/tiny_gpt.yaml`` (2 processes, 20 steps: one checkpoint) with a
smaller model given on the command line; then ``validate`` and ``test --ckpt_path <last.ckpt>`` on
one process *without* the model options (the CLI must read them from the checkpoint), whose losses
must equal the trained weights' loss computed here; then ``fit --ckpt_path <last.ckpt>``, which must
continue from step 20. Commands run as a user types them: the venv's script, ``PYTHONPATH`` unset.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from _dist import CONSOLE

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/tiny_gpt.yaml"
SAVE_EVERY = 20  # the config's ModelCheckpoint every_n_train_steps
SMALL_MODEL = ["--model.init_args.width", "32", "--model.init_args.depth", "1", "--model.init_args.heads", "2"]


def lightning_zero(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([CONSOLE, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"lightning-zero {' '.join(args)} exited {done.returncode}:\n{output[-4000:]}"
    assert "<lightning.pytorch.cli.LightningCLI object" not in output
    return done


def csv_logger(root: Path, name: str) -> list[str]:
    return ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.init_args.save_dir", str(root),
            "--trainer.logger.init_args.name", name, "--trainer.logger.init_args.version", "0"]


def logged(root: Path, name: str, metric: str) -> float:
    with open(root / name / "version_0" / "metrics.csv") as f:
        values = [float(row[metric]) for row in csv.DictReader(f) if row.get(metric)]
    assert len(values) == 1, values
    return values[0]


def test_interpolation_follows_command_line_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_zero.cli import run_cli

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", ["lightning-zero"])
    with pytest.raises(SystemExit) as exit_info:
        run_cli(["fit", "--config", CONFIG, "--trainer.default_root_dir", str(tmp_path), "--data.init_args.context", "8",
                 "--print_config"])
    assert exit_info.value.code == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["trainer"]["callbacks"][0]["init_args"]["dirpath"] == f"{tmp_path}/checkpoints"
    assert config["model"]["init_args"]["context"] == 8


def test_convert_of_a_path_without_checkpoint_exits_1_with_the_message_not_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_zero.cli import main

    assert main(["convert", str(tmp_path / "missing.ckpt"), str(tmp_path / "out.ckpt")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("lightning-zero convert: error: No checkpoint at") and "Traceback" not in err
    assert not (tmp_path / "out.ckpt").exists()


def test_convert_storage_options_are_key_value_pairs_for_the_store(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_zero.cli import _storage_options, main

    assert _storage_options(["client=s3torchconnector", "anon=true", "part_size=8388608"]) == {
        "client": "s3torchconnector", "anon": True, "part_size": 8388608}
    assert _storage_options([]) is None
    assert main(["convert", str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt"), "--storage-option", "client"]) == 1
    assert "give KEY=VALUE" in capsys.readouterr().err
    assert main(["convert", "s3://bucket/a.ckpt", str(tmp_path / "b.ckpt"), "--storage-option", "client=boto"]) == 1
    assert "'boto' is not a client for s3:// paths" in capsys.readouterr().err


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, str]]:
    """``(run root, fit's output)`` of the README's fit in ``mode``, 20 steps (run once per mode)."""
    made: dict[str, tuple[Path, str]] = {}

    def run(mode: str) -> tuple[Path, str]:
        if mode not in made:
            root = tmp_path_factory.mktemp(f"cli_{mode}")
            done = lightning_zero("fit", "--config", CONFIG, "--trainer.default_root_dir", str(root),
                                  "--trainer.max_steps", str(SAVE_EVERY), "--trainer.plugins.mode", mode, *SMALL_MODEL)
            made[mode] = root, done.stdout + done.stderr
        return made[mode]

    return run


@pytest.fixture(scope="module")
def held_out_loss(monkeypatch_module: pytest.MonkeyPatch) -> Callable[[Path], float]:
    """The trained weights' loss on the config's held-out data, computed in this process."""
    monkeypatch_module.syspath_prepend(str(REPO))
    import lightning_zero  # noqa: F401  (makes load_from_checkpoint follow commit markers)
    from examples.tiny_gpt import PatternData, TinyGPT

    def loss(checkpoint: Path) -> float:
        model = TinyGPT.load_from_checkpoint(str(checkpoint)).eval()
        data = PatternData(context=model.hparams.context, batch_size=16)
        with torch.no_grad():
            losses = [model.loss(batch) for batch in data.val_dataloader()]
        return torch.stack(losses).mean().item()

    return loss


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


MODES = ["sharded", "local", "full"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_readme_fit_exits_0_and_checkpoints_under_the_given_root(trained: Any, mode: str) -> None:
    root, output = trained(mode)
    checkpoints = root / "checkpoints"
    assert (checkpoints / "last.ckpt").is_file() and (checkpoints / f"epoch=0-step={SAVE_EVERY}.ckpt").is_file()
    assert f"step   {SAVE_EVERY}" in output  # the example's progress lines
    # LightningCLI saves its config in the logger's directory (the config's CSVLogger under the root).
    saved_config = yaml.safe_load((root / "logs" / "version_0" / "config.yaml").read_text())
    assert saved_config["trainer"]["callbacks"][0]["init_args"]["dirpath"] == str(checkpoints)
    assert saved_config["trainer"]["plugins"][0]["init_args"]["mode"] == mode


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_validate_and_test_from_a_checkpoint_file_give_the_trained_loss(
        trained: Any, held_out_loss: Callable[[Path], float], mode: str) -> None:
    root, _ = trained(mode)
    last = root / "checkpoints" / "last.ckpt"
    logs = root / "eval_logs"
    for stage in ("validate", "test"):
        # No model options and the config's plugin (sharded): the CLI must build the model from the
        # checkpoint's hyper-parameters, and the load must find the mode in the checkpoint.
        lightning_zero(stage, "--config", CONFIG, "--ckpt_path", str(last), "--trainer.devices", "1",
                       *csv_logger(logs, stage))
    expected = held_out_loss(last)
    assert logged(logs, "validate", "val_loss") == pytest.approx(expected, rel=1e-5)
    assert logged(logs, "test", "test_loss") == logged(logs, "validate", "val_loss")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_fit_resumes_from_a_checkpoint_file(trained: Any, tmp_path: Path, mode: str) -> None:
    root, _ = trained(mode)
    done = lightning_zero("fit", "--config", CONFIG, "--ckpt_path", str(root / "checkpoints" / "last.ckpt"),
                          "--trainer.default_root_dir", str(tmp_path), "--trainer.max_steps", str(SAVE_EVERY + 1),
                          "--trainer.plugins.mode", mode)
    output = done.stdout + done.stderr
    assert "Restored all states from the checkpoint" in output, output[-3000:]
    assert f"start at step {SAVE_EVERY};" in output
    assert f"`max_steps={SAVE_EVERY + 1}` reached" in output
