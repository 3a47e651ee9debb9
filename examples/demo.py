"""``make demo``: train, resume resharded, export, and show what every checkpoint cost.

1. ``lightning-zero fit --config configs/tiny_gpt.yaml`` on 2 CPU processes: the tiny GPT of
   ``examples/tiny_gpt.py`` with ZeRO-2 and async ``sharded`` checkpoints under ``<root>/checkpoints``;
2. the same command with ``--trainer.devices 3 --ckpt_path last``: the optimizer state saved by 2
   ranks is resharded to 3 and training continues from the saved step;
3. ``lightning-zero convert`` of the last checkpoint to one ``full`` Lightning file, and, when
   ``transformers`` is installed, a short run of ``examples/hf_gpt2.py`` (TinyGPT is no transformers
   model) whose checkpoint ``convert --to hf`` turns into a ``save_pretrained`` folder;
4. a summary read back from the runs' ``metrics.csv`` (the CSVLogger of the config): steps, loss,
   every checkpoint with its size, how long it blocked the training loop and when it committed.

Run from the repository root::

    python examples/demo.py                          # what `make demo` runs (root runs/demo)
    python examples/demo.py --steps 20 --resume-steps 20 --small --root /tmp/demo   # a quicker one
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/tiny_gpt.yaml"
SMALL_MODEL = ["--model.init_args.width", "32", "--model.init_args.depth", "1", "--model.init_args.heads", "2"]
# Warnings the user of this demo cannot act on: Lightning 2.6's own pytree code under torch 2.13
# (`LeafSpec` is deprecated), printed by every rank at the first step. A `-W`-style prefix match: the
# message contains a comma, which PYTHONWARNINGS would split on.
QUIET = "ignore:`isinstance(treespec:FutureWarning"


@dataclass
class Save:
    step: int
    blocked_ms: float
    committed_after_ms: float
    write_ms: float
    rank0_bytes: float


@dataclass
class Run:
    """What one ``fit`` logged (CSVLogger's ``metrics.csv``)."""

    losses: list[tuple[int, float]]
    saves: list[Save]


def read_run(metrics_csv: Path) -> Run:
    losses: list[tuple[int, float]] = []
    saves: list[Save] = []
    with open(metrics_csv) as f:
        for row in csv.DictReader(f):
            if row.get("loss"):
                losses.append((int(row["step"]), float(row["loss"])))
            if row.get("checkpoint/blocked_ms"):
                saves.append(Save(
                    step=int(float(row["checkpoint/step"])),
                    # What the loop waited for: the save call and, later, the optimizer update's
                    # wait for the copy of the tensors (usually zero: staging ends first).
                    blocked_ms=float(row["checkpoint/blocked_ms"]) + float(row["checkpoint/staging_wait_ms"]),
                    committed_after_ms=float(row["checkpoint/committed_after_ms"]),
                    write_ms=float(row["checkpoint/write_ms"]),
                    rank0_bytes=float(row["checkpoint/bytes"]),
                ))
    return Run(losses, saves)


def command(*args: str) -> list[str]:
    # `python -m lightning_zero` is the `lightning-zero` console command; this interpreter's, so the
    # demo runs in whatever environment started it.
    return [sys.executable, "-m", "lightning_zero", *args]


def run(args: list[str], show: str) -> None:
    print(f"\n$ {show}", flush=True)
    env = {**os.environ, "PYTHONWARNINGS": ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), QUIET]))}
    done = subprocess.run(args, cwd=REPO, env=env)
    if done.returncode != 0:
        sys.exit(f"demo: `{show}` exited {done.returncode}")


def disk_size(checkpoints: Path, name: str) -> int | None:
    """Bytes of a checkpoint on disk: its commit marker and every rank's data (None once removed)."""
    marker = checkpoints / name
    if not marker.is_file():
        return None
    data = checkpoints / "_zero_data" / name
    files = [marker, *(p for p in data.rglob("*") if p.is_file())] if data.is_dir() else [marker]
    return sum(p.stat().st_size for p in files)


def megabytes(n: float | None) -> str:
    return "removed" if n is None else f"{n / 1e6:.1f} MB"  # removed: older than the newest save_top_k


