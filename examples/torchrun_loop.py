"""A plain PyTorch training loop with ZeRO-2 and the functional checkpoint API, no Lightning Trainer.

It saves an async ``sharded`` checkpoint every ``--save-every`` steps, keeps the newest two, and on
start resumes from the newest committed one in ``--dir`` (kill it at any moment and start it again:
a save that did not commit is never taken, and its leftovers are deleted). Because the checkpoints
are ``sharded``, the restart may use another number of processes. Run it from the repository root::

    # one node, 2 processes (CPU, gloo)
    torchrun --nproc_per_node 2 examples/torchrun_loop.py --dir runs/loop --steps 200
    # kill it (Ctrl-C, or SIGKILL), then the same command resumes; or resume on 3 processes:
    torchrun --nproc_per_node 3 examples/torchrun_loop.py --dir runs/loop --steps 200
    # two nodes: on each, with NODE_RANK=0/1 and MASTER_ADDR=<node 0>
    torchrun --nnodes 2 --node_rank $NODE_RANK --nproc_per_node 8 --master_addr $MASTER_ADDR \\
        --master_port 29500 examples/torchrun_loop.py --dir s3://bucket/loop --backend nccl

The calls, in the order a loop makes them:

* ``ZeroEngine(model, [optimizer], ZeroConfig(stage=2))`` shards the optimizer state evenly;
* ``load_zero_state_dict(engine, model, path)`` restores masters, optimizer state, weights, buffers;
* ``async_save(zero_state_dict(engine, model), path)`` returns at once; the tensors are copied in
  the background, and ``wait_for_staging()`` before the next ``opt.step()`` makes sure the copy is
  done before the update changes them;
* ``maybe_finalize_async_calls(blocking=True)`` at the end (and inside every next save) waits for
  the commit and raises a failed save's error.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples.` from any working directory

from examples.tiny_gpt import PatternText, TinyGPT  # noqa: E402
from lightning_zero import ZeroConfig, ZeroEngine  # noqa: E402
from lightning_zero.checkpoint import (  # noqa: E402
    async_save,
    last_save_stats,
    load_zero_state_dict,
    maybe_finalize_async_calls,
    remove,
    remove_incomplete,
    wait_for_staging,
    zero_state_dict,
)
from lightning_zero.checkpoint.store.storage import resolve  # noqa: E402

NAME = re.compile(r"step-(\d+)\.ckpt$")


def committed_checkpoints(directory: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the checkpoints in ``directory``, oldest first. Only committed saves have
    a file at their path (the commit marker is written last), so every entry is complete."""
    loc = resolve(directory)
    try:
        names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in loc.fs.ls(loc.path, detail=False)]
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), f"{directory.rstrip('/')}/{name}") for name in names if (m := NAME.match(name))]
    return sorted(found)


def main() -> int:
    parser = argparse.ArgumentParser(description="ZeRO-2 in a plain loop, with async checkpoints that resume.")
    parser.add_argument("--dir", default="runs/loop", help="checkpoint directory (local path or s3://)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--backend", default="gloo")
    options = parser.parse_args()

    dist.init_process_group(options.backend)  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyGPT(width=32, depth=1, heads=2)
    engine = ZeroEngine(model, [torch.optim.AdamW(model.parameters(), lr=3e-3)], ZeroConfig(stage=2))
    opt = engine.optimizers[0]

    start = 0
    saved = committed_checkpoints(options.dir)
    if saved:
        start, path = saved[-1]
        load_zero_state_dict(engine, model, path)
        if rank == 0:
            print(f"[loop] resumed from {path} at step {start} on {world_size} processes", flush=True)
            # Leftovers of saves that never committed (the run before was killed mid-save).
            remove_incomplete(options.dir)
    elif rank == 0:
        print(f"[loop] no checkpoint in {options.dir}: starting at step 0 on {world_size} processes", flush=True)

    data = PatternText(vocab=64, context=32, size=4096)
    for step in range(start, options.steps):
        # The global batch of a step depends on the step only, so a resumed run sees the same data
        # as an uninterrupted one, whatever the number of processes.
        g = torch.Generator().manual_seed(step)
        batch = data.data[torch.randint(len(data), (options.batch_size * world_size,), generator=g)]
        loss = model.loss(batch.chunk(world_size)[rank])
        loss.backward()
        wait_for_staging()  # a save in flight must have copied the shards before the update changes them
        opt.step()
        opt.zero_grad()
        done = step + 1
        if done % options.save_every == 0:
            path = f"{options.dir.rstrip('/')}/step-{done:06d}.ckpt"
            # Returns at once, after finalizing the previous save (its error, if any, is raised here).
            async_save(zero_state_dict(engine, model), path, mode="sharded", marker_fields={"global_step": done})
            if rank == 0:
                stats = last_save_stats()  # the previous save, committed by now
                previous = (f"; step {stats.step} committed {stats.committed_after_s * 1e3:.0f} ms after its call,"
                            f" blocked {stats.blocked_s * 1e3:.1f} ms") if stats else ""
                print(f"[loop] step {done} loss {loss.item():.3f}: saving {path}{previous}", flush=True)
                for _, old in committed_checkpoints(options.dir)[:-1]:  # keep the newest committed and this one
                    remove(old)  # runs after the save in flight has committed
    maybe_finalize_async_calls(blocking=True)
    if rank == 0:
        print(f"[loop] finished at step {max(start, options.steps)}", flush=True)
    engine.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
