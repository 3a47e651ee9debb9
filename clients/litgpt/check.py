"""litgpt 0.5.13's own loops on 2 CPU ranks under the bare strategy string ``"zero2"``: pre-training (resumed, and
against DDP), then full and LoRA fine-tuning from its result, each followed by ``litgpt generate``.

Run by ``check.sh`` (``make litgpt-check``) with the Python of a venv that holds litgpt and this package.

The change a user makes to each litgpt script is the one a user makes to use ``"ddp"``: the statement that
hard-codes a sharding strategy for more than one device becomes ``strategy = "zero2"``, and one line
``import lightning_zero`` goes at the top. That import is the minimum: ``Fabric(strategy="zero2")`` resolves the
name from Fabric's registry, which ``import lightning_zero`` fills, and neither litgpt nor Lightning imports the
package (the first check proves both). No plugin, no checkpoint option: every save is in the strategy's default
checkpoint mode.

1. ``make_data.py``: text files, a byte-level BPE tokenizer and a small instruction file, made here;
2. copies of ``litgpt/pretrain.py`` (its ``FSDPStrategy(...)``), ``litgpt/finetune/full.py`` (its
   ``FSDPStrategy(...)``) and ``litgpt/finetune/lora.py`` (its ``ModelParallelStrategy(...)``) with that statement
   replaced by ``strategy = "zero2"`` and ``import lightning_zero`` added; ``pretrain_ddp.py``, the pre-training
   copy with ``"ddp"``, is the control. The LoRA copy also gets ``empty_init=False``: litgpt builds the model with
   ``empty_init=(fabric.world_size > 1)``, which only a strategy that materialises and resets parameters itself
   (FSDP's) undoes, so off FSDP (``"ddp"`` alike) its LoRA weights stay uninitialised memory;
3. pre-training (``pretrain.yaml``, 20 optimizer steps, a checkpoint every 10): zero2 uninterrupted, zero2 resumed
   from the uninterrupted run's step-10 checkpoint (``--resume <file>``), DDP uninterrupted; compares the resumed
   run's final weights and AdamW state with the uninterrupted one's (bit for bit), its losses after step 10, and
   zero2's losses and weights with DDP's (float tolerance). A checkpoint holding optimizer state may be in the
   strategy's sharded layout: these comparisons read it through ``lightning-zero convert`` (the file as zero2
   wrote it is checked on its own next);
4. the final pre-training folder as zero2 wrote it: ``torch.load(final/lit_model.pth, weights_only=True)["model"]``
   into a fresh ``litgpt.GPT`` with ``strict=True``, ``litgpt generate`` on it, and litgpt's own step from
   pre-training to fine-tuning, ``litgpt convert_pretrained_checkpoint final base`` (a plain state dict, what
   ``merge_lora`` reads as the base). Should that step fail, the fine-tune runs start from a ``base`` made from
   ``lightning-zero convert``'s file instead (said in a NOTE line), so they are still checked;
5. full fine-tuning from ``base`` (``JSON`` data, 4 optimizer steps of 2 accumulated micro-batches, a checkpoint
   and litgpt's ``generate_example`` on every rank every 2 steps): exits 0, finite losses, ``final/lit_model.pth``
   (a save of the model alone) a plain file that loads into a fresh GPT strictly, holds weights other than the
   base's, and ``litgpt generate`` continues a prompt from ``final/`` as it is;
6. LoRA fine-tuning from ``base`` (the same data and steps; litgpt's ``generate_example`` on rank 0 alone):
   exits 0 (the script merges ``final/`` itself), ``lit_model.pth.lora`` holds trained, finite LoRA weights only,
   ``litgpt merge_lora`` on the step-4 folder (a user's merge) gives the same weights as the script's own merge
   of ``final/``, and ``litgpt generate`` continues a prompt from each.

Prints one ``PASS``/``FAIL`` line per check and a summary; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ZERO2_LINE = 'strategy = "zero2"'
ZERO2_IMPORT = 'import lightning_zero  # registers the strategy names "zero1" and "zero2" with Fabric\n'
DDP_LINE = 'strategy = "ddp"'
# (module, the head of the statement that chooses the strategy for more than one device)
PRETRAIN = ("litgpt.pretrain", "strategy = FSDPStrategy(")
FULL = ("litgpt.finetune.full", "strategy = FSDPStrategy(")
LORA = ("litgpt.finetune.lora", "strategy = ModelParallelStrategy(")
LORA_EMPTY_INIT = ("with fabric.init_module(empty_init=(fabric.world_size > 1)):",
                   "with fabric.init_module(empty_init=False):")
STEPS, RESUME_AT = 20, 10
FINETUNE_STEPS = 4
FINETUNE_ARGS = [
    "--devices", "2", "--precision", "32-true", "--logger_name", "csv", "--seed", "7",
    "--data", "JSON", "--data.val_split_fraction", "0.05", "--data.num_workers", "0",
    "--data.prompt_style", '{"class_path": "litgpt.prompts.Default"}',  # the instruction as it is
    "--train.max_steps", str(FINETUNE_STEPS), "--train.epochs", "5", "--train.global_batch_size", "16",
    "--train.micro_batch_size", "4", "--train.lr_warmup_steps", "1", "--train.save_interval", "2",
    "--train.log_interval", "1", "--train.max_seq_length", "64",
    "--eval.interval", "2", "--eval.max_new_tokens", "6", "--eval.max_iters", "2",
    "--eval.initial_validation", "false", "--eval.final_validation", "true",
]
RESULTS: list[tuple[bool, str]] = []


def check(ok: bool, what: str) -> bool:
    RESULTS.append((ok, what))
    print(f"{'PASS' if ok else 'FAIL'}: {what}", flush=True)
    return ok


def statement_end(source: str, start: int) -> int:
    """The index after the parenthesis that closes the first one at or after ``start``."""
    depth = 0
    for index in range(source.index("(", start), len(source)):
        depth += {"(": 1, ")": -1}.get(source[index], 0)
        if depth == 0:
            return index + 1
    raise ValueError("unbalanced parentheses")


def patched_copy(work: Path, name: str, script: tuple[str, str], line: str, imports: str = "",
                 also: tuple[str, str] | None = None) -> Path:
    """A copy of an installed litgpt script with its strategy statement (``script[1]`` up to its closing
    parenthesis) replaced by ``line``, ``imports`` before its first import, ``also`` (old, new) replaced, and the
    ``CLI(setup)`` entry the ``litgpt`` command otherwise gives it."""
    import importlib

    module, head = script
    source = Path(importlib.import_module(module).__file__).read_text()
    assert source.count(head) == 1, f"{module} no longer has one statement {head!r}"
    assert "lightning_zero" not in source
    start = source.index(head)
    replaced = source[start:statement_end(source, start)]
    source = source.replace(replaced, line)
    if also is not None:
        assert source.count(also[0]) == 1, f"{module} no longer has the line {also[0]!r}"
        source = source.replace(*also)
    first_import = re.search(r"^(import|from) ", source, re.MULTILINE).start()
    copy = work / name
    copy.write_text(source[:first_import] + imports + source[first_import:]
                    + '\n\nif __name__ == "__main__":\n    from litgpt.utils import CLI\n\n    CLI(setup)\n')
    print(f"{name}: {module}'s `{' '.join(replaced.split())}` -> `{line}`"
          + (f", `{imports.split('#')[0].strip()}` added" if imports else "")
          + (f", `{also[0].strip()}` -> `{also[1].strip()}`" if also else ""), flush=True)
    return copy


def run_script(script: Path, log_dir: Path, args: list[str], work: Path) -> float:
    """One run of ``script`` (2 ranks) with ``args``, its output in ``log_dir/run.log``; returns the wall time."""
    log_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log_dir / "run.log", "w") as log:
        done = subprocess.run([sys.executable, str(script), *args], cwd=work, stdout=log, stderr=subprocess.STDOUT,
                              timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"})
    seconds = time.perf_counter() - start
    shown = " ".join(a for a in args if a.startswith("--resume")) or ""
    if not check(done.returncode == 0, f"{script.name} {shown}-> {log_dir.name} exits 0 ({seconds:.0f} s)"):
        print((log_dir / "run.log").read_text()[-4000:])
        raise SystemExit(1)
    return seconds


def pretrain(script: Path, out_dir: Path, work: Path, *extra: str) -> float:
    return run_script(script, out_dir, ["--config", str(HERE / "pretrain.yaml"), "--out_dir", str(out_dir),
                                        "--data.init_args.train_data_path", str(work / "data"),
                                        "--tokenizer_dir", str(work / "tokenizer"), *extra], work)


def command(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """A console command of this venv (``litgpt``, ``lightning-zero``) as a user types it."""
    return subprocess.run([str(Path(sys.executable).with_name(name)), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def generate(folder: Path, work: Path, what: str) -> None:
    """``litgpt generate FOLDER`` continues "the cat"."""
    done = command("litgpt", "generate", str(folder), "--prompt", "the cat", "--max_new_tokens", "24",
                   "--precision", "32-true", cwd=work)
    text = done.stdout.strip().rpartition("}\n")[2] if done.returncode == 0 else ""  # after its settings (a dict)
    if text:
        print(f"litgpt generate {folder.parent.name}/{folder.name}: {text!r}")
    if not check(done.returncode == 0 and text.startswith("the cat") and len(text) > len("the cat"),
                 f"litgpt generate reads {what} and continues the prompt"):
        print("\n".join(f"  {line[:400]}" for line in done.stderr.strip().splitlines()[-3:]))


def examples(out_dir: Path, name: str) -> None:
    """litgpt's ``validate`` then ``generate_example`` (which prints the instruction, then the instruction
    continued) ran at every ``eval.interval``."""
    found = re.findall(r"^Validating \.\.\.\n(.+)\n(\1.+)$", (out_dir / "run.log").read_text(), re.MULTILINE)
    evals = FINETUNE_STEPS // 2
    last = f" (the last: {found[-1][1]!r})" if found else ""
    check(len(found) == evals,
          f"{name}: litgpt's validate and generate_example ran {len(found)} times of {evals}{last}")


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


def read_full(path: Path, scratch: Path) -> dict:
    """The whole checkpoint at ``path`` in Fabric's layout: the file itself when it is one, else the file
    ``lightning-zero convert`` makes of it (a checkpoint in the strategy's sharded layout)."""
    content = torch.load(path, weights_only=True)
    if "model" in content:
        return content
    scratch.mkdir(parents=True, exist_ok=True)
    target = scratch / f"{path.parent.parent.name}-{path.parent.name}.pth"
    done = command("lightning-zero", "convert", str(path), str(target), cwd=scratch)
    assert done.returncode == 0, done.stderr
    return torch.load(target, weights_only=True)


def registration_check(work: Path) -> None:
    """Importing litgpt's scripts leaves the package unimported and "zero2" unknown; ``import lightning_zero``
    alone registers it."""
    probe = (
        "import sys, lightning as L\n"
        "import litgpt.pretrain, litgpt.finetune.full, litgpt.finetune.lora, litgpt.scripts.merge_lora\n"
        "assert 'lightning_zero' not in sys.modules, 'litgpt imported lightning_zero'\n"
        "try:\n    L.Fabric(accelerator='cpu', devices=2, strategy='zero2')\nexcept ValueError:\n    pass\n"
        "else:\n    raise SystemExit('zero2 was known without the import')\n"
        "import lightning_zero\n"
        "fabric = L.Fabric(accelerator='cpu', devices=2, strategy='zero2')\n"
        "print(type(fabric.strategy).__module__ + '.' + type(fabric.strategy).__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=work, capture_output=True, text=True, timeout=300)
    check(done.returncode == 0 and "lightning_zero" in done.stdout,
          "litgpt's scripts never import lightning_zero; Fabric(strategy=\"zero2\") is refused until"
          f" `import lightning_zero` and then gives {done.stdout.strip() or '?'}")
    if done.returncode != 0:
        print(done.stderr[-2000:])


def make_base(final: Path, runs: Path, work: Path) -> Path:
    """litgpt's own step from pre-training to fine-tuning: ``convert_pretrained_checkpoint final base``. If it
    fails on the folder as zero2 wrote it, ``base`` is made from ``lightning-zero convert``'s file instead."""
    base = runs / "base"
    done = command("litgpt", "convert_pretrained_checkpoint", str(final), str(base), cwd=work)
    if check(done.returncode == 0 and "model" not in torch.load(base / "lit_model.pth", weights_only=True),
             "litgpt convert_pretrained_checkpoint makes the fine-tuning base of final/ as it is"):
        return base
    print(f"  {(done.stderr.strip().splitlines() or [done.stdout[-400:]])[-1][:400]}")
    shutil.rmtree(base, ignore_errors=True)
    plain = runs / "zero2-final-converted"
    shutil.copytree(final, plain, ignore=shutil.ignore_patterns("lit_model.pth", "_zero*"))
    converted = command("lightning-zero", "convert", str(final / "lit_model.pth"), str(plain / "lit_model.pth"),
                        cwd=work)
    done = command("litgpt", "convert_pretrained_checkpoint", str(plain), str(base), cwd=work)
    assert converted.returncode == 0 and done.returncode == 0, converted.stderr + done.stderr
    print("NOTE: the fine-tune runs start from a base made of `lightning-zero convert final/lit_model.pth`")
    return base


def finetune_full(script: Path, base: Path, runs: Path, work: Path) -> float:
    out = runs / "full"
    seconds = run_script(script, out, [str(base), "--out_dir", str(out), *FINETUNE_ARGS, "--data.json_path",
                                       str(work / "instructions.json")], work)
    trace = losses(out)
    check(len(trace) == 2 * FINETUNE_STEPS and all(map(math.isfinite, trace.values())),
          f"full: {len(trace)} finite losses (iter 1 {trace.get(1, math.nan):.3f},"
          f" iter {max(trace, default=0)} {trace.get(max(trace, default=0), math.nan):.3f})")
    examples(out, "full")
    final = out / "final" / "lit_model.pth"
    content = torch.load(final, weights_only=True)
    from litgpt import GPT, Config

    model = GPT(Config.from_file(final.parent / "model_config.yaml"))
    model.load_state_dict(content["model"], strict=True)
    trained = torch.load(base / "lit_model.pth", weights_only=True)
    moved = max((content["model"][k] - trained[k]).abs().max().item() for k in trained)
    check(list(content) == ["model"] and moved > 0,
          'full: torch.load(final/lit_model.pth, weights_only=True) is {"model": ...}, loads into a fresh GPT'
          f" strictly, and differs from the base (largest change {moved:.2e})")
    generate(final.parent, work, "full/final/ as it is")
    step = out / f"step-{FINETUNE_STEPS:06d}" / "lit_model.pth"  # fabric.save(path, state): with the optimizer
    if "model" not in torch.load(step, weights_only=True):
        print(f"NOTE: full/{step.parent.name}/lit_model.pth (the model with its optimizer state) is in the sharded"
              " layout: litgpt's tools read it after `lightning-zero convert`")
    return seconds


def finetune_lora(script: Path, base: Path, runs: Path, work: Path) -> float:
    out = runs / "lora"
    seconds = run_script(script, out, [str(base), "--out_dir", str(out), *FINETUNE_ARGS, "--data.json_path",
                                       str(work / "instructions.json"), "--lora_r", "4", "--lora_alpha", "8"], work)
    trace = losses(out)
    check(len(trace) == 2 * FINETUNE_STEPS and all(map(math.isfinite, trace.values())),
          f"lora: {len(trace)} finite losses (iter 1 {trace.get(1, math.nan):.3f},"
          f" iter {max(trace, default=0)} {trace.get(max(trace, default=0), math.nan):.3f})")
    examples(out, "lora")
    final = out / "final"
    adapter = torch.load(final / "lit_model.pth.lora", weights_only=True)["model"]
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    check(bool(lora_b) and all("lora_" in k for k in adapter)
          and all(torch.isfinite(v).all() for v in adapter.values()) and all(v.abs().max() > 0 for v in lora_b),
          f"lora: final/lit_model.pth.lora holds {len(adapter)} finite LoRA tensors, every lora_B trained off zero")
    step = out / f"step-{FINETUNE_STEPS:06d}"
    done = command("litgpt", "merge_lora", str(step), cwd=work)
    merged_by_user = torch.load(step / "lit_model.pth", weights_only=True) if done.returncode == 0 else {}
    merged_by_script = torch.load(final / "lit_model.pth", weights_only=True)
    if not check(done.returncode == 0 and same_tree(merged_by_user, merged_by_script),
                 f"lora: litgpt merge_lora {step.name}/ gives the weights the script merged into final/ itself"):
        print(done.stderr[-2000:])
    generate(final, work, "lora/final/ (merged by the script)")
    generate(step, work, f"lora/{step.name}/ (merged by litgpt merge_lora)")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=HERE / "work")
    parser.add_argument("--no-ddp", action="store_true", help="skip the DDP control run")
    args = parser.parse_args()
    work: Path = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    import lightning
    import litgpt  # noqa: F401  (the check needs it installed)

    versions = (f"litgpt {_version('litgpt')}, lightning_zero {_version('lightning-zero')}, torch {torch.__version__},"
                f" Lightning {lightning.__version__}, jsonargparse {_version('jsonargparse')},"
                f" litdata {_version('litdata')}, Python {sys.version.split()[0]}")
    print(versions, flush=True)
    if not (work / "tokenizer" / "tokenizer.json").is_file() or not (work / "instructions.json").is_file():
        subprocess.run([sys.executable, str(HERE / "make_data.py"), str(work)], check=True)
    registration_check(work)
    zero2 = patched_copy(work, "pretrain_zero2.py", PRETRAIN, ZERO2_LINE, ZERO2_IMPORT)
    ddp = patched_copy(work, "pretrain_ddp.py", PRETRAIN, DDP_LINE)
    full = patched_copy(work, "full_zero2.py", FULL, ZERO2_LINE, ZERO2_IMPORT)
    lora = patched_copy(work, "lora_zero2.py", LORA, ZERO2_LINE, ZERO2_IMPORT, also=LORA_EMPTY_INIT)
    runs = work / "runs"
    shutil.rmtree(runs, ignore_errors=True)
    scratch = runs / "converted"
    step = f"step-{RESUME_AT:08d}"

    times = {"pretrain zero2": pretrain(zero2, runs / "zero2", work)}
    final = runs / "zero2" / "final" / "lit_model.pth"
    times["pretrain zero2-resumed"] = pretrain(zero2, runs / "zero2-resumed", work,
                                               "--resume", str(runs / "zero2" / step / "lit_model.pth"))
    if not args.no_ddp:
        times["pretrain ddp"] = pretrain(ddp, runs / "ddp", work)

    uninterrupted = read_full(final, scratch)
    resumed = read_full(runs / "zero2-resumed" / "final" / "lit_model.pth", scratch)
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
        weight_diff = max((uninterrupted["model"][k] - control["model"][k]).abs().max().item()
                          for k in control["model"])
        check(control["model"].keys() == uninterrupted["model"].keys() and weight_diff < 1e-3,
              f"zero2's final weights match DDP's, same keys (largest difference {weight_diff:.2e})")

    from litgpt import GPT, Config

    as_written = torch.load(final, weights_only=True)
    model = GPT(Config.from_file(final.parent / "model_config.yaml"))
    try:
        model.load_state_dict(as_written["model"], strict=True)
        loaded = ""
    except (KeyError, RuntimeError) as exc:
        loaded = f"{type(exc).__name__}: {str(exc)[:300]}"
    if not check(not loaded, 'torch.load(final/lit_model.pth, weights_only=True)["model"] (the file as zero2 wrote'
                             " it) loads into a fresh GPT, strict=True"):
        print(f"  {loaded}; the file's keys: {sorted(as_written)}")
    generate(final.parent, work, "pretrain final/ as it is")
    base = make_base(final.parent, runs, work)

    times["full fine-tune"] = finetune_full(full, base, runs, work)
    times["LoRA fine-tune"] = finetune_lora(lora, base, runs, work)

    print(f"times: {', '.join(f'{k} {v:.0f} s' for k, v in times.items())}; all {time.perf_counter() - started:.0f} s")
    print(versions)
    failed = [what for ok, what in RESULTS if not ok]
    print(f"{len(RESULTS) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    sys.exit(main())
