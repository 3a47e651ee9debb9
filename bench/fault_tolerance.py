"""Fault tolerance across replica groups (torchft) against a tuned torch elastic restart, side by side.

Three measurements in one run on 127.0.0.1, each job ``--groups`` x 2 gloo ranks:

1. ``fault tolerance``: torchft's lighthouse and one torchrun job per replica group (tests/ft_cluster.py running
   tests/faults/ft_job.py, ZeRO-2 in each group), a ``--step-sleep`` per step so that the stall is resolved to a
   fraction of a step. Once every group has committed a step together, the last group (its agent and workers) is
   SIGKILLed. *Stall*: the kill to the survivors' next committed step (group 0 rank 0's JSON lines, ``t``); *steps
   discarded*: the survivors' uncommitted steps in between (retaken, so no sample is lost). Then the group is
   relaunched: *heal* is the relaunch to its first committed step (its processes' start, imports and the heal
   included), *heal transfer* the heal alone (``last_heal_s`` of its first report).
2. ``torch elastic``: the same job size as ``--groups`` torchrun agents of 2 ranks (one per "node", c10d
   rendezvous, ``--nnodes 1:G``) running examples/elastic.py through tests/elastic_torchrun_node.py, a save to the
   local tier (``--tier-dir``) every step, with the tuned settings of /work/shared/CLIENTS.md's torchft section
   (``--monitor-interval 0.1``, ``last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2``). The last
   node is SIGKILLed; the survivors' agents restart their workers, which resume from the fast tier resharded.
   *Recovery*: the kill to rank 0's first completed step after the restart (its report's ``first_step_done``).
3. ``step time``: 2 groups x 2 ranks with fault tolerance and no failure against the same model and data as one
   hybrid-sharded job of 4 ranks without it (ft_job.py's ``FT_HYBRID=1``, ``shard_group_size=2``), no sleep: the
   mean step over the steps past ``--warmup`` from group 0 rank 0's JSON lines, both jobs run one after the other
   in each repeat; and where that step's time goes: each job's phases (the quorum's wait, the cross-group sums,
   the commit decision, ...) from ft_job.py's ``FT_PHASES`` timers.

Each is run ``--repeats`` times, interleaved; the report gives medians.

Usage::

    .venv/bin/python bench/fault_tolerance.py                 # 3 groups, 3 repeats
    .venv/bin/python bench/fault_tolerance.py --quick         # 2 groups, 1 repeat (tests/bench)
    .venv/bin/python bench/fault_tolerance.py --only step     # the step-time pairs and their phases alone

The markdown report goes to stdout and to ``bench/out/fault_tolerance.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _ckpt_common import OUT_DIR, describe_machine, median, publish

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "faults")]

from ft_cluster import HEARTBEAT_MS, FTCluster, torchft_installed  # noqa: E402
from test_torchrun_elastic import NODE, TORCHRUN, kill_node, reports  # noqa: E402

TUNED_MONITOR_INTERVAL = "0.1"
TUNED_RDZV_CONF = "join_timeout=120,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"
"""torch elastic's tuned settings (/work/shared/CLIENTS.md): ``close_timeout=1`` or ``keep_alive_max_attempt=1``
failed with RendezvousTimeoutError there."""
SAVED = re.compile(r"SAVED node=a step=(\d+) world=(\d+)")


def after(lines: list[dict[str, Any]], at: float) -> list[dict[str, Any]]:
    return [r for r in lines if r["t"] > at]


def stall_of(survivor: list[dict[str, Any]], killed_at: float, participants: int) -> dict[str, Any] | None:
    """From a survivor's JSON lines: the kill to its next step committed by ``participants`` groups, and the steps
    it discarded in between; None while it has committed none."""
    later = after(survivor, killed_at)
    resumed = next((i for i, r in enumerate(later) if r["committed"] and r["participants"] == participants), None)
    if resumed is None:
        return None
    return {"stall": later[resumed]["t"] - killed_at,
            "discarded": sum(not r["committed"] for r in later[:resumed])}


def heal_of(relaunched: list[dict[str, Any]], relaunched_at: float) -> dict[str, Any] | None:
    """From the relaunched group's JSON lines: the relaunch to its first committed step, and its heal alone."""
    first = next((r for r in after(relaunched, relaunched_at) if r["committed"]), None)
    if first is None:
        return None
    if first["heals"] != 1:
        raise RuntimeError(f"the relaunched group's first committed step did not follow a heal: {first}")
    return {"heal": first["t"] - relaunched_at, "transfer": first["last_heal_s"]}


