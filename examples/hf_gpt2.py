"""A Hugging Face ``transformers`` GPT-2 inside a LightningModule, trained with ZeRO-2, exported with
``save_pretrained``.

The model is a tiny random GPT-2 (no hub access, nothing downloaded); the data is the synthetic
language of :mod:`examples.tiny_gpt`. Run it from the repository root::

    # 2 CPU processes, 40 steps, a sharded checkpoint every 20 and a Hugging Face folder at the end
    python examples/hf_gpt2.py --root runs/hf_gpt2
    # the same export later, from any checkpoint (any mode, local or s3://), in one process
    lightning-zero convert runs/hf_gpt2/checkpoints/last.ckpt runs/hf_gpt2/hf --to hf
    # then, without lightning_zero:
    python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('runs/hf_gpt2/hf')"

Checkpoints of a module holding a ``PreTrainedModel`` record its class and config, which is what
``convert --to hf`` needs; the export writes the weights in the dtype they were trained in.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import GPT2Config, GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples.` from any working directory

from examples.tiny_gpt import PatternData  # noqa: E402
from lightning_zero import ZeroCheckpointIO, ZeroLowLevelStrategy  # noqa: E402
from lightning_zero.checkpoint import save_pretrained  # noqa: E402


def tiny_gpt2_config(vocab: int = 64, context: int = 32) -> GPT2Config:
    # No dropout, so the exported model computes exactly the trained module's logits; the special tokens
    # inside this vocabulary (GPT-2's default, 50256, is outside it and transformers warns).
    return GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=vocab, n_positions=context,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                      bos_token_id=vocab - 1, eos_token_id=vocab - 1)


class GPT2Module(LightningModule):
    """Language modelling with a ``GPT2LMHeadModel`` held as ``self.model``."""

    def __init__(self, vocab: int = 64, context: int = 32, lr: float = 3e-3, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)  # the same random init on every rank
        self.model = GPT2LMHeadModel(tiny_gpt2_config(vocab, context))
        # The loss transformers would pick anyway, named so that it does not warn at every forward.
        self.model.loss_type = "ForCausalLM"

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids).logits

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        # PatternData yields context + 1 tokens; GPT-2 shifts the labels itself.
        loss = self.model(batch[:, :-1], labels=batch[:, :-1]).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.model(batch[:, :-1], labels=batch[:, :-1]).loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main() -> int:
    parser = argparse.ArgumentParser(description="Train a tiny GPT-2 with ZeRO-2 and export it with save_pretrained.")
    parser.add_argument("--root", default="runs/hf_gpt2")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=20, help="steps between checkpoints")
    options = parser.parse_args()
    root = Path(options.root)
    trainer = Trainer(
        accelerator="cpu", devices=options.devices, max_steps=options.steps, default_root_dir=root,
        strategy=ZeroLowLevelStrategy(stage=2),
        plugins=[ZeroCheckpointIO(mode="sharded", async_save=True)],
        callbacks=[ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=options.save_every,
                                   save_last="link")],
        logger=False,
    )
    module = GPT2Module()
    trainer.fit(module, PatternData(context=32, batch_size=16))
    if trainer.is_global_zero:
        # The parameters are whole on every rank after fit: rank 0 writes the folder from the live module.
        folder = save_pretrained(module, str(root / "hf"))
        print(f"[hf_gpt2] wrote {folder} (AutoModelForCausalLM.from_pretrained reads it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
