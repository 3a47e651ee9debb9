"""litgpt 0.5.13's own pre-training script on 2 CPU ranks under ``zero2``, resumed, then ``litgpt generate``.

Run by ``check.sh`` (``make litgpt-check``) with the Python of a venv that holds litgpt and this package:

1. ``make_data.py``: text files and a byte-level BPE tokenizer made here;
2. ``pretrain_zero2.py``: a copy of ``litgpt/pretrain.py`` with its one ``FSDPStrategy(...)`` line (the
   strategy it hard-codes for more than one device) replaced by ``ZeroLowLevelStrategy(stage=2, ...)``
   with a ``full`` mode checkpoint plugin (and the import of both), so ``lit_model.pth`` is the file
   Fabric's DDP writes; and
   ``pretrain_ddp.py``, the same copy with ``"ddp"``, the control;
3. runs, each ``pretrain.yaml`` (20 optimizer steps, a checkpoint every 10): zero2 uninterrupted, zero2
   resumed from the uninterrupted run's step-10 checkpoint (``--resume <file>``), DDP uninterrupted;
4. compares: the resumed run's final checkpoint equals the uninterrupted one's (weights and AdamW state),
   its losses after step 10 equal the uninterrupted run's, and zero2's losses and weights match DDP's within
   float tolerance;
5. ``torch.load(final/lit_model.pth, weights_only=True)["model"]`` into a fresh ``litgpt.GPT`` with
   ``strict=True``, and ``litgpt generate`` on the final folder as it is (no conversion).

Prints one ``PASS``/``FAIL`` line per check and a summary; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
FSDP_LINE = 'strategy = FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full", sharding_strategy="HYBRID_SHARD")'
ZERO2_LINE = 'strategy = ZeroLowLevelStrategy(stage=2, checkpoint_io=ZeroCheckpointIO(mode="full"))'
ZERO2_IMPORT = "from lightning_zero import ZeroCheckpointIO\nfrom lightning_zero.fabric import ZeroLowLevelStrategy\n"
DDP_LINE = 'strategy = "ddp"'
STEPS, RESUME_AT = 20, 10
RESULTS: list[tuple[bool, str]] = []


def check(ok: bool, what: str) -> bool:
    RESULTS.append((ok, what))
    print(f"{'PASS' if ok else 'FAIL'}: {what}", flush=True)
    return ok


def patched_copy(work: Path, name: str, line: str, imports: str = "") -> Path:
    """A copy of the installed litgpt/pretrain.py with its FSDPStrategy line replaced by ``line`` and
    ``imports`` before its first import."""
    import litgpt.pretrain

    source = Path(litgpt.pretrain.__file__).read_text()
    assert source.count(FSDP_LINE) == 1, f"litgpt/pretrain.py no longer has the line {FSDP_LINE!r}"
    indent = re.search(rf"^( *){re.escape(FSDP_LINE)}", source, re.MULTILINE).group(1)
    copy = work / name
    source = source.replace(indent + FSDP_LINE, indent + line)
    first_import = re.search(r"^(import|from) ", source, re.MULTILINE).start()
    copy.write_text(source[:first_import] + imports + source[first_import:]
                    + '\n\nif __name__ == "__main__":\n    from litgpt.utils import CLI\n\n    CLI(setup)\n')
    return copy


def pretrain(script: Path, out_dir: Path, work: Path, *extra: str) -> float:
    """One run of ``script`` (2 ranks), its output in ``out_dir/run.log``; returns the wall time."""
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(script), "--config", str(HERE / "pretrain.yaml"), "--out_dir", str(out_dir),
               "--data.init_args.train_data_path", str(work / "data"), "--tokenizer_dir", str(work / "tokenizer"),
               *extra]
    start = time.perf_counter()
    with open(out_dir / "run.log", "w") as log:
        done = subprocess.run(command, cwd=work, stdout=log, stderr=subprocess.STDOUT, timeout=1800,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    seconds = time.perf_counter() - start
    output = (out_dir / "run.log").read_text()
    if not check(done.returncode == 0, f"{script.name} {' '.join(extra)} -> {out_dir.name} exits 0 ({seconds:.0f} s)"):
        print(output[-4000:])
        raise SystemExit(1)
    return seconds


def losses(out_dir: Path) -> dict[int, float]:
    """iter -> training loss, from the CSV logger's metrics (rank 0)."""
    [metrics] = out_dir.rglob("metrics.csv")
    with open(metrics) as f:
        return {int(float(row["iter"])): float(row["loss"]) for row in csv.DictReader(f) if row.get("loss")}


