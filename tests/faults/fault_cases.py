"""Shared by the fault tests: the modes, a tiny checkpoint tree, and ranks that may die.

Functions here run inside ``run_distributed`` workers or :func:`start_ranks` processes, so they
live in an importable module.
"""

from __future__ import annotations

import os
import resource
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import Callback
from lightning_cases import NetModule

from lightning_zero.checkpoint import FlatShard

MODES = ("local", "sharded", "full")


def tree(value: float) -> dict[str, Any]:
    return {"w": FlatShard(torch.full((50,), value), (50,), 0, 1), "b": torch.full((3,), value), "meta": {"n": 1}}


def sharded_tree(rank: int, world_size: int, value: float, numel: int = 1000,
                 big_numel: int = 0) -> dict[str, Any]:
    """This rank's part of a tree of flat shards (and one replicated tensor); ``big_numel`` adds a
    shard ``big`` between two small ones, for out-of-memory cases."""
    from lightning_zero.engine.sharding import EvenShard

    def shard(n: int) -> FlatShard:
        layout = EvenShard(n, world_size)
        local = torch.full((layout.end(rank) - layout.start(rank),), value)
        return FlatShard(local, (n,), rank, world_size)

    out: dict[str, Any] = {"a": shard(numel)}
    if big_numel:
        out["big"] = shard(big_numel)
    out.update({"c": shard(numel), "b": torch.full((3,), value), "meta": {"n": 1}})
    return out


# ---- real out-of-memory on one rank ----------------------------------------------------------


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def limit_memory(headroom_bytes: int) -> None:
    """Make this process's allocations beyond ``headroom_bytes`` more address space fail (RLIMIT_AS)."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_address_space() + headroom_bytes, hard))


def unlimit_memory() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))


def timed(fn: Callable[[], Any]) -> dict[str, Any]:
    """``fn()``'s error (type and message) or None, and how long it took."""
    start = time.perf_counter()
    error = None
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "seconds": time.perf_counter() - start}


def save_while_one_rank_runs_out_of_memory(rank: int, world_size: int, root: str, failing_rank: int,
                                           mode: str) -> dict[str, Any]:
    """A good save, then one whose staging cannot allocate on ``failing_rank`` (a real RLIMIT_AS OOM). The second is
    an async save, finalized: a synchronous one writes the live tensors and stages no copy ([Note: synchronous saves
    write the live state])."""
    from lightning_zero.checkpoint import async_save, maybe_finalize_async_calls, save

    def save_staged(state: Any, path: str) -> None:
        async_save(state, path, mode=mode)
        maybe_finalize_async_calls(blocking=True)

    big = 64 * 2**20 // 4 * world_size  # 64 MiB of float32 per rank
    state = sharded_tree(rank, world_size, 1.0, big_numel=big)
    save(state, f"{root}/good.ckpt", mode=mode)  # also starts the saver thread before the limit
    if rank == failing_rank:
        limit_memory(16 * 2**20)
    try:
        result = timed(lambda: save_staged(sharded_tree(rank, world_size, 2.0, big_numel=big) if rank != failing_rank
                                           else state, f"{root}/oom.ckpt"))
    finally:
        unlimit_memory()
    return result