def checkpoint_name(checkpoints: Path, step: int) -> str:
    """The file of the save at ``step``; a save that ``save_top_k`` has removed since shows its step."""
    found = sorted(p.name for p in checkpoints.glob(f"*-step={step}.ckpt"))
    return found[0] if found else f"step={step}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--root", default="runs/demo", help="where checkpoints, logs and the export go (emptied first)")
    parser.add_argument("--steps", type=int, default=60, help="training steps on 2 processes")
    parser.add_argument("--resume-steps", type=int, default=40, help="further steps after resuming on 3 processes")
    parser.add_argument("--small", action="store_true", help="a smaller model (for tests)")
    parser.add_argument("--hf-steps", type=int, default=20,
                        help="steps of examples/hf_gpt2.py before its checkpoint is converted to a Hugging Face"
                        " folder (0: skip; skipped anyway without transformers)")
    options = parser.parse_args()
    root = Path(options.root)
    if not root.is_absolute():
        root = REPO / root
    shutil.rmtree(root, ignore_errors=True)
    model = SMALL_MODEL if options.small else []
    common = ["--config", CONFIG, "--trainer.default_root_dir", str(root), "--trainer.log_every_n_steps", "1", *model]
    shown_root = options.root
    started = time.perf_counter()

    total = options.steps + options.resume_steps
    run(command("fit", *common, "--trainer.max_steps", str(options.steps)),
        f"lightning-zero fit --config {CONFIG} --trainer.default_root_dir {shown_root}"
        f" --trainer.max_steps {options.steps}")
    run(command("fit", *common, "--trainer.devices", "3", "--trainer.max_steps", str(total), "--ckpt_path", "last"),
        f"lightning-zero fit --config {CONFIG} --trainer.default_root_dir {shown_root} --trainer.devices 3"
        f" --trainer.max_steps {total} --ckpt_path last")

    checkpoints = root / "checkpoints"
    export = root / "export" / "model.ckpt"
    run(command("convert", str(checkpoints / "last.ckpt"), str(export)),
        f"lightning-zero convert {shown_root}/checkpoints/last.ckpt {shown_root}/export/model.ckpt")
    hf_folder = root / "export" / "hf"
    if options.hf_steps > 0 and importlib.util.find_spec("transformers") is not None:
        # TinyGPT is plain PyTorch: a Hugging Face folder needs a module holding a transformers model,
        # so the transformers example trains briefly and its checkpoint is converted.
        hf_root = root / "hf_gpt2"
        run([sys.executable, "examples/hf_gpt2.py", "--root", str(hf_root), "--steps", str(options.hf_steps),
             "--save-every", str(options.hf_steps)],
            f"python examples/hf_gpt2.py --root {shown_root}/hf_gpt2 --steps {options.hf_steps}"
            f" --save-every {options.hf_steps}")
        run(command("convert", str(hf_root / "checkpoints" / "last.ckpt"), str(hf_folder), "--to", "hf"),
            f"lightning-zero convert {shown_root}/hf_gpt2/checkpoints/last.ckpt {shown_root}/export/hf --to hf")
        hf_line = (f"  hf export    {shown_root}/export/hf/  (a transformers GPT-2 trained by examples/hf_gpt2.py:"
                   " AutoModelForCausalLM.from_pretrained reads it)")
    else:
        reason = "--hf-steps 0" if options.hf_steps <= 0 else "transformers is not installed"
        hf_line = f"  skipped      the Hugging Face export ({reason})"

    train = read_run(root / "logs" / "version_0" / "metrics.csv")
    resumed = read_run(root / "logs" / "version_1" / "metrics.csv")
    first_step = resumed.losses[0][0] if resumed.losses else None
    print("\n" + "=" * 78)
    print(f"lightning_zero demo finished in {time.perf_counter() - started:.0f} s\n")
    print(f"{'run':<8} {'processes':>9} {'steps':>12} {'loss first -> last':>22}")
    for label, procs, steps, logged in (("train", 2, f"0 -> {options.steps}", train),
                                        ("resume", 3, f"{options.steps} -> {total}", resumed)):
        loss = f"{logged.losses[0][1]:.3f} -> {logged.losses[-1][1]:.3f}" if logged.losses else "-"
        print(f"{label:<8} {procs:>9} {steps:>12} {loss:>22}")
    print(f"(resumed run's first logged step: {first_step}; ZeRO-2 optimizer state resharded 2 -> 3 ranks)\n")

    print(f"{'checkpoint (async, sharded)':<30} {'procs':>5} {'on disk':>9} {'blocked loop':>13}"
          f" {'committed after':>16}")
    for procs, logged in ((2, train), (3, resumed)):
        for save in logged.saves:
            name = checkpoint_name(checkpoints, save.step)
            print(f"{name:<30} {procs:>5} {megabytes(disk_size(checkpoints, name)):>9}"
                  f" {save.blocked_ms:>10.1f} ms {save.committed_after_ms:>13.0f} ms")
    print("(blocked loop: the training thread in save_checkpoint plus the next optimizer step's wait for the copy;"
          "\n committed after: from the save call until the commit marker was written, while training went on)\n")

    print("files:")
    print(f"  checkpoints  {shown_root}/checkpoints/  (last.ckpt -> {os.path.basename(os.path.realpath(checkpoints / 'last.ckpt'))})")
    print(f"  metrics      {shown_root}/logs/version_0/metrics.csv, version_1/metrics.csv  (loss, checkpoint/*)")
    print(f"  export       {shown_root}/export/model.ckpt  ({megabytes(export.stat().st_size)}, one full Lightning file:"
          " torch.load / load_from_checkpoint, no lightning_zero needed)")
    print(hf_line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
