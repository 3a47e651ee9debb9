"""Real DeepSpeed loads what ``to_deepspeed`` writes (not run by CI; needs DeepSpeed, see README.md):

    DS_ACCELERATOR=cpu DS_BUILD_OPS=0 PYTHONPATH=.bench-peers .venv/bin/python clients/deepspeed/check.py

Each scenario takes a DeepSpeed 0.19.8 fixture (tests/fixtures/deepspeed/<case>/lightning.ckpt, saved by 2 ranks
after 20 steps), converts it in to a ``full`` Lightning file and out with ``to_deepspeed`` at a world size, then on
that many gloo CPU ranks builds the fixture's engine (make_fixtures.py's config for Lightning's layout: clipping
0.5), calls ``engine.load_checkpoint(dst)`` as Lightning's DeepSpeedStrategy does, and compares DeepSpeed's own view
(``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``, steps, lrs, module weights) with expected.pt's at
the save; it then trains the fixture's 10 further steps and compares with expected.pt's ``after``. Prints the largest
differences, absolute and as a fraction of the tensor's largest magnitude.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "fixtures" / "deepspeed")]

from deepspeed_cases import (  # noqa: E402
    CLIP,
    FIXTURES,
    GLOBAL_BATCH,
    STEPS_AFTER,
    STEPS_BEFORE,
    TinyNet,
    loss_of,
    make_scheduler,
    param_groups,
)

SCENARIOS = [  # (name, fixture, world size, stage, how the source is made)
    ("zero2-fp32 at 2", "zero2-fp32", 2, 2, "full"),
    ("zero1-fp32 at 2", "zero1-fp32", 2, 1, "full"),
    ("zero2-bf16 at 2", "zero2-bf16", 2, 2, "full"),
    ("zero1-bf16 at 2", "zero1-bf16", 2, 1, "full"),
    ("zero2-fp32 at 2, a plain file (no param names)", "zero2-fp32", 2, 2, "plain"),
    ("zero1-bf16-fp32accum at 2 (BF16_Optimizer loads)", "zero1-bf16-fp32accum", 2, 1, "full"),
    ("zero2-fp32 at 1 (from 2)", "zero2-fp32", 1, 2, "full"),
    ("zero2-bf16 at 1 (from 2)", "zero2-bf16", 1, 2, "full"),
    ("zero1-fp32 at 1 (from 2)", "zero1-fp32", 1, 1, "full"),
]


def prepare(scratch: Path) -> dict[str, str]:
    """Each scenario's converted folder (in this process: no DeepSpeed involved)."""
    from lightning_zero.checkpoint import convert, to_deepspeed
    from lightning_zero.checkpoint.reader import META_KEY

    folders = {}
    for index, (name, case, world_size, stage, how) in enumerate(SCENARIOS):
        full = convert(str(FIXTURES / case / "lightning.ckpt"), str(scratch / f"{index}.ckpt"))
        if how == "plain":  # as a plain Lightning file: nothing says which tensors are parameters
            content = torch.load(full, weights_only=True)
            content[META_KEY].pop("param_dtypes")
            torch.save(content, full)
        folders[name] = to_deepspeed(full, str(scratch / f"{index}-ds"), world_size=world_size, stage=stage)
    return folders


def engine_for(case: str, stage: int, world_size: int) -> tuple[Any, Any, Any]:
    import deepspeed

    module = TinyNet()
    optimizer = torch.optim.AdamW(param_groups(module))
    scheduler = make_scheduler(optimizer)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world_size, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage}, "steps_per_print": 10**9, "gradient_clipping": CLIP["lightning"],
    }
    if "bf16" in case:
        config["bf16"] = {"enabled": True}
    if case.endswith("-fp32accum"):
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    return engine, module, scheduler


def run(case: str, folder: str, stage: int, batches: dict[str, torch.Tensor]) -> dict[str, Any]:
    from make_fixtures import ground_truth

    rank, world_size = dist.get_rank(), dist.get_world_size()
    engine, module, scheduler = engine_for(case, stage, world_size)
    # As Lightning's DeepSpeedStrategy.load_checkpoint calls it; Lightning then restores its schedulers.
    _, client = engine.load_checkpoint(folder, load_optimizer_states=True, load_lr_scheduler_states=False)
    scheduler.load_state_dict(client["lr_schedulers"][0])
    loaded = ground_truth(engine, module)
    loaded["global_steps"] = engine.global_steps
    for index in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        x, y = batches["x"][index].chunk(world_size)[rank], batches["y"][index].chunk(world_size)[rank]
        engine.backward(loss_of(engine.module, x, y))
        engine.step()
        scheduler.step()
    after = ground_truth(engine, module)
    engine.destroy()
    return {"loaded": loaded, "after": after}


def worker(rank: int, world_size: int, port: int, jobs: list[tuple[str, str, str, int]], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    batches = torch.load(FIXTURES / "batches.pt", weights_only=True)
    results = {}
    for name, case, folder, stage in jobs:
        try:
            results[name] = run(case, folder, stage, batches)
        except Exception as exc:  # reported, the other scenarios still run
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            break  # a rank that failed mid-collective would leave the others waiting
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def worst(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    diff = (got.float() - want.float()).abs().max().item()
    return diff, diff / max(want.float().abs().max().item(), 1e-30)


def report(name: str, case: str, result: dict[str, Any]) -> None:
    if "error" in result:
        print(f"{name}: FAILED to load or train: {result['error'][:300]}")
        return
    truth = torch.load(FIXTURES / case / "expected.pt", weights_only=True)["lightning"]
    print(f"{name}:")
    for when, expected in (("loaded", truth["at_save"]), ("after", truth["after"])):
        got = result[when]
        lines = []
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            pairs = [worst(got["params"][n][kind], expected["params"][n][kind]) for n in expected["params"]]
            absolute, relative = max(p[0] for p in pairs), max(p[1] for p in pairs)
            lines.append(f"{kind} {absolute:.3g} ({relative:.3g})")
        weights = max(worst(got["weights"][n], v)[0] for n, v in expected["weights"].items())
        steps = sorted({s.item() for s in got["steps"]})
        lrs = "equal" if got["lrs"] == expected["lrs"] else f"{got['lrs']} vs {expected['lrs']}"
        extra = f", global_steps {got['global_steps']}" if when == "loaded" else ""
        print(f"  {when:6s} max |diff| (of max |value|): {', '.join(lines)}; weights {weights:.3g};"
              f" steps {steps}; lrs {lrs}{extra}")


def main() -> None:
    from _dist import free_port

    if os.environ.get("DS_ACCELERATOR") != "cpu":
        raise SystemExit("Run with DS_ACCELERATOR=cpu DS_BUILD_OPS=0 PYTHONPATH=.bench-peers (this file's docstring).")
    with tempfile.TemporaryDirectory() as scratch:
        folders = prepare(Path(scratch))
        results: dict[str, Any] = {}
        for world_size in sorted({s[2] for s in SCENARIOS}, reverse=True):
            jobs = [(name, case, folders[name], stage) for name, case, ws, stage, _ in SCENARIOS if ws == world_size]
            out = os.path.join(scratch, f"results-{world_size}.pt")
            mp.start_processes(worker, args=(world_size, free_port(), jobs, out), nprocs=world_size,
                               start_method="spawn")
            results.update(torch.load(out, weights_only=True))
    for name, case, *_ in SCENARIOS:
        report(name, case, results.get(name, {"error": "not run (an earlier scenario failed)"}))


if __name__ == "__main__":
    main()
