"""Tiered checkpoints beside plain ones, for the same state, in one run (``bench/checkpoint.py --tiered``).

Two gloo CPU processes on 127.0.0.1 stand for two nodes (node rank = rank), each with its own local-tier
directory, over the engine state of bench/checkpoint.py (``--size-mb`` MiB of fp32 masters and AdamW moments
after one step). Interleaved, ``--repeats`` times, through ``ZeroCheckpointIO.save_checkpoint`` as the
strategy calls it:

1. ``tiered``: ``ZeroCheckpointIO(mode="sharded", local_tier=LocalTier(..., replicas=1), persist_every=1)``
   with its durable path on the S3 test server (moto, through s3fs): the save is written to the local tier
   (``--tier-dir``; default ``/dev/shm``, the host-memory tier), replicated to the other node, then persisted
   to S3 from the same staged copy;
2. ``sharded`` straight to the S3 test server;
3. ``sharded`` to a local path.

Per save (slowest rank, median): time blocked (the save call), time to recoverable (tiered: committed and
replicated on the nodes' local storage; the others: committed), time to durable (committed on S3 or the
shared path). Then a resume (``load`` of the whole state at the same world size) from each tier, with the
local files' page cache dropped first; each loaded state is checked bit for bit against the saved one.

Usage::

    .venv/bin/python bench/checkpoint.py --tiered                 # 128 MiB, 3 repeats
    .venv/bin/python bench/checkpoint.py --tiered --size-mb 32    # smoke run
    .venv/bin/python bench/checkpoint.py --tiered --tier-dir /tmp  # the local tier on the disk instead
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from _ckpt_common import (
    MIB,
    Check,
    bench_command,
    describe_machine,
    drop_page_cache,
    median,
    ms,
    now,
    publish,
    run_world,
    scratch_root,
)

from lightning_zero.checkpoint import LocalTier, ZeroCheckpointIO, load
from lightning_zero.checkpoint.lightning.entry import link_of
from lightning_zero.checkpoint.runtime.team import set_up_coordination
from lightning_zero.checkpoint.trainer_state import MARKER_FIELDS, TREE_TAG

TESTS = Path(__file__).resolve().parents[1] / "tests"

# Targets from the issue.
MIN_RECOVERABLE_VS_S3 = 5.0
MIN_LOCAL_RESUME_VS_S3 = 3.0

KINDS = ("tiered", "s3", "local_path")
LABELS = {"tiered": "tiered: local tier + replica, persisted to S3", "s3": "sharded straight to S3",
          "local_path": "sharded to a local path"}


def tiered_run(rank: int, world_size: int, settings: Any, s3_url: str, s3_options: dict[str, Any],
               tier_dir: str) -> dict[str, Any]:
    from checkpoint import build_trainer, tree_digests

    trainer = build_trainer(settings, rank)
    set_up_coordination()
    trainer.forward_backward()
    trainer.optimizer_step()
    tier = LocalTier(os.path.join(tier_dir, "node{node_rank}"), replicas=1, keep=2)
    ios = {"tiered": ZeroCheckpointIO(mode="sharded", local_tier=tier, persist_every=1, storage_options=s3_options),
           "s3": ZeroCheckpointIO(mode="sharded", storage_options=s3_options),
           "local_path": ZeroCheckpointIO(mode="sharded")}
    bases = {"tiered": f"{s3_url}/tiered", "s3": f"{s3_url}/direct", "local_path": os.path.join(settings.root, "direct")}
    for io in ios.values():
        link_of(io).place(node_rank=rank, local_rank=0)  # one rank per "node"

    def save(kind: str, name: str, step: int) -> dict[str, float]:
        io = ios[kind]
        tree = {**trainer.tree(), TREE_TAG: "sharded", MARKER_FIELDS: {"global_step": step}}
        dist.barrier()
        start = now()
        io.save_checkpoint(tree, f"{bases[kind]}/{name}")
        blocked = now() - start
        io.finalize()
        stats = io.last_save_stats
        assert stats is not None
        if kind == "tiered":
            assert stats.durable_after_s is not None, stats.durable_error
            return {"blocked": blocked, "recoverable": stats.replicated_after_s or 0.0,
                    "local": stats.local_committed_after_s or 0.0, "durable": stats.durable_after_s}
        return {"blocked": blocked, "recoverable": stats.committed_after_s, "durable": stats.committed_after_s}

    # Warm-up: groups, s3fs sessions, DCP planners, first touch of memory; and for the tier its steady state,
    # where retention has retired a checkpoint whose files the next saves write over ([Note: spare tier files]).
    for warmup in range(tier.keep + 1):
        for kind in KINDS:
            save(kind, f"warmup{warmup}.ckpt", 0)
    records: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    for repeat in range(settings.repeats):
        for kind in KINDS:
            records[kind].append(save(kind, f"r{repeat}.ckpt", repeat + 1))
    saved = tree_digests(trainer.tree())
    last = f"r{settings.repeats - 1}.ckpt"
    resume_paths = {"local tier": os.path.join(tier.root(rank, 0), last), "S3 (sharded)": f"{bases['s3']}/{last}",
                    "local path (sharded)": f"{bases['local_path']}/{last}"}
    loads: dict[str, list[float]] = {label: [] for label in resume_paths}
    exact = True
    for _ in range(settings.repeats):
        for label, path in resume_paths.items():
            dist.barrier()
            if rank == 0:
                drop_page_cache(settings.root)
                drop_page_cache(tier_dir)
            dist.barrier()
            tree = trainer.tree(for_load=True)
            start = now()
            load(tree, path, storage_options=s3_options if path.startswith("s3://") else None)
            loads[label].append(now() - start)
            exact = exact and tree_digests(tree) == saved
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (records, loads, exact))
    return {"ranks": gathered}


def _slowest(ranks: list[Any], kind: str, key: str) -> float:
    repeats = len(ranks[0][0][kind])
    return median([max(r[0][kind][i][key] for r in ranks) for i in range(repeats)])


def _slowest_load(ranks: list[Any], label: str) -> float:
    repeats = len(ranks[0][1][label])
    return median([max(r[1][label][i] for r in ranks) for i in range(repeats)])


def build_report(settings: Any, ranks: list[Any], command: str, elapsed: float, machine: str) -> str:
    lines = [f"# Tiered checkpoints ({settings.size_mb} MiB of state, 2 gloo ranks as 2 nodes, {settings.repeats}"
             " repeats, median of the slowest rank)", "", f"Command: `{command}` ({elapsed:.0f} s). {machine}", "",
             "| save | blocked ms | locally committed ms | recoverable ms | durable ms |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for kind in KINDS:
        local = ms(_slowest(ranks, kind, "local")) if kind == "tiered" else "-"
        lines.append(f"| {LABELS[kind]} | {ms(_slowest(ranks, kind, 'blocked'))} | {local}"
                     f" | {ms(_slowest(ranks, kind, 'recoverable'))} | {ms(_slowest(ranks, kind, 'durable'))} |")
    lines += ["", "| resume from | load ms |", "| --- | ---: |"]
    for label in ranks[0][1]:
        lines.append(f"| {label} | {ms(_slowest_load(ranks, label))} |")
    recoverable = _slowest(ranks, "s3", "recoverable") / _slowest(ranks, "tiered", "recoverable")
    resume = _slowest_load(ranks, "S3 (sharded)") / _slowest_load(ranks, "local tier")
    exact = all(r[2] for r in ranks)
    checks = [
        Check("recoverable sooner than straight to S3 (x)", recoverable, MIN_RECOVERABLE_VS_S3, False,
              "S3 save's commit / tiered save's local commit + replication"),
        Check("resume from the local tier faster than from S3 (x)", resume, MIN_LOCAL_RESUME_VS_S3, False,
              "load from S3 / load from the local tier"),
        Check("every resumed state equals the saved one bit for bit", float(exact), 1.0, False, "1 = yes"),
    ]
    lines += ["", *[check.line() for check in checks], "",
              "Recoverable: the tiered save is committed on each node's local storage and its replica on the other"
              " node (losing either node's storage loses nothing); a plain save is recoverable once committed."
              " Durable: the tiered save's S3 copy is written after the local tier and replication, from the same"
              " staged copy, by the same background worker. The S3 server is moto on 127.0.0.1 (in memory): a real"
              " bucket is farther away, which widens both ratios."]
    return "\n".join(lines) + "\n"


def _fs_type(path: str) -> str:
    import subprocess

    df = subprocess.run(["df", "-T", path], capture_output=True, text=True).stdout.splitlines()
    return df[-1].split()[1] if len(df) > 1 else "?"


def main_tiered(args: argparse.Namespace, argv: Sequence[str] | None, settings_type: Any) -> None:
    sys.path.insert(0, str(TESTS))
    from s3_server import moto_s3

    command = bench_command(argv)
    start = now()
    with scratch_root(args.dir, "tiered") as root:
        tier_parent = args.tier_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else root)
        tier_dir = tempfile.mkdtemp(prefix="lz-tier-", dir=tier_parent)
        settings = settings_type(size_mb=args.size_mb or 128, repeats=args.repeats or 3, root=root,
                                 reshard_world_sizes=())
        machine = describe_machine(root)
        try:
            with moto_s3("lightning-zero-bench") as s3:
                print(f"tiered: {settings.size_mb} MiB of state ({settings.size_mb * MIB / 2 / 1e6:.0f} MB per rank),"
                      f" {settings.repeats} repeats, local files under {root}, S3 at {s3.endpoint_url}", flush=True)
                result = run_world(tiered_run, 2, settings, s3.url("bench"), s3.storage_options, tier_dir)
        finally:
            shutil.rmtree(tier_dir, ignore_errors=True)
    machine += f" The local tier is in {tier_parent} ({_fs_type(tier_parent)})."
    publish(build_report(settings, result["ranks"], command, now() - start, machine), args.out, "tiered")
