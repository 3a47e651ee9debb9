"""The ``lightning-zero`` command: Lightning's CLI with omegaconf interpolation in YAML configs.

    lightning-zero fit --config configs/tiny_gpt.yaml
    lightning-zero fit --config configs/tiny_gpt.yaml --trainer.devices 3 --ckpt_path last
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

import lightning_zero  # noqa: F401  (registers the "zero1"/"zero2" strategy names)


def main(args: list[str] | None = None) -> LightningCLI:
    return LightningCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_kwargs={"parser_mode": "omegaconf"},
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
