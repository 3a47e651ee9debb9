"""DeepSpeed's checkpoint beside ours (``bench/checkpoint.py --peers``, part of ``make bench-peers``).

Two gloo CPU processes each hold two trainers of the same MLP (``bench/checkpoint.py``'s model, the
same seed, AdamW, one step taken): our ``ZeroEngine`` (stage 2) and DeepSpeed's ZeRO-2 engine
(``DS_ACCELERATOR=cpu``). Per repeat, interleaved, in an order alternated every repeat:

- ours: ``async_save(tree, mode="sharded")`` (what the strategy's save runs), then waiting for its
  staging and commit; the commit is durable (every file fsynced before the metadata names it);
- DeepSpeed: ``engine.save_checkpoint(dir)``, its default ``TorchCheckpointEngine`` (``torch.save``
  on the calling thread, no fsync), then an fsync of every file and directory under ``dir`` by the
  rank that wrote it, so *to durable* means the same for both;
- DeepSpeed's decoupled (background) writer, ``"checkpoint": {"writer": {"decoupled": true}}``, if it
  can be built here (it needs the ``async_io`` op, JIT-built against libaio); if not, the report
  says why.

*blocked*: the save call's own time on the training thread (the slowest rank). *to durable*: from the
call to the last byte on disk, the slowest rank. *written*: bytes of the checkpoint directory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from _ckpt_common import MIB, bench_command, now, publish


def fsync_tree(root: str, since: float) -> None:
    """fsync every file under ``root`` modified at or after ``since`` (this rank's files: a file another
    rank wrote is older only if written before the save began), then the directories."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if os.stat(path).st_mtime >= since - 1.0:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def directory_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def deepspeed_trainer(settings: Any, decoupled: bool) -> tuple[Any, torch.Tensor]:
    """DeepSpeed ZeRO-2 over ``bench/checkpoint.py``'s model (same seed and optimizer), one step taken."""
    import deepspeed
    from checkpoint import build_model, model_width

    # What DeepSpeed's launcher sets (one node): its decoupled writer reads the CROSS_* ones.
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    os.environ.setdefault("LOCAL_SIZE", str(dist.get_world_size()))
    os.environ.setdefault("CROSS_RANK", "0")
    os.environ.setdefault("CROSS_SIZE", "1")
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group already set up
    model = build_model(model_width(settings.size_mb), settings.seed)
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": settings.batch, "gradient_accumulation_steps": 1,
                              "zero_optimization": {"stage": 2}}
    if decoupled:
        config["checkpoint"] = {"writer": {"type": "fast", "decoupled": True}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                           config=config)
    batch = torch.randn(settings.batch, model[0].normalized_shape[0], generator=torch.Generator().manual_seed(1))
    engine.backward(engine(batch).square().mean())
    engine.step()
    return engine, batch


def peers_run(rank: int, world_size: int, settings: Any) -> dict[str, Any]:
    from checkpoint import build_trainer

    from lightning_zero.checkpoint import async_save, maybe_finalize_async_calls, wait_for_staging
    from lightning_zero.checkpoint.runtime.team import set_up_coordination

    ours = build_trainer(settings, rank)
    set_up_coordination()
    ours.forward_backward()
    ours.optimizer_step()
    ours.engine.finish_param_gather()
    theirs, _ = deepspeed_trainer(settings, decoupled=False)
    try:
        decoupled, _ = deepspeed_trainer(settings, decoupled=True)
        decoupled_error = None
    except Exception as exc:  # noqa: BLE001 - the reason goes into the report
        decoupled, decoupled_error = None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    failures = [None] * world_size
    dist.all_gather_object(failures, decoupled_error)
    decoupled_error = next((f for f in failures if f), None)
    if decoupled_error is not None:
        decoupled = None  # every rank alike: the decoupled engine's saves are collective

    def save_ours(path: str) -> tuple[float, float]:
        start = now()
        async_save(ours.tree(), path, mode="sharded")
        returned = now()
        wait_for_staging()
        maybe_finalize_async_calls(blocking=True)
        return returned - start, now() - start

    def save_deepspeed(engine: Any, path: str) -> tuple[float, float]:
        start = now()
        wall = time.time()
        engine.save_checkpoint(path, tag="t")
        returned = now()
        if engine.checkpoint_engine.is_decoupled():
            engine._commit_decoupled_checkpoint()  # waits for the writer process's commit
        fsync_tree(path, wall)
        return returned - start, now() - start

    kinds: dict[str, Any] = {"lightning_zero sharded (async_save)": save_ours,
                             "DeepSpeed ZeRO-2 save_checkpoint": lambda p: save_deepspeed(theirs, p)}
    if decoupled is not None:
        kinds["DeepSpeed ZeRO-2 decoupled writer"] = lambda p: save_deepspeed(decoupled, p)
    records: dict[str, list[tuple[float, float, int]]] = {k: [] for k in kinds}
    for repeat in range(-1, settings.repeats):  # -1: warm-up, not recorded
        order = list(kinds) if repeat % 2 == 0 else list(kinds)[::-1]
        for label in order:
            path = os.path.join(settings.root, f"r{repeat}-{len(label)}", "ckpt")
            dist.barrier()
            blocked, durable = kinds[label](path)
            dist.barrier()
            written = directory_bytes(os.path.dirname(path))
            if repeat >= 0:
                records[label].append((blocked, durable, written))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, records)
    if decoupled is not None:
        decoupled.checkpoint_engine.cleanup()
    return {"ranks": everyone, "decoupled_error": decoupled_error}


def report(result: dict[str, Any], settings: Any, command: str, elapsed: float, machine: str) -> str:
    ranks = result["ranks"]
    lines = [f"# Checkpoint save beside DeepSpeed ZeRO-2 ({settings.size_mb} MiB of optimizer state over"
             f" {settings.world_size} gloo ranks, {settings.repeats} repeats, median of the slowest rank)", "",
             f"Command: `{command}` ({elapsed:.0f} s). {machine}", "",
             "| save | blocked ms | to durable ms | written MiB | blocked vs ours |",
             "| --- | ---: | ---: | ---: | ---: |"]
    medians = {}
    for label in ranks[0]:
        repeats = len(ranks[0][label])
        blocked = statistics.median(max(r[label][i][0] for r in ranks) for i in range(repeats))
        durable = statistics.median(max(r[label][i][1] for r in ranks) for i in range(repeats))
        medians[label] = (blocked, durable, ranks[0][label][-1][2])
    ours_blocked = next(iter(medians.values()))[0]
    for label, (blocked, durable, written) in medians.items():
        lines.append(f"| {label} | {blocked * 1e3:.1f} | {durable * 1e3:.1f} | {written / MIB:.1f}"
                     f" | {blocked / ours_blocked:.1f}x |")
    if result["decoupled_error"]:
        lines += ["", f"DeepSpeed's decoupled writer did not start here: {result['decoupled_error']}"]
    lines += ["", "DeepSpeed writes the whole fp32 module from rank 0 besides each rank's optimizer partition;"
              " ours writes the master shards and the optimizer state, each rank its own."]
    return "\n".join(lines) + "\n"


def main_peers(args: argparse.Namespace, argv: Sequence[str] | None) -> None:
    from checkpoint import run_variant

    result, settings, machine, seconds = run_variant(args, "peers", peers_run, 64)
    command = bench_command(argv, env="DS_ACCELERATOR=cpu DS_BUILD_OPS=0 PYTHONPATH=.bench-peers")
    publish(report(result, settings, command, seconds, machine), args.out, "peers")
