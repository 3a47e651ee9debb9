"""Pre-training a tiny GPT in a Lightning Fabric loop with ZeRO-2, litgpt-style, with async checkpoints.

The loop is the shape of litgpt's ``pretrain``: Fabric launches the processes, the learning rate follows a
linear warm-up and a cosine decay computed from the step, gradients accumulate over micro-batches under
``fabric.no_backward_sync``, ``fabric.clip_gradients`` clips by the global norm, and every ``--save-every``
steps ``fabric.save`` writes an asynchronous ``sharded`` checkpoint while training goes on. On start it
resumes from the newest committed checkpoint in ``--out-dir`` (kill it at any moment and run the same
command again: a save that did not commit is never taken). ``sharded`` checkpoints load at any number of
processes. Run it from the repository root::

    # CPU, 2 processes (Fabric starts them), bf16-true: train, then the same command resumes
    python examples/fabric_gpt.py
    python examples/fabric_gpt.py --max-steps 200
    # one node with 8 GPUs
    fabric run --accelerator cuda --devices 8 examples/fabric_gpt.py --accelerator cuda --devices 8
    # two nodes (on each: NODE_RANK=0/1, MASTER_ADDR=<node 0>), checkpoints on S3
    torchrun --nnodes 2 --node_rank $NODE_RANK --nproc_per_node 8 --master_addr $MASTER_ADDR \\
        --master_port 29500 examples/fabric_gpt.py --accelerator cuda --devices 8 --num-nodes 2 \\
        --out-dir s3://bucket/fabric-gpt

The strategy is ``ZeroLowLevelStrategy(stage=2)`` (``Fabric(strategy="zero2")`` is the same with the default
options); the checkpoint mode comes from the ``ZeroCheckpointIO`` plugin.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path

import fsspec
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples.` from any working directory

from examples.tiny_gpt import PatternText, TinyGPT  # noqa: E402
from lightning_zero.checkpoint import ZeroCheckpointIO, last_save_stats, remove, remove_incomplete  # noqa: E402
from lightning_zero.fabric import ZeroLowLevelStrategy  # noqa: E402

NAME = re.compile(r"step-(\d+)\.ckpt$")


def committed_checkpoints(directory: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the checkpoints in ``directory``, oldest first. A save has a file at its path only
    once it committed (the commit marker is written last), so every entry is complete."""
    fs, root = fsspec.core.url_to_fs(directory)
    try:
        names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(root, detail=False)]
    except FileNotFoundError:
        return []
    return sorted((int(m.group(1)), f"{directory.rstrip('/')}/{name}") for name in names if (m := NAME.match(name)))


def learning_rate(step: int, max_lr: float, warmup: int, max_steps: int, min_lr: float) -> float:
    """Linear warm-up, then cosine decay to ``min_lr`` (litgpt's ``get_lr``)."""
    if step < warmup:
        return max_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * progress))


def main() -> int:
    parser = argparse.ArgumentParser(description="litgpt-style pre-training of a tiny GPT with Fabric and ZeRO-2.")
    parser.add_argument("--out-dir", default="runs/fabric_gpt", help="checkpoint directory (local path or s3://)")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--micro-batch-size", type=int, default=4, help="sequences per process and micro-batch")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--precision", default="bf16-true" if _bf16_works() else "32-true")
    options = parser.parse_args()

    fabric = Fabric(accelerator=options.accelerator, devices=options.devices, num_nodes=options.num_nodes,
                    strategy=ZeroLowLevelStrategy(stage=2), precision=options.precision,
                    plugins=[ZeroCheckpointIO(mode="sharded", async_save=True)])
    fabric.launch()
    if options.accelerator == "cpu":
        torch.set_num_threads(1)
    fabric.seed_everything(0)  # the same initial weights on every rank
    with fabric.init_module():
        model = TinyGPT(width=32, depth=1, heads=2)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=options.lr, betas=(0.9, 0.95))
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0, "tokens": 0}

    saved = committed_checkpoints(options.out_dir)
    if saved:
        _, path = saved[-1]
        fabric.load(path, state)
        fabric.print(f"[fabric_gpt] resumed from {path} at step {state['step']} on {fabric.world_size} processes")
        if fabric.global_rank == 0:
            remove_incomplete(options.out_dir)  # leftovers of a save the previous run did not finish
    else:
        fabric.print(f"[fabric_gpt] no checkpoint in {options.out_dir}: starting at step 0 on {fabric.world_size}"
                     " processes")

    data = PatternText(vocab=64, context=32, size=4096)
    rank, world_size = fabric.global_rank, fabric.world_size
    window_start, window_tokens = time.perf_counter(), 0
    while state["step"] < options.max_steps:
        step = state["step"]
        lr = learning_rate(step, options.lr, options.warmup, options.max_steps, options.lr / 10)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # A step's global batch depends on the step only: a resumed run sees what an uninterrupted one would.
        g = torch.Generator().manual_seed(step)
        rows = torch.randint(len(data), (options.accumulate, options.micro_batch_size * world_size), generator=g)
        for micro in range(options.accumulate):
            batch = fabric.to_device(data.data[rows[micro]].chunk(world_size)[rank])
            with fabric.no_backward_sync(model, enabled=micro < options.accumulate - 1):
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
                fabric.backward(loss / options.accumulate)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] = step + 1
        tokens = options.accumulate * options.micro_batch_size * world_size * (batch.shape[1] - 1)
        state["tokens"] += tokens
        window_tokens += tokens
        if state["step"] % options.save_every == 0 or state["step"] == options.max_steps:
            elapsed = time.perf_counter() - window_start
            fabric.print(f"[fabric_gpt] step {state['step']} loss {loss.item():.3f} lr {lr:.2e}"
                         f" {window_tokens / elapsed:,.0f} tokens/s")
            window_start, window_tokens = time.perf_counter(), 0
        if state["step"] % options.save_every == 0:
            path = f"{options.out_dir.rstrip('/')}/step-{state['step']:06d}.ckpt"
            called = time.perf_counter()
            fabric.save(path, state)  # returns once queued; the previous save is finalized first
            blocked = time.perf_counter() - called
            if fabric.global_rank == 0:
                stats = last_save_stats()  # the previous save, committed by now
                previous = (f"; the previous one committed {stats.committed_after_s * 1e3:.0f} ms after its call"
                            if stats else "")
                print(f"[fabric_gpt] saving {path}: the loop waited {blocked * 1e3:.1f} ms{previous}", flush=True)
                for _, old in committed_checkpoints(options.out_dir)[:-1]:  # keep the newest committed and this one
                    remove(old)  # runs after the save in flight has committed
    fabric.strategy.teardown()  # the save in flight commits
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    fabric.print(f"[fabric_gpt] finished at step {state['step']}: {state['tokens']} tokens, weights checksum"
                 f" {checksum:.10e}")
    return 0


def _bf16_works() -> bool:
    """bf16 matrix products run on this machine's CPU (they do on every x86-64 and arm64 torch build we know)."""
    try:
        torch.ones(2, 2, dtype=torch.bfloat16) @ torch.ones(2, 2, dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