def same_tree(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same_tree, a, b))
    return a == b


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=HERE / "work")
    parser.add_argument("--no-ddp", action="store_true", help="skip the DDP control run")
    args = parser.parse_args()
    work: Path = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)

    import lightning
    import litgpt  # noqa: F401  (the check needs it installed)

    import lightning_zero  # noqa: F401

    versions = (f"litgpt {_version('litgpt')}, lightning_zero {_version('lightning-zero')}, torch {torch.__version__},"
                f" Lightning {lightning.__version__}, jsonargparse {_version('jsonargparse')},"
                f" litdata {_version('litdata')}, Python {sys.version.split()[0]}")
    print(versions, flush=True)
    if not (work / "tokenizer" / "tokenizer.json").is_file():
        subprocess.run([sys.executable, str(HERE / "make_data.py"), str(work)], check=True)
    zero2 = patched_copy(work, "pretrain_zero2.py", ZERO2_LINE, ZERO2_IMPORT)
    ddp = patched_copy(work, "pretrain_ddp.py", DDP_LINE)
    runs = work / "runs"
    subprocess.run(["rm", "-rf", str(runs)], check=True)
    step = f"step-{RESUME_AT:08d}"

    times = {"zero2": pretrain(zero2, runs / "zero2", work)}
    final = runs / "zero2" / "final" / "lit_model.pth"
    times["zero2-resumed"] = pretrain(zero2, runs / "zero2-resumed", work,
                                      "--resume", str(runs / "zero2" / step / "lit_model.pth"))
    if not args.no_ddp:
        times["ddp"] = pretrain(ddp, runs / "ddp", work)

    uninterrupted = torch.load(final, weights_only=True)
    resumed = torch.load(runs / "zero2-resumed" / "final" / "lit_model.pth", weights_only=True)
    check(uninterrupted["iter_num"] == 2 * STEPS and uninterrupted["step_count"] == STEPS,
          f"the final checkpoint is at iter {uninterrupted['iter_num']}, step {uninterrupted['step_count']}")
    check("Resuming training from" in (runs / "zero2-resumed" / "run.log").read_text(), "the second run resumed")
    check(same_tree(uninterrupted["model"], resumed["model"]),
          f"resumed from step {RESUME_AT}: the final weights equal the uninterrupted run's bit for bit")
    check(same_tree(uninterrupted["optimizer"], resumed["optimizer"]),
          "resumed: the final AdamW state equals the uninterrupted run's bit for bit")
    loss_zero2, loss_resumed = losses(runs / "zero2"), losses(runs / "zero2-resumed")
    after = {i: v for i, v in loss_zero2.items() if i > 2 * RESUME_AT}
    check(bool(after) and {i: loss_resumed.get(i) for i in after} == after,
          f"resumed: the losses of iters {min(after)}-{max(after)} equal the uninterrupted run's")
    first = min(loss_zero2)  # the CSV logger writes every log_interval iters
    print(f"zero2 loss: iter {first} {loss_zero2[first]:.4f}, iter {2 * STEPS} {loss_zero2[2 * STEPS]:.4f}")
    check(loss_zero2[2 * STEPS] < loss_zero2[first] - 1.0, "zero2 trains: the loss falls by more than 1")
    if not args.no_ddp:
        control = torch.load(runs / "ddp" / "final" / "lit_model.pth", weights_only=True)
        loss_ddp = losses(runs / "ddp")
        worst = max(abs(loss_zero2[i] - loss_ddp[i]) for i in loss_ddp)
        check(loss_zero2.keys() == loss_ddp.keys() and worst < 1e-3,
              f"zero2's losses match DDP's at every iter (largest difference {worst:.2e})")
        weight_diff = max((uninterrupted["model"][k] - control["model"][k]).abs().max().item() for k in control["model"])
        check(control["model"].keys() == uninterrupted["model"].keys() and weight_diff < 1e-3,
              f"zero2's final weights match DDP's, same keys (largest difference {weight_diff:.2e})")

    from litgpt import GPT, Config

    model = GPT(Config.from_file(final.parent / "model_config.yaml"))
    model.load_state_dict(torch.load(final, weights_only=True)["model"], strict=True)
    check(True, 'torch.load(final/lit_model.pth, weights_only=True)["model"] loads into a fresh GPT, strict=True')
    litgpt_command = Path(sys.executable).with_name("litgpt")
    generated = subprocess.run([str(litgpt_command), "generate", str(final.parent), "--prompt", "the cat",
                                "--max_new_tokens", "24", "--precision", "32-true"], cwd=work, capture_output=True,
                               text=True, timeout=600)
    text = generated.stdout.strip().rpartition("}\n")[2]  # litgpt prints its settings (a dict) first
    print(f"litgpt generate: {text!r}")
    check(generated.returncode == 0 and text.startswith("the cat") and len(text) > len("the cat"),
          "litgpt generate reads final/ as it is and continues the prompt")
    if generated.returncode != 0:
        print(generated.stderr[-3000:])

    print(f"times: {', '.join(f'{k} {v:.0f} s' for k, v in times.items())}")
    print(versions)
    failed = [what for ok, what in RESULTS if not ok]
    print(f"{len(RESULTS) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    sys.exit(main())