def rejoin_discards(survivor: list[dict[str, Any]], relaunched_at: float, groups: int) -> int | None:
    """The survivor's steps discarded from the relaunch to its first step committed by all ``groups`` again."""
    later = after(survivor, relaunched_at)
    back = next((i for i, r in enumerate(later) if r["committed"] and r["participants"] == groups), None)
    return None if back is None else sum(not r["committed"] for r in later[:back])


def check_progress(lines: list[dict[str, Any]], group: int, most: int = 30) -> None:
    """Stop at ``most`` discarded steps in a row (a kill or a join costs one or two): the groups are not
    deciding steps together, and waiting longer would only hide it."""
    if len(lines) >= most and not any(r["committed"] for r in lines[-most:]):
        raise RuntimeError(f"group {group} discarded its last {most} steps (at step {lines[-1]['global_step']},"
                           f" {lines[-1]['participants']} participants): the groups commit no step together")


def fault_tolerance_run(root: Path, groups: int, step_sleep: float, warm: int,
                        timeout_s: float = 2.0) -> dict[str, Any]:
    """``groups`` x 2 ranks with fault tolerance: the last group SIGKILLed once all commit together past step
    ``warm``, then relaunched."""
    victim, survivor = groups - 1, 0
    with FTCluster(root, groups=groups, steps=100_000, step_sleep=step_sleep, timeout_s=timeout_s) as ft:
        ft.start()

        def progressing(*watched: int) -> bool:
            for group in watched:
                check_progress(ft.reports(group), group)
            return True

        ft.wait_for(lambda: progressing(*range(groups))
                    and all(any(r["participants"] == groups for r in ft.committed(g)) for g in range(groups))
                    and ft.step_of(survivor) >= warm, 300, f"all {groups} groups committing together")
        killed_at = ft.kill(victim)
        ft.wait_for(lambda: progressing(survivor)
                    and stall_of(ft.reports(survivor), killed_at, groups - 1) is not None, 120,
                    "a committed step of the survivors")
        relaunched_at = time.time()
        ft.launch(victim)
        ft.wait_for(lambda: progressing(survivor) and heal_of(ft.reports(victim), relaunched_at) is not None
                    and rejoin_discards(ft.reports(survivor), relaunched_at, groups) is not None, 300,
                    "the relaunched group committing with the others")
        stall = stall_of(ft.reports(survivor), killed_at, groups - 1)
        heal = heal_of(ft.reports(victim), relaunched_at)
        rejoin = rejoin_discards(ft.reports(survivor), relaunched_at, groups)
    assert stall is not None and heal is not None and rejoin is not None
    return {**stall, **heal, "rejoin_discarded": rejoin, "timeout_s": float(ft.env["FT_TIMEOUT"])}


