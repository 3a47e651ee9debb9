"""A tiny Hugging Face GPT-2 inside a LightningModule, for the export tests.

Trainer ranks fork from the test fork server and receive the module by pickling, so the class lives
in an importable module. Random init from a fixed seed, no hub access.
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 64
CONTEXT = 16
GLOBAL_BATCH = 4


def tiny_config() -> GPT2Config:
    # No dropout: the trained module and the exported model must compute the same logits.
    return GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=CONTEXT,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)


def fixed_input() -> torch.Tensor:
    """The token ids the logits are compared on."""
    return torch.randint(VOCAB, (2, CONTEXT), generator=torch.Generator().manual_seed(123))


class TokenBatches(Dataset):
    """Item i is the i-th global batch of random tokens; each rank takes its slice in the step."""

    def __init__(self, steps: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.items = [torch.randint(VOCAB, (GLOBAL_BATCH, CONTEXT), generator=g) for _ in range(steps)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.items[index]


def token_loader(steps: int) -> DataLoader:
    """Use with ``Trainer(use_distributed_sampler=False)``."""
    return DataLoader(TokenBatches(steps), batch_size=None, shuffle=False)


class GPT2Module(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(tiny_config())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids).logits

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        ids = batch.chunk(self.trainer.world_size)[self.global_rank]
        return self.model(ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)