def full_gather_while_one_rank_runs_out_of_memory(rank: int, world_size: int, failing_rank: int) -> dict[str, Any]:
    """The full-mode gather (the one plain CheckpointIO plugins get too) with a real OOM on one rank
    at the second of three tensors."""
    from lightning_zero.checkpoint.modes.full import gather_tree_to_rank0

    state = sharded_tree(rank, world_size, 1.0, big_numel=64 * 2**20 // 4 * world_size)
    if rank == failing_rank:
        limit_memory(16 * 2**20)
    try:
        return timed(lambda: gather_tree_to_rank0(state, None))
    finally:
        unlimit_memory()


def load_with_one_rank_failing(rank: int, world_size: int, root: str, failing_rank: int, mode: str,
                               damage: str) -> dict[str, Any]:
    """Save ``<root>/ckpt`` on every rank, then load it where ``failing_rank`` fails before the data
    is read: ``"other-model"`` (its tree has other keys) or ``"missing-file"`` (its local file is gone)."""
    import glob

    from lightning_zero.checkpoint import load, save

    path = f"{root}/ckpt"
    save(sharded_tree(rank, world_size, 1.0), path, mode=mode)
    dist.barrier()
    target = sharded_tree(rank, world_size, 0.0)
    if rank == failing_rank and damage == "other-model":
        target["renamed"] = target.pop("a")
    if rank == failing_rank and damage == "missing-file":
        (victim,) = glob.glob(f"{root}/_zero_data/ckpt/*/rank{rank:05d}-of-*.pt")
        os.remove(victim)
    result = timed(lambda: load(target, path))
    result["untouched"] = bool(target["c"].local.eq(0.0).all())
    return result


# ---- ranks that die or freeze ----------------------------------------------------------------


@dataclass
class Ranks:
    processes: list[Any]
    out_dir: str

    def wait(self, deadline_s: float, survivors: list[int]) -> dict[int, Any]:
        """Each survivor's result once it exits (within ``deadline_s``); then every process is killed."""
        end = time.monotonic() + deadline_s
        for rank in survivors:
            self.processes[rank].join(max(0.0, end - time.monotonic()))
        results: dict[int, Any] = {}
        for rank in survivors:
            path = os.path.join(self.out_dir, f"rank{rank}.pt")
            results[rank] = torch.load(path, weights_only=False) if os.path.exists(path) else None
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join()
        return results


def start_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float) -> Ranks:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo processes (fork server) whose process
    group ``timeout`` is ``timeout_s``. Unlike ``run_distributed``, a rank that dies does not take the
    others down: the test sees what each survivor did on its own."""
    from _dist import free_port

    out_dir = tempfile.mkdtemp(prefix="lightning_zero_ranks_")
    context = mp.get_context("forkserver")
    port = free_port()
    processes = [context.Process(target=_rank_main, args=(rank, world_size, port, timeout_s, fn, args, out_dir))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    return Ranks(processes, out_dir)


def _rank_main(rank: int, world_size: int, port: int, timeout_s: float, fn: Callable[..., Any], args: tuple,
               out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    try:
        result: Any = fn(rank, world_size, *args)
    except BaseException as exc:  # reported to the test
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)  # a peer is gone: destroying the group could wait on it


def _die(how: str) -> None:
    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)


def save_while_a_peer_dies(rank: int, world_size: int, root: str, victim: int, how: str, mode: str) -> dict[str, Any]:
    """A good save; then an async save during which ``victim`` is SIGKILLed or SIGSTOPped (right
    after queuing it); the survivors' finalize."""
    from lightning_zero.checkpoint import async_save, maybe_finalize_async_calls, save

    save(sharded_tree(rank, world_size, 1.0), f"{root}/last.ckpt", mode=mode)
    async_save(sharded_tree(rank, world_size, 2.0), f"{root}/last.ckpt", mode=mode)
    if rank == victim:
        _die(how)
    return timed(lambda: maybe_finalize_async_calls(blocking=True))


def train_while_a_peer_dies(rank: int, world_size: int, victim: int, how: str) -> dict[str, Any]:
    """ZeRO-2 training steps in which ``victim`` is SIGKILLed or SIGSTOPped at step 2."""
    import torch.nn.functional as F
    from checkpoint_cases import build
    from engine_cases import global_batch

    model, engine = build(rank, world_size)
    opt = engine.optimizers[0]

    def steps() -> None:
        for step in range(1000):
            if step == 2 and rank == victim:
                _die(how)
            opt.zero_grad()
            x, y = global_batch(step, 0, world_size)
            F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
            engine.ensure_flushed()
            opt.step()

    return timed(steps)



# ---- bad input during training -------------------------------------------------------------


class NaNOnRank1(NetModule):
    """The Lightning cases' module whose rank-1 half of the batch at step 1 holds an infinity."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        if batch_idx == 1:
            x = x.clone()
            x[x.shape[0] // 2:] = float("inf")  # rank 1's half of the global batch
        return super().training_step((x, y), batch_idx)


# ---- long runs: resources and retention ------------------------------------------------------


def process_figures() -> dict[str, int]:
    """This process's threads, open file descriptors and resident memory (bytes)."""
    with open("/proc/self/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")),
            "rss": rss_kb * 1024}


class Watch(Callback):
    """Between steps: record ``process_figures`` (every rank) and, on rank 0, that the checkpoint
    directory holds at least one complete, loadable checkpoint (read whole, in this process)."""

    def __init__(self, out_dir: str, ckpt_dir: str, every: int = 1, storage_options: dict[str, Any] | None = None,
                 check_loadable: bool = True) -> None:
        self.out_dir, self.ckpt_dir, self.every = out_dir, ckpt_dir, every
        self.storage_options = storage_options or {}
        self.check_loadable = check_loadable

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        import json

        step = trainer.global_step
        if step % self.every:
            return
        record: dict[str, Any] = {"step": step, **process_figures()}
        if trainer.is_global_zero and self.check_loadable and step > 0:
            record["complete"] = complete_checkpoints(self.ckpt_dir, self.storage_options)
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")


def complete_checkpoints(ckpt_dir: str, storage_options: dict[str, Any]) -> list[str]:
    """The newest name in ``ckpt_dir`` that loads whole right now (what a crash at this moment would
    leave to resume from), or none."""
    from lightning_zero.checkpoint import read_lightning_checkpoint
    from lightning_zero.checkpoint.store import cleanup, storage

    loc = storage.resolve(f"{ckpt_dir.rstrip('/')}/probe", storage_options)
    good = []
    for candidate in cleanup.newest_siblings(loc):
        try:
            read_lightning_checkpoint(candidate, storage_options, optimizer=True)
        except Exception:  # noqa: BLE001 - not (yet, or no longer) a checkpoint
            continue
        good.append(candidate.rsplit("/", 1)[-1])
        break
    return good