def elastic_agents(work: Path, nodes: int, tier: Path, sleep: float, port: int) -> list[tuple[subprocess.Popen, Path]]:
    """One torchrun agent per node (``a``, ``b``, ...; the first hosts the rendezvous store) with the tuned
    settings, as tests/faults/test_torchrun_elastic.py's ``agents`` starts them (it fixes the monitor interval and
    the rendezvous timeouts to its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "WORLD_SIZE", "RANK", "LOCAL_"))}
    env.update(PYTHONUNBUFFERED="1", ELASTIC_STEP_SLEEP=str(sleep), OMP_NUM_THREADS="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # see examples/elastic.py
    script = ["--root", str(work / "durable"), "--local-tier", str(tier / "tier_{node}"), "--steps", "100000",
              "--persist-every", "100000", "--report", str(work / "report")]
    started = []
    for i in range(nodes):
        name = "abcdefgh"[i]
        log = work / f"{name}.log"
        cmd = [str(TORCHRUN), f"--nnodes=1:{nodes}", "--nproc-per-node=2", "--max-restarts=3",
               f"--monitor-interval={TUNED_MONITOR_INTERVAL}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=ftbench{os.getpid()}-{work.name}",
               f"--rdzv-conf=is_host={int(i == 0)},{TUNED_RDZV_CONF}", str(NODE), *script]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, env={**env, "ELASTIC_NODE_NAME": name}, stdout=out,
                                    stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        started.append((proc, log))
    return started


def saved_steps(log: str, world: int) -> list[int]:
    return [int(step) for step, w in SAVED.findall(log) if int(w) == world]


def restarted_report(report: Path, killed_at: float) -> dict[str, Any] | None:
    """Rank 0's report of the first start whose first step came after the kill, once written (a start that
    followed a late agent's join, before the kill, is not it)."""
    runs = {n: r for n, r in reports(report).items() if r.get("first_step_done", 0) > killed_at}
    return runs[min(runs)] if runs else None


def elastic_run(work: Path, tier: Path, nodes: int, step_sleep: float, warm: int) -> dict[str, Any]:
    """``nodes`` x 2 ranks under torch elastic: the last node SIGKILLed once all have trained past step ``warm``;
    the kill to the first step after the survivors' restart."""
    from _dist import free_port

    work.mkdir()
    tier.mkdir()
    run = elastic_agents(work, nodes, tier, step_sleep, free_port())
    (first, first_log), (last, _) = run[0], run[-1]
    try:
        deadline = time.monotonic() + 600
        while not [s for s in saved_steps(first_log.read_text(), 2 * nodes) if s >= warm]:
            if first.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"torch elastic never reached step {warm} at {2 * nodes} ranks:\n"
                                   + first_log.read_text()[-6000:])
            time.sleep(0.05)
        killed_at = kill_node(last)
        before = max(saved_steps(first_log.read_text(), 2 * nodes))
        while (restarted := restarted_report(work / "report", killed_at)) is None:
            if first.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the survivors never trained again after the kill:\n"
                                   + first_log.read_text()[-6000:])
            time.sleep(0.05)
    finally:
        for proc, _ in run:
            if proc.poll() is None:
                kill_node(proc)
        shutil.rmtree(tier, ignore_errors=True)
    load = restarted["last_load"] or {}
    if load.get("tier") != "local":
        raise RuntimeError(f"torch elastic's restart did not resume from the fast tier: {restarted}")
    return {"recovery": restarted["first_step_done"] - killed_at,
            "worker": restarted["first_step_done"] - restarted["process_started"],
            "resume": load.get("seconds"), "world": restarted["world_size"], "tier": load.get("tier"),
            "lost": before - load["step"] if load.get("step") is not None else None}


def mean_step_s(lines: list[dict[str, Any]], warmup: int) -> float:
    """The mean time per step over the steps past ``warmup`` (the first of them is the reference)."""
    kept = sorted((r["global_step"], r["t"]) for r in lines if r["global_step"] > warmup)
    if len(kept) < 2:
        raise ValueError(f"{len(kept)} step(s) past warm-up step {warmup}: run more steps (--step-steps)")
    return (kept[-1][1] - kept[0][1]) / (kept[-1][0] - kept[0][0])


PHASES = ("step", "quorum", "hop_wait", "finish_backward", "commit", "should_commit", "optimizer_step")


