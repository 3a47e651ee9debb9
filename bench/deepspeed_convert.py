"""What ``lightning-zero convert --from deepspeed`` costs against DeepSpeed's ``zero_to_fp32.py`` on one checkpoint.

DeepSpeed ZeRO-2 (fp32, AdamW, 2 gloo ranks on its CPU accelerator) trains a stack of Linear layers one step and
saves (``--params`` parameters: 33.6M by default, a 537 MB state: 4 bytes of module weights and 12 of fp32 master
and Adam moments per parameter). Each converter then runs once, side by side, in a process of its own:

* ``convert --from deepspeed`` (weights, masters, moments, steps, param groups: one Lightning file);
* ``convert --from deepspeed --no-optimizer`` (weights only, what ``zero_to_fp32`` produces);
* DeepSpeed's ``zero_to_fp32.py`` (weights only; it unpickles the files with ``weights_only=False``);
* the floors they stand on: ``python -c 'import lightning_zero'`` (torch, Lightning) and the import of
  ``zero_to_fp32`` (torch, DeepSpeed), for reading the others.

*seconds* is the wall time of the process (interpreter and imports included), *peak RSS* its ``ru_maxrss``
(the pages of memory-mapped checkpoint files it touched count). The machine's page cache holds the
checkpoint after the first reader; the converters run in the order listed, so the first pays the cold read.

Run (DeepSpeed installed as ``make bench-peers`` does)::

    DS_ACCELERATOR=cpu PYTHONPATH=.bench-peers .venv/bin/python bench/deepspeed_convert.py [--params 33554432]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import describe_machine, load_average, run_on_ranks
from torch import nn

MIB = 1024 * 1024
WIDTH = 2048
"""Each layer is a WIDTH x WIDTH Linear (4.2M parameters with its bias)."""


def save_deepspeed_checkpoint(rank: int, world_size: int, layers: int, out: str) -> int:
    """(every rank) One ZeRO-2 step of ``layers`` Linear layers, saved to ``out``; the parameter count."""
    import deepspeed

    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    x = torch.randn(2, WIDTH)
    engine.backward(engine(x).square().mean())
    engine.step()
    engine.save_checkpoint(out, tag="step1")
    return sum(p.numel() for p in model.parameters())


def measured(command: list[str]) -> dict[str, float]:
    """``command`` in a process of its own, through this script's ``--measure`` (a process whose only child it
    is, so ``RUSAGE_CHILDREN`` is that command's peak)."""
    output = subprocess.run([sys.executable, __file__, "--measure", "--", *command], check=True,
                            capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def measure(command: list[str]) -> None:
    started = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{command} failed:\n{done.stderr[-3000:]}")
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"seconds": seconds, "peak_rss_mib": peak / MIB}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--params", type=int, default=8 * WIDTH * (WIDTH + 1))
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("command", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.command)
        return
    if os.environ.get("DS_ACCELERATOR") != "cpu":
        raise SystemExit("Run with DS_ACCELERATOR=cpu PYTHONPATH=.bench-peers (see this file's docstring).")
    layers = max(1, round(args.params / (WIDTH * (WIDTH + 1))))
    root = Path(__file__).resolve().parents[1]
    if not any((Path(p) / "deepspeed" / "utils" / "zero_to_fp32.py").is_file() for p in sys.path):
        raise SystemExit("DeepSpeed is not importable: see this file's docstring.")
    with tempfile.TemporaryDirectory(dir=root / "bench") as scratch:
        checkpoint = os.path.join(scratch, "deepspeed")
        params = run_on_ranks(save_deepspeed_checkpoint, 2, layers, checkpoint)
        size = sum(f.stat().st_size for f in Path(checkpoint).rglob("*.pt"))
        cli = [sys.executable, "-m", "lightning_zero", "convert", "--from", "deepspeed", checkpoint]
        runs = {
            "convert --from deepspeed (with optimizer state)": cli + [os.path.join(scratch, "full.ckpt")],
            "convert --from deepspeed --no-optimizer": cli + [os.path.join(scratch, "weights.ckpt"), "--no-optimizer"],
            # As a module: run as a script, its folder (deepspeed/utils, which holds a torch.py) would shadow torch.
            "zero_to_fp32.py (weights only)": [sys.executable, "-m", "deepspeed.utils.zero_to_fp32", checkpoint,
                                               os.path.join(scratch, "zero_to_fp32")],
            "floor: python -c 'import lightning_zero'": [sys.executable, "-c", "import lightning_zero"],
            "floor: python -c 'import deepspeed.utils.zero_to_fp32'": [sys.executable, "-c",
                                                                       "import deepspeed.utils.zero_to_fp32"],
        }
        print(f"{describe_machine()}; load average {load_average()}")
        print(f"DeepSpeed ZeRO-2 checkpoint, 2 ranks: {params / 1e6:.1f}M parameters, {size / 1e6:.0f} MB of files")
        print("| converter | seconds | peak RSS (MiB) | output (MB) |\n| --- | ---: | ---: | ---: |")
        for name, command in runs.items():
            result = measured(command)
            out = Path(command[-1] if "--no-optimizer" not in command else command[-2])
            files = [out] if out.is_file() else list(out.rglob("*")) if out.is_dir() else []
            written = sum(f.stat().st_size for f in files if f.is_file())
            print(f"| {name} | {result['seconds']:.1f} | {result['peak_rss_mib']:.0f} | {written / 1e6:.0f} |")


if __name__ == "__main__":
    main()
