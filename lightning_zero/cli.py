"""The ``lightning-zero`` command: Lightning's CLI with omegaconf interpolation in YAML configs, and
``convert`` for checkpoints.

    lightning-zero fit --config configs/tiny_gpt.yaml
    lightning-zero fit --config configs/tiny_gpt.yaml --trainer.devices 3 --ckpt_path last
    lightning-zero validate --config configs/tiny_gpt.yaml --ckpt_path runs/tiny_gpt/checkpoints/last.ckpt
    lightning-zero convert runs/tiny_gpt/checkpoints/last.ckpt model.ckpt          # one full Lightning file
    lightning-zero convert runs/tiny_gpt/checkpoints/last.ckpt hf-model --to hf    # a save_pretrained folder
    lightning-zero convert --from deepspeed runs/ds/epoch=0-step=20.ckpt model.ckpt  # a DeepSpeed ZeRO-1/2 folder
    lightning-zero convert runs/tiny_gpt/checkpoints/last.ckpt fsdp2-dcp --to dcp   # a DCP folder FSDP2 loads
    lightning-zero convert runs/tiny_gpt/checkpoints/last.ckpt ds.ckpt --to deepspeed --world-size 8  # DeepSpeed ZeRO-1/2
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import jsonargparse
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

import lightning_zero  # noqa: F401  (registers the "zero1"/"zero2" strategy names)
from lightning_zero import _compat

MASK = "***"
SECRET_NAMES = frozenset({
    "secret", "password", "token", "session_token", "aws_secret_access_key", "aws_session_token",
    "secret_access_key", "client_secret", "account_key", "sas_token", "credentials",
})
"""Masked wherever they appear in a saved config."""
STORAGE_KEY_NAMES = frozenset({"key", "aws_access_key_id", "access_key", "access_key_id", "username"})
"""Masked inside ``storage_options`` (s3fs's ``key`` is the access key id)."""


def mask_credentials(value: Any, in_storage_options: bool = False) -> Any:
    """A copy of a parsed config (jsonargparse Namespaces, dicts, lists) with credentials replaced by
    ``***``: what LightningCLI saves as ``config.yaml`` must not hold the secrets a YAML or the command
    line gave ``ZeroCheckpointIO(storage_options=...)``."""
    if isinstance(value, jsonargparse.Namespace):
        out = jsonargparse.Namespace()
        for key, item in vars(value).items():
            setattr(out, key, _masked(key, item, in_storage_options))
        return out
    if isinstance(value, dict):
        return {key: _masked(key, item, in_storage_options) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(mask_credentials(item, in_storage_options) for item in value)
    return value


def _masked(key: Any, item: Any, in_storage_options: bool) -> Any:
    name = str(key).lower()
    if item is not None and not isinstance(item, (dict, list, jsonargparse.Namespace)) and (
        name in SECRET_NAMES or (in_storage_options and name in STORAGE_KEY_NAMES)
    ):
        return MASK
    return mask_credentials(item, in_storage_options or name == "storage_options")


class MaskedSaveConfigCallback(SaveConfigCallback):
    """LightningCLI's ``config.yaml`` writer, with :func:`mask_credentials` applied to what it saves
    (the objects were built from the unmasked config already)."""

    def __init__(self, parser: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(parser, mask_credentials(config), *args, **kwargs)


def run_cli(args: list[str] | None = None) -> LightningCLI:
    """The LightningCLI object (for tests and programs that want the trainer and model afterwards)."""
    # Configs name classes of the project they sit in (`examples.tiny_gpt.TinyGPT`); a console
    # script, unlike `python -m`, does not put the working directory on the import path.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    # "omegaconf+" resolves `${...}` once the command line is applied, so that
    # `--trainer.default_root_dir runs/b` also moves `${trainer.default_root_dir}/checkpoints` ("omegaconf"
    # resolves each YAML file alone, before the overrides). Its paths start at the subcommand's root
    # (`fit.trainer...`); the configs' `${trainer...}` are read from their own root instead.
    _compat.omegaconf_plus_reads_from_the_file_root()
    return LightningCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_kwargs={"parser_mode": "omegaconf+"},
        save_config_callback=MaskedSaveConfigCallback,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


def convert_main(args: list[str]) -> int:
    from lightning_zero.checkpoint import CheckpointCorruptError, CheckpointNotFoundError, convert

    parser = argparse.ArgumentParser(
        prog="lightning-zero convert",
        description="Turn a checkpoint of any mode (local path or s3://) into one full Lightning file that"
        " plain PyTorch and Lightning read, a Hugging Face save_pretrained folder, or a torch DCP folder that FSDP2"
        " loads with set_state_dict (--to dcp), or a folder Lightning's DeepSpeedStrategy resumes (--to deepspeed). Runs in"
        " this process,"
        " on CPU, with no process group.",
    )
    parser.add_argument("src", help="checkpoint path or URL (the file ModelCheckpoint wrote)")
    parser.add_argument("dst", help="output file (--to lightning) or new folder (--to hf, dcp, deepspeed)")
    parser.add_argument("--to", choices=("lightning", "hf", "dcp", "deepspeed"), default="lightning",
                        help="dcp: FSDP2's get_model_state_dict/get_optimizer_state_dict layout under 'model' and"
                        " 'optimizer', Lightning's loops, callbacks and schedulers beside it in lightning_state.pt;"
                        " deepspeed: a ZeRO-1/2 checkpoint folder (latest, checkpoint/) with the optimizer's"
                        " partitions for --world-size ranks")
    parser.add_argument("--world-size", type=int, default=None,
                        help="--to deepspeed: the DeepSpeed data-parallel world size that resumes it (default: the"
                        " one that saved SRC)")
    parser.add_argument("--stage", type=int, choices=(1, 2), default=None,
                        help="--to deepspeed: the ZeRO stage (default: a DeepSpeed source's, else 2)")
    parser.add_argument("--from", dest="source", choices=("auto", "deepspeed"), default="auto",
                        help="deepspeed: SRC is a DeepSpeed ZeRO-1/2 checkpoint folder (read without DeepSpeed);"
                        " auto (the default) tells one by its files")
    parser.add_argument("--optimizer", action=argparse.BooleanOptionalAction, default=True,
                        help="--no-optimizer: weights and Lightning's state only (a DeepSpeed checkpoint of an"
                        " optimizer other than Adam/AdamW converts that way)")
    parser.add_argument("--max-shard-size", default="5GB", help="--to hf: largest safetensors file")
    parser.add_argument("--weights-only", action=argparse.BooleanOptionalAction, default=True,
                        help="read the checkpoint's non-tensor state as torch.load(weights_only=True) does"
                        " (the default); --no-weights-only unpickles any object it holds: only for a file you trust")
    parser.add_argument("--storage-option", dest="storage_options", action="append", default=[], metavar="KEY=VALUE",
                        help="a storage option for SRC and DST, as ZeroCheckpointIO(storage_options=...) takes them;"
                        " repeat for more (client=s3torchconnector, endpoint_url=..., profile=...). Credentials are"
                        " best left to the environment or a profile")
    options = parser.parse_args(args)
    try:
        storage_options = _storage_options(options.storage_options)
        written = convert(options.src, options.dst, to=options.to, max_shard_size=options.max_shard_size,
                          storage_options=storage_options,
                          weights_only=options.weights_only, source=options.source, optimizer=options.optimizer,
                          world_size=options.world_size, stage=options.stage)
    except (CheckpointNotFoundError, CheckpointCorruptError, ValueError, ImportError, FileExistsError) as exc:
        # The user's input (a path that is no checkpoint, --to hf without a transformers model): the
        # message names the fix, a traceback would bury it.
        print(f"lightning-zero convert: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {written}")
    return 0


def _storage_options(pairs: list[str]) -> dict[str, Any] | None:
    """``["client=s3torchconnector", "anon=true"]`` as a dict; values read as YAML scalars (``true``, ``5``)."""
    import yaml

    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--storage-option {pair!r}: give KEY=VALUE, e.g. --storage-option client=s3torchconnector")
        options[key] = yaml.safe_load(value) if value else ""
    return options or None


def main(args: list[str] | None = None) -> int:
    """Console entry point: exits 0 on success."""
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["convert"]:
        return convert_main(argv[1:])
    run_cli(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