def step_time_runs(root: Path, steps: int, warmup: int, width: int = 0) -> dict[str, Any]:
    """2 groups x 2 ranks with fault tolerance, no failure, then the same hybrid job of 4 ranks without it.
    ``width``: ft_job.py's model with two hidden layers of that width (0: its 8-16-1 MLP, all overhead).
    Also each job's phases (ft_job.py's ``FT_PHASES``: mean seconds per step past ``warmup``, group 0 rank 0)."""
    env = {"FT_WIDTH": str(width), "FT_PHASES": "1", "FT_PHASES_WARMUP": str(warmup)}
    with FTCluster(root / "ft", groups=2, steps=steps, min_replicas=2, env=env) as ft:
        ft.start()  # min_replicas=2: both groups take part from the first step
        for group in range(2):
            if ft.wait_exit(group, 600) != 0:
                raise RuntimeError(ft.log_tail(group))
    with FTCluster(root / "hybrid", groups=2, ranks=4, steps=steps, env={"FT_HYBRID": "1", **env}) as hybrid:
        hybrid.launch(0)
        if hybrid.wait_exit(0, 600) != 0:
            raise RuntimeError(hybrid.log_tail(0))
    with_ft = ft.reports(0)
    if not all(r["committed"] and r["participants"] == 2 for r in with_ft):
        raise RuntimeError("a step of the run with no failure was not committed by both groups")
    return {"with": mean_step_s(with_ft, warmup), "without": mean_step_s(hybrid.reports(0), warmup),
            "phases_with": json.loads((root / "ft" / "phases_g0_r0.json").read_text()),
            "phases_without": json.loads((root / "hybrid" / "phases_g0_r0.json").read_text())}


def phase_rows(runs: list[dict[str, Any]], label: str) -> list[str]:
    """The median over the repeats of each phase's ms per step, with fault tolerance and without."""
    rows = []
    for phase in PHASES:
        with_ft = [r["phases_with"][phase] for r in runs if phase in r["phases_with"]]
        without = [r["phases_without"][phase] for r in runs if phase in r["phases_without"]]
        if with_ft:
            rows.append(f"| {label} | {phase} | {1000 * median(with_ft):.1f} |"
                        f" {f'{1000 * median(without):.1f}' if without else '-'} |")
    return rows


