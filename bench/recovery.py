"""Recovery benchmark: how soon a job that lost a node is back where it was, from the fast tier resharded,
from the durable tier, and (for comparison) after a same-size restart.

A job of 2 "nodes" x 2 ranks (two torchrun agents on 127.0.0.1, c10d rendezvous, each node with its own
local tier in ``--tier-dir``, default ``/dev/shm``) runs examples/elastic.py through
tests/elastic_torchrun_node.py: an MLP (``--width``, ``--depth``: fp32 masters + AdamW's two moments, 12
bytes per parameter; 72 MiB by default), a save every step to the local tier (replicated to the other node)
and every ``--persist-every``-th save also to the durable tier, a ``sharded`` checkpoint on S3 (moto's
server mode on 127.0.0.1, started in this process as tests/s3_server.py does) or, with ``--durable-dir``, in a
directory. After the save of step ``--kill-after`` (not a multiple of ``--persist-every``: the durable tier
is behind) is complete, node 1 (its agent and its workers) is SIGKILLed, then node 0. From copies of what is
left, ``--repeats`` times, interleaved:

1. ``fast tier, 4 -> 2``: node 0 alone (1 x 2 ranks) with node 0's local tier and the durable tier:
   ``ckpt_path="last"`` takes the local tier (the newest step), resharded from node 0's own files and node 1's
   replicas: a new local checkpoint of 2 ranks is written, then loaded;
2. ``durable tier, 4 -> 2``: node 0 alone with an empty local tier: the durable ``sharded`` checkpoint, the
   newest persisted step, resharded on load;
3. ``fast tier, same size (4)``: both nodes restarted (2 x 2) on their own local tiers: no reshard.

Each restart trains ``--extra-steps`` steps past the kill step (no sleep); the gaps between its completed
saves give the step time at world size 2 (a step and its local-tier save). For each (median over the
repeats): the worker's process start to the first completed step, rank 0's ``checkpoint_io.last_load``
(choose / reshard / load), the steps lost (the kill step minus the step resumed) and the time to be back at
the kill step: the resume plus the lost steps trained again at the measured step time.

Usage::

    .venv/bin/python bench/recovery.py                        # durable tier on moto S3, 72 MiB of state
    .venv/bin/python bench/recovery.py --repeats 3 --persist-every 10 --kill-after 17
    .venv/bin/python bench/recovery.py --durable-dir /tmp     # the durable tier in a directory instead
    .venv/bin/python bench/recovery.py --tier-dir /tmp        # the local tier on disk instead of host memory

The markdown report goes to stdout and to ``bench/out/recovery.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _ckpt_common import MIB, OUT_DIR, describe_machine, drop_page_cache, median, ms, publish

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "faults")]

from test_torchrun_elastic import agents, kill_node, reports, wait_for  # noqa: E402

from lightning_zero.checkpoint.tiered.tiers import tier_markers  # noqa: E402

SCENARIOS = {"fast": "fast tier, 4 -> 2 ranks (resharded)", "durable": "durable tier (sharded), 4 -> 2 ranks",
             "same": "fast tier, same size (4 ranks)"}
SAVED = re.compile(r"SAVED node=a step=(\d+) world=(\d+) restart=\d+ at=([\d.]+)")


def state_mib(width: int, depth: int) -> float:
    return 12 * depth * (width * width + width) / MIB


class DirectoryDurable:
    """The durable tier in a directory (``--durable-dir``); its page cache is dropped before each restart."""

    def __init__(self, parent: str) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="lz-recovery-durable-", dir=parent))
        self.label = f"a directory in {parent} (page cache dropped before each restart)"

    def root(self, name: str) -> str:
        return str(self.base / name)

    def copy(self, src: str, dst: str) -> None:
        shutil.copytree(src, dst)
        drop_page_cache(dst)

    def files(self, root: str) -> list[str]:
        return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file())

    def close(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


class S3Durable:
    """The durable tier at ``s3://<bucket>/<prefix>/`` on moto (tests/s3_server.py): the workers reach it
    through ``AWS_ENDPOINT_URL`` and the test credentials, set in this process's environment by ``moto_s3``."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        from s3_server import moto_s3

        self.s3 = stack.enter_context(moto_s3(bucket="lightning-zero-bench"))
        self.prefix = self.s3.fresh_prefix("recovery")
        self.label = f"S3 on moto's server mode ({self.s3.endpoint_url}, in memory, in the benchmark's process)"

    def root(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def copy(self, src: str, dst: str) -> None:
        client, bucket = self.s3.client(), self.s3.bucket
        src_key, dst_key = (u.removeprefix(f"s3://{bucket}/") for u in (src, dst))
        for key in self.s3.keys(src):
            client.copy_object(Bucket=bucket, Key=dst_key + key.removeprefix(src_key),
                               CopySource={"Bucket": bucket, "Key": key})

    def files(self, root: str) -> list[str]:
        return [k.removeprefix(root.removeprefix(f"s3://{self.s3.bucket}/") + "/") for k in self.s3.keys(root)]

    def close(self) -> None:
        pass  # moto keeps its buckets in memory; they go with the server


def script_args(root: str, tier: Path, steps: int, args: argparse.Namespace, report: Path) -> list[str]:
    return ["--root", root, "--local-tier", str(tier / "tier_{node}"), "--steps", str(steps), "--persist-every",
            str(args.persist_every), "--width", str(args.width), "--depth", str(args.depth), "--report", str(report)]


def train_and_kill(work: Path, tier: Path, root: str, args: argparse.Namespace, port: int) -> int:
    """The 2 x 2 job, killed after the save of step ``--kill-after``; returns that step."""
    run = agents(work, ["a", "b"], script_args(root, tier, 1000, args, work / "train"),
                 port=port, run_id=f"bench{os.getpid()}", nnodes="2", max_restarts=0, sleep=args.sleep)
    (a, a_log), (b, _) = run
    try:
        wait_for(a_log, rf"SAVED node=a step={args.kill_after} world=4", a, timeout=600)
    finally:
        kill_node(b)  # node 1 dies between two saves
        kill_node(a)  # node 0 is restarted below, from copies of what it holds
    return args.kill_after


def step_gaps(log: str, world: int) -> list[float]:
    """Seconds between consecutive completed saves of one start at ``world`` ranks (node a's SAVED lines)."""
    saved = [(int(s), float(at)) for s, w, at in SAVED.findall(log) if int(w) == world]
    return [t1 - t0 for (s0, t0), (s1, t1) in zip(saved, saved[1:]) if s1 == s0 + 1]


def restart(kind: str, work: Path, tier: Path, durable: Any, saved: dict[str, Any], step: int,
            args: argparse.Namespace, port: int, index: int) -> dict[str, Any]:
    """One restart from fresh copies of the killed job's files; rank 0's report of it."""
    here, tier_here = work / f"{kind}{index}", tier / f"{kind}{index}"
    here.mkdir()
    tier_here.mkdir()
    root = durable.root(f"{kind}{index}")
    durable.copy(saved["durable"], root)
    names = ["a", "b"] if kind == "same" else ["a"]
    for name in names:
        if kind == "durable":
            (tier_here / f"tier_{name}").mkdir()
        else:
            shutil.copytree(saved[name], tier_here / f"tier_{name}", symlinks=True)
    report = here / "report"
    started = time.time()
    run = agents(here, names, script_args(root, tier_here, step + args.extra_steps, args, report),
                 port=port, run_id=f"bench{os.getpid()}-{kind}{index}", nnodes=str(len(names)), max_restarts=0,
                 sleep=0.0)
    for proc, log in run:
        if proc.wait(timeout=600) != 0:
            raise RuntimeError(f"{kind} restart failed:\n{log.read_text()[-6000:]}")
    first = reports(report)[0]
    load = first["last_load"]
    shutil.rmtree(tier_here)
    expected = "durable" if kind == "durable" else "local"
    if load is None or load["tier"] != expected:
        raise RuntimeError(f"the {kind} restart did not resume from the {expected} tier: {load}")
    return {"agent": first["first_step_done"] - started, "worker": first["first_step_done"] - first["process_started"],
            "startup": load["startup_s"], "first": load["first_step_s"],
            "choose": load["choose_s"], "reshard": load["reshard_s"], "load": load["load_s"], "total": load["seconds"],
            "lost": step - load["step"], "tier": load["tier"], "step": load["step"],
            "from": load["resharded_from"], "world": first["world_size"],
            "gaps": step_gaps(run[0][1].read_text(), first["world_size"])}


def summarize(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per scenario, the step time at world size 2 and the times to be back at the kill step."""
    gaps = [g for kind in ("fast", "durable") for r in results[kind] for g in r["gaps"]]
    step_s = median(gaps)
    rows: dict[str, dict[str, float]] = {}
    for kind, runs in results.items():
        row = {key: median([r[key] for r in runs]) for key in ("agent", "worker", "startup", "choose", "reshard",
                                                               "load", "total", "first", "lost")}
        row["back"] = median([r["total"] + r["lost"] * step_s for r in runs])
        row["back_worker"] = median([r["worker"] + r["lost"] * step_s for r in runs])
        rows[kind] = row
    return {"step_s": step_s, "gaps": len(gaps), "rows": rows}


def build_report(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]], step: int, command: str,
                 elapsed: float, machine: str, durable_label: str) -> str:
    summary = summarize(results)
    rows, step_s = summary["rows"], summary["step_s"]
    lines = [f"# Recovery after a lost node ({state_mib(args.width, args.depth):.0f} MiB of state, 2 nodes x 2 gloo"
             f" ranks on 127.0.0.1, local-tier save every step, durable every {args.persist_every}, killed after"
             f" step {step}, {args.repeats} repeat(s), median)", "",
             f"Command: `{command}` ({elapsed:.0f} s). {machine} Durable tier: {durable_label}.", "",
             f"| resume | tier | step resumed | steps lost | resharded from | agent start -> first step s"
             f" | worker start -> first step s | startup s | choose ms | reshard ms | load ms | resume ms"
             f" | first step ms | back at step {step}: resume + lost x step ms |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for kind, label in SCENARIOS.items():
        r, m = results[kind][0], rows[kind]
        resharded = r["from"] or ("4 (on load)" if r["world"] != 4 else "-")
        lines.append(f"| {label} | {r['tier']} | {r['step']} | {max(x['lost'] for x in results[kind])} | {resharded}"
                     f" | {m['agent']:.1f} | {m['worker']:.1f} | {m['startup']:.1f} | {ms(m['choose'])}"
                     f" | {ms(m['reshard'])} | {ms(m['load'])} | {ms(m['total'])} | {ms(m['first'])} | {ms(m['back'])} |")
    fast, durable = rows["fast"], rows["durable"]
    lines += ["", f"Step time at 2 ranks (a step and its local-tier save, median of {summary['gaps']} gaps between"
              f" completed saves of the 4 -> 2 restarts): {ms(step_s)} ms.", "",
              "| ratio (durable / fast tier, both 4 -> 2) | x |", "| --- | ---: |",
              f"| resume (choose + reshard + load) | {durable['total'] / fast['total']:.2f} |",
              f"| back at step {step} (resume + lost steps trained again) | {durable['back'] / fast['back']:.2f} |",
              f"| worker start -> back at step {step + 1} (first step + lost steps) |"
              f" {durable['back_worker'] / fast['back_worker']:.2f} |",
              f"| resume: fast 4 -> 2 / same-size restart | {fast['total'] / rows['same']['total']:.2f} |",
              "", "The startup, resume and first-step columns are rank 0's `last_load` (its timeline: startup from the"
              " worker's start to the resume, imports and process group included; first step: from the resume's end"
              " to the first optimizer step done; choose: the inventory exchange; reshard: the pieces"
              " read, received and written as a new local checkpoint of 2 ranks; load: into the engine). Steps lost:"
              f" the kill step ({step}) minus the step resumed. The times to the first step also hold torchrun's start"
              " and rendezvous (agent) and the workers' imports of torch and Lightning (worker), about the same in"
              " every row."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--persist-every", type=int, default=5, help="every n-th save also goes to the durable tier")
    parser.add_argument("--kill-after", type=int, default=8, help="node 1 dies after this step's save completed")
    parser.add_argument("--extra-steps", type=int, default=4, help="steps each restart trains past --kill-after")
    parser.add_argument("--sleep", type=float, default=0.5, help="seconds between steps of the killed job")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the logs (and --durable-dir's copies) go")
    parser.add_argument("--durable-dir", default=None,
                        help="the durable tier in a directory under this path instead of moto S3")
    parser.add_argument("--tier-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.kill_after < args.persist_every:
        parser.error("--kill-after must be >= --persist-every: the durable tier needs a checkpoint to resume from")
    if args.extra_steps < 2:
        parser.error("--extra-steps must be >= 2 (the step time is measured between completed saves)")
    from _dist import free_port

    command = " ".join([".venv/bin/python", "bench/recovery.py", *(argv if argv is not None else sys.argv[1:])])
    start = time.time()
    work = Path(tempfile.mkdtemp(prefix="lz-recovery-", dir=args.dir))
    tier = Path(tempfile.mkdtemp(prefix="lz-recovery-tier-", dir=args.tier_dir or str(work)))
    with contextlib.ExitStack() as stack:
        durable = DirectoryDurable(args.durable_dir) if args.durable_dir else S3Durable(stack)
        try:
            machine = describe_machine(str(work)).replace("checkpoints in", "logs in") + f" Local tier in {tier.parent}."
            print(f"recovery: {state_mib(args.width, args.depth):.0f} MiB of state, work in {work}, tier in {tier},"
                  f" durable tier {durable.root('')}", flush=True)
            trained = durable.root("train")
            step = train_and_kill(work, tier, trained, args, free_port())
            saved = {"durable": trained, "a": tier / "saved_a", "b": tier / "saved_b"}
            for name in ("a", "b"):
                shutil.copytree(tier / f"tier_{name}", saved[name], symlinks=True)
            newest = {name: tier_markers(str(saved[name]))[0][1]["tier"]["step"] for name in ("a", "b")}
            print(f"killed after step {step}; newest local-tier step per node: {newest}; durable tier:"
                  f" {durable.files(trained)}", flush=True)
            results: dict[str, list[dict[str, Any]]] = {kind: [] for kind in SCENARIOS}
            for index in range(args.repeats):
                for kind in SCENARIOS:
                    results[kind].append(restart(kind, work, tier, durable, saved, step, args, free_port(), index))
                    print(f"{kind} #{index}: {results[kind][-1]}", flush=True)
        finally:
            durable.close()
            shutil.rmtree(tier, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)
    publish(build_report(args, results, step, command, time.time() - start, machine, durable.label),
            args.out or OUT_DIR / "recovery.md", "recovery")


if __name__ == "__main__":
    main()
