"""LoRA fine-tuning of a GPT-2 with ZeRO-2, checkpoints that hold the adapters only, and a merged export.

The base model is a tiny random GPT-2 (no hub access; in real use, ``GPT2LMHeadModel.from_pretrained``):
``peft`` wraps it with LoRA adapters on the attention projections and freezes the rest. The optimizer
(and so ZeRO) holds the adapters; ``on_save_checkpoint`` drops the frozen base from every checkpoint and
``strict_loading = False`` lets a resume fill the adapters and keep the base the module was built with
(docs/checkpoints.md, "What a checkpoint holds"). Run from the repository root::

    python examples/lora_gpt2.py --root runs/lora     # fine-tune on 2 CPU processes, resume on 3, export
    # one phase alone (what the above runs, each in its own processes):
    python examples/lora_gpt2.py --phase fit --devices 2 --steps 20 --root runs/lora
    python examples/lora_gpt2.py --phase fit --devices 3 --steps 30 --ckpt-path last --root runs/lora
    python examples/lora_gpt2.py --phase export --root runs/lora

On GPUs: ``--accelerator gpu --devices 8``; with ``torchrun`` as in docs/multi-node.md. The export
merges the adapters into the base (``merge_and_unload``) and writes a folder that
``AutoModelForCausalLM.from_pretrained`` reads without this package or ``peft``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from peft import LoraConfig, get_peft_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples.` from any working directory

from examples.hf_gpt2 import tiny_gpt2_config  # noqa: E402
from examples.tiny_gpt import PatternData  # noqa: E402
from lightning_zero import ZeroCheckpointIO, ZeroLowLevelStrategy  # noqa: E402
from lightning_zero.checkpoint import read_lightning_checkpoint  # noqa: E402

ADAPTER = "lora_"


class LoraGPT2(LightningModule):
    """A frozen GPT-2 base with trainable LoRA adapters (``peft``) on its attention projections."""

    def __init__(self, rank: int = 4, lr: float = 3e-3, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        from transformers import GPT2LMHeadModel

        torch.manual_seed(seed)  # the same base and the same adapter init on every rank
        base = GPT2LMHeadModel(tiny_gpt2_config())
        base.loss_type = "ForCausalLM"
        config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=["c_attn", "c_proj"],
                            fan_in_fan_out=True)  # GPT-2's Conv1D layers store weights transposed
        self.model = get_peft_model(base, config)
        self.adapters_only = True
        self.strict_loading = False  # checkpoints lack the base: the module keeps its own

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.adapters_only:
            for key in [k for k in checkpoint["state_dict"] if ADAPTER not in k]:
                del checkpoint["state_dict"][key]


def disk_bytes(path: Path) -> int:
    """A checkpoint's bytes: the marker and its data directory (``sharded`` keeps it beside the marker)."""
    data = path.parent / "_zero_data" / path.name
    files = [path] + ([f for f in data.rglob("*") if f.is_file()] if data.exists() else [])
    return sum(f.stat().st_size for f in files if f.is_file())


def fit(root: Path, devices: int, steps: int, ckpt_path: str | None, accelerator: str) -> None:
    checkpoints = root / "checkpoints"
    trainer = Trainer(
        accelerator=accelerator, devices=devices, max_steps=steps, default_root_dir=root, logger=False,
        strategy=ZeroLowLevelStrategy(stage=2),
        plugins=[ZeroCheckpointIO(mode="sharded", async_save=True)],
        callbacks=[ModelCheckpoint(dirpath=checkpoints, filename="{step}", every_n_train_steps=10, save_top_k=-1,
                                   save_last=True)],
        enable_progress_bar=False, enable_model_summary=False,
    )
    module = LoraGPT2()
    trainer.fit(module, PatternData(context=32, batch_size=16), ckpt_path=ckpt_path)
    # The same state with the base kept, for the size comparison.
    module.adapters_only = False
    trainer.save_checkpoint(root / "with-base.ckpt")
    if trainer.is_global_zero:
        trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
        total = sum(p.numel() for p in module.parameters())
        last = checkpoints / "last.ckpt"
        print(f"[lora] {devices} processes, global step {trainer.global_step}: {trainable} of {total} parameters"
              f" train; last.ckpt {disk_bytes(last) / 1e3:.1f} kB (adapters), with the base"
              f" {disk_bytes(root / 'with-base.ckpt') / 1e3:.1f} kB")


@torch.no_grad()
def export(root: Path) -> Path:
    """The last checkpoint's adapters into a fresh module, merged into the base, saved for transformers."""
    from transformers import AutoModelForCausalLM

    module = LoraGPT2()
    saved = read_lightning_checkpoint(str(root / "checkpoints" / "last.ckpt"), optimizer=False)
    missing, unexpected = module.load_state_dict(saved["state_dict"], strict=False)
    assert not unexpected and all(ADAPTER not in key for key in missing), (missing, unexpected)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = module.model(input_ids=tokens).logits
    merged = module.model.merge_and_unload()
    folder = root / "merged"
    merged.save_pretrained(folder)
    exported = AutoModelForCausalLM.from_pretrained(folder)(input_ids=tokens).logits
    difference = float((exported - expected).abs().max())
    print(f"[lora] wrote {folder}: merged model's logits differ from the adapted module's by {difference:.2e}")
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(description="LoRA fine-tuning with ZeRO-2 and adapter-only checkpoints.")
    parser.add_argument("--root", default="runs/lora")
    parser.add_argument("--phase", choices=["all", "fit", "export"], default="all")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--accelerator", default="cpu")
    options = parser.parse_args()
    root = Path(options.root)
    if options.phase == "fit":
        fit(root, options.devices, options.steps, options.ckpt_path, options.accelerator)
    elif options.phase == "export":
        export(root)
    else:
        me = [sys.executable, str(Path(__file__).resolve()), "--root", str(root), "--accelerator", options.accelerator]
        for args in (["--phase", "fit", "--devices", "2", "--steps", str(options.steps)],
                     ["--phase", "fit", "--devices", "3", "--steps", str(options.steps + 10), "--ckpt-path", "last"],
                     ["--phase", "export"]):
            subprocess.run(me + args, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