def summarize_steps(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    steps, wide = results["steps"], results["steps_wide"]
    return {"with": median([r["with"] for r in steps]), "without": median([r["without"] for r in steps]),
            "step_ratio": median([r["with"] / r["without"] for r in steps]),
            "wide_with": median([r["with"] for r in wide]), "wide_without": median([r["without"] for r in wide]),
            "wide_ratio": median([r["with"] / r["without"] for r in wide])}


def summarize(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    ft, elastic = results["ft"], results["elastic"]
    row = {key: median([r[key] for r in ft]) for key in ("stall", "heal", "transfer")}
    return {**row, "discarded": max(r["discarded"] for r in ft),
            "rejoin_discarded": max(r["rejoin_discarded"] for r in ft),
            "recovery": median([r["recovery"] for r in elastic]), "worker": median([r["worker"] for r in elastic]),
            "resume": median([r["resume"] for r in elastic if r["resume"] is not None] or [float("nan")]),
            "lost": max((r["lost"] for r in elastic if r["lost"] is not None), default=None),
            "elastic_world": elastic[0]["world"], **summarize_steps(results)}


def step_rows(args: argparse.Namespace, s: dict[str, Any]) -> list[str]:
    return ["| 2 x 2 ranks, no failure, no sleep | mean step ms | vs without |", "| --- | ---: | ---: |",
            f"| fault tolerance (torchft, 2 groups) | {1000 * s['with']:.1f} | {s['step_ratio']:.2f} |",
            f"| the same hybrid job without it (4 ranks, shard_group_size=2) | {1000 * s['without']:.1f} | 1.00 |",
            f"| fault tolerance, {args.width}-wide MLP (2 hidden layers) | {1000 * s['wide_with']:.1f}"
            f" | {s['wide_ratio']:.2f} |",
            f"| the same hybrid job without it, {args.width}-wide | {1000 * s['wide_without']:.1f} | 1.00 |"]


def breakdown_rows(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> list[str]:
    if not all("phases_with" in r for r in results["steps"] + results["steps_wide"]):
        return []
    return ["| model | phase (group 0 rank 0) | with fault tolerance ms/step | hybrid, without ms/step |",
            "| --- | --- | ---: | ---: |", *phase_rows(results["steps"], "8-16-1 MLP"),
            *phase_rows(results["steps_wide"], f"{args.width}-wide MLP"), "",
            "Phases: `step` from one on_train_batch_start to the next; `quorum` the first reduction of the backward"
            " (waiting for the quorum started at on_train_batch_start, and what it launches); `hop_wait` waiting for"
            " the buckets' cross-group sums; `finish_backward` the end of the backward (all reductions waited for);"
            " `commit` the decision before the update, `should_commit` torchft's round trip inside it;"
            " `optimizer_step` the engine's optimizer step, which runs Lightning's closure: the forward, the backward,"
            " the commit and the update.", ""]


STEP_NOTE = ("Step time: the mean over steps {first}-{last} of group 0 rank 0, the ratio the median of the per-repeat"
             " ratios; the small model is ft_job.py's 8-16-1 MLP, so its step is all overhead (the quorum, the"
             " cross-group all-reduce, the commit), not compute.")


def build_report(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]], command: str,
                 elapsed: float, machine: str) -> str:
    step_note = STEP_NOTE.format(first=args.warmup + 1, last=args.step_steps)
    if not results["ft"]:  # --only step
        s = summarize_steps(results)
        lines = [f"# Fault tolerance's step time against the same hybrid job without it ({args.repeats} repeat(s),"
                 " median)", "", f"Command: `{command}` ({elapsed:.0f} s). {machine}", "", *step_rows(args, s), "",
                 *breakdown_rows(args, results), step_note]
        return "\n".join(lines) + "\n"
    s = summarize(results)
    g = args.groups
    lost = "-" if s["lost"] is None else str(s["lost"])
    lines = [f"# Fault tolerance across replica groups against a torch elastic restart ({g} x 2 gloo ranks on"
             f" 127.0.0.1, one group / node SIGKILLed, {args.repeats} repeat(s), median)", "",
             f"Command: `{command}` ({elapsed:.0f} s). {machine}", "",
             f"| recovery of a job of {g} x 2 ranks that lost 2 | kill -> training again s | steps discarded"
             " | relaunched: relaunch -> first committed step s | heal transfer s |",
             "| --- | ---: | ---: | ---: | ---: |",
             f"| fault tolerance (torchft): the survivors go on at {g - 1} x 2 | {s['stall']:.2f} | {s['discarded']}"
             f" (at the rejoin: {s['rejoin_discarded']}) | {s['heal']:.2f} | {s['transfer']:.3f} |",
             f"| torch elastic, tuned, from the fast tier: restarted at {s['elastic_world']} ranks"
             f" | {s['recovery']:.2f} | {lost} (steps lost) | | |", "",
             "| ratio | x |", "| --- | ---: |",
             f"| torch elastic recovery / fault-tolerance stall | {s['recovery'] / s['stall']:.1f} |",
             "| torch elastic recovery / relaunched group's relaunch -> first committed step"
             f" | {s['recovery'] / s['heal']:.2f} |",
             "", *step_rows(args, s), "", *breakdown_rows(args, results),
             f"Fault tolerance: lighthouse heartbeat timeout {HEARTBEAT_MS / 1000:.0f} s, quorum tick 0.1 s, the"
             f" groups' timeout_s {results['ft'][0]['timeout_s']:g} s, {args.step_sleep} s of sleep per"
             " step; the stall is the kill to the survivors' next committed step; the steps discarded are retaken, so"
             " no sample is lost. The relaunched group's time holds its torchrun start and its workers' imports; the"
             " heal transfer is its `last_heal_s` (state from a live group, no storage read). torch elastic:"
             " `--monitor-interval"
             f" {TUNED_MONITOR_INTERVAL} --rdzv-conf {TUNED_RDZV_CONF}`, examples/elastic.py's MLP, a local-tier save"
             " every step (steps lost: the newest save before the kill minus the step resumed), the kill to"
             f" rank 0's first step done after its restart (worker start -> first step {s['worker']:.2f} s of it,"
             f" the resume {s['resume']:.2f} s). " + step_note]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=3, choices=(2, 3), help="replica groups (torch elastic: nodes)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-sleep", type=float, default=0.05, help="seconds of sleep per step in the kill runs")
    parser.add_argument("--width", type=int, default=1024, help="hidden width of the step-time model with compute")
    parser.add_argument("--timeout", type=float, default=2.0, help="FaultTolerance(timeout_s=...) of the kill runs")
    parser.add_argument("--kill-after", type=int, default=5, help="the kill comes past this step")
    parser.add_argument("--step-steps", type=int, default=60, help="steps of each step-time run")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the step time")
    parser.add_argument("--quick", action="store_true", help="2 groups, 1 repeat, 40 steps per step-time run")
    parser.add_argument("--only", choices=("all", "step"), default="all",
                        help="step: only the step-time pairs (no kill runs, no torch elastic)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the jobs' logs and reports go")
    parser.add_argument("--tier-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                        help="torch elastic's local tier")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.groups, args.repeats, args.step_steps = 2, 1, 40
    if args.step_steps < args.warmup + 2:
        parser.error("--step-steps must be at least --warmup + 2")
    if not torchft_installed():
        parser.error('torchft is not installed: pip install "lightning-zero[ft]"')
    # SIGTERM unwinds like an exception, so that the clusters' __exit__ kills the jobs this run started.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    command = " ".join([".venv/bin/python", "bench/fault_tolerance.py", *(argv if argv is not None else sys.argv[1:])])
    start = time.time()
    work = Path(tempfile.mkdtemp(prefix="lz-ft-bench-", dir=args.dir))
    tier = Path(tempfile.mkdtemp(prefix="lz-ft-bench-tier-", dir=args.tier_dir or str(work)))
    results: dict[str, list[dict[str, Any]]] = {"ft": [], "elastic": [], "steps": [], "steps_wide": []}
    failed = True
    try:
        machine = describe_machine(str(work)).replace("checkpoints in", "logs in")
        print(f"fault_tolerance: {args.groups} x 2 ranks, {args.repeats} repeat(s), work in {work}", flush=True)
        for index in range(args.repeats):
            if args.only == "all":
                results["ft"].append(fault_tolerance_run(work / f"ft{index}", args.groups, args.step_sleep,
                                                         args.kill_after, args.timeout))
                print(f"fault tolerance #{index}: {results['ft'][-1]}", flush=True)
                results["elastic"].append(elastic_run(work / f"elastic{index}", tier / f"elastic{index}",
                                                      args.groups, args.step_sleep, args.kill_after))
                print(f"torch elastic #{index}: {results['elastic'][-1]}", flush=True)
            results["steps"].append(step_time_runs(work / f"steps{index}", args.step_steps, args.warmup))
            results["steps_wide"].append(step_time_runs(work / f"wide{index}", args.step_steps, args.warmup,
                                                        args.width))
            print(f"step time #{index}: {json.dumps(results['steps'][-1])}\n"
                  f"  {args.width}-wide: {json.dumps(results['steps_wide'][-1])}", flush=True)
        failed = False
    finally:
        shutil.rmtree(tier, ignore_errors=True)
        if failed:
            print(f"fault_tolerance: failed; the jobs' logs are kept in {work}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    publish(build_report(args, results, command, time.time() - start, machine),
            args.out or OUT_DIR / "fault_tolerance.md", "fault_tolerance")


if __name__ == "__main__":
    main()
