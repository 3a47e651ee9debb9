"""A tiny GPT trained with ZeRO-2 on CPU processes, with async reshardable checkpoints.

Run it through the package's CLI, from the repository root (``make demo`` does both steps)::

    # one node, 2 processes: train 60 steps, checkpointing every 20 (async, sharded)
    python -m lightning_zero fit --config configs/tiny_gpt.yaml
    # resume from the newest checkpoint on 3 processes (the optimizer state is resharded 2 -> 3)
    python -m lightning_zero fit --config configs/tiny_gpt.yaml --trainer.devices 3 \
        --trainer.max_steps 100 --ckpt_path last
    # the held-out loss of a checkpoint (any mode, any number of processes)
    python -m lightning_zero validate --config configs/tiny_gpt.yaml --trainer.devices 1 \
        --ckpt_path runs/tiny_gpt/checkpoints/last.ckpt
    # two nodes (run on each node, NODE_RANK=0/1, MASTER_ADDR=<node 0>)
    python -m lightning_zero fit --config configs/tiny_gpt.yaml --trainer.num_nodes 2

The data is a deterministic synthetic "language" (a noisy repeating pattern over 64 tokens), so the
loss has something to learn and the run needs no download.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyGPT(LightningModule):
    def __init__(self, vocab: int = 64, width: int = 96, depth: int = 3, heads: int = 4, context: int = 32,
                 lr: float = 3e-3, weight_decay: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied input/output embedding
        nn.init.normal_(self.tokens.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), diagonal=1)
        x = self.tokens(idx) + self.positions[:t]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self):  # noqa: ANN201
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr,
        )
        warmup = 10
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class PatternText(Dataset):
    """Sequences from a fixed random permutation walk with 10% noise tokens; ``held_out`` draws
    other sequences of the same language (for validation and test)."""

    def __init__(self, vocab: int, context: int, size: int, seed: int = 0, held_out: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        successor = torch.randperm(vocab, generator=g)
        if held_out:
            g.manual_seed(seed + 1)
        starts = torch.randint(vocab, (size,), generator=g)
        seqs = torch.empty(size, context + 1, dtype=torch.long)
        seqs[:, 0] = starts
        for i in range(1, context + 1):
            seqs[:, i] = successor[seqs[:, i - 1]]
        noise = torch.rand(size, context + 1, generator=g) < 0.1
        self.data = torch.where(noise, torch.randint(vocab, seqs.shape, generator=g), seqs)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]


class PatternData(LightningDataModule):
    """Training sequences, and held-out ones of the same language for ``validate`` and ``test``."""

    def __init__(self, vocab: int = 64, context: int = 32, size: int = 4096, batch_size: int = 16,
                 eval_size: int = 128) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        return DataLoader(PatternText(hp.vocab, hp.context, hp.size), batch_size=hp.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        hp = self.hparams
        return DataLoader(PatternText(hp.vocab, hp.context, hp.eval_size, held_out=True), batch_size=hp.batch_size)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class PrintProgress(Callback):
    """One line every ``every`` steps on rank 0: step, loss, and this rank's optimizer shard."""

    def __init__(self, every: int = 10) -> None:
        self.every = every

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            shard = getattr(trainer.strategy, "optimizer_shard_numel", None)
            total = sum(p.numel() for p in pl_module.parameters())
            print(f"[demo] world size {trainer.world_size}, start at step {trainer.global_step};"
                  f" rank 0 holds {shard} of {total} parameters' optimizer state", flush=True)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        step = trainer.global_step
        if trainer.is_global_zero and step % self.every == 0:
            loss = float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs)
            print(f"[demo] step {step:4d}  loss {loss:.3f}  (ln(vocab) = {math.log(pl_module.hparams.vocab):.3f})",
                  flush=True)
