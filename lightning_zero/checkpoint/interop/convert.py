"""``lightning-zero convert``: any checkpoint of this package as one file or a Hugging Face folder.

Runs in one CPU process with no process group, reading local paths and ``s3://`` alike through
:mod:`~lightning_zero.checkpoint.reader`:

* ``to="lightning"``: one ``full`` Lightning checkpoint (weights, optimizer state in PyTorch's
  per-parameter form, loops, callbacks, the fp32 masters) that ``torch.load(weights_only=True)``,
  ``LightningModule.load_from_checkpoint`` and a plain ``ddp`` resume read; a checkpoint ``fabric.save``
  wrote becomes the file Fabric's DDP writes (``torch.load(dst)["model"]``: [Note: Fabric's layout] in
  fabric_tree.py);
* a DeepSpeed ZeRO-1/2 checkpoint folder (``--from deepspeed``) becomes the same ``full`` Lightning file:
  its weights, fp32 masters, Adam moments and steps per parameter, param groups, and the client state Lightning's
  DeepSpeedStrategy saved (loops, callbacks, schedulers), read without DeepSpeed
  (:mod:`~lightning_zero.checkpoint.formats.deepspeed_in`);
* ``to="dcp"``: a torch DCP folder in FSDP2's ``get_model_state_dict`` / ``get_optimizer_state_dict`` layout,
  Lightning's state beside it (:mod:`~lightning_zero.checkpoint.interop.dcp_out`);
* ``to="deepspeed"``: the ZeRO-1/2 folder Lightning's DeepSpeedStrategy resumes with its optimizer state, for a
  DeepSpeed world size of the caller's (:mod:`~lightning_zero.checkpoint.interop.deepspeed_out`);
* ``to="hf"``: a ``save_pretrained`` folder (``config.json``, ``model.safetensors``, sharded with an
  index above ``max_shard_size``, tied weights stored once) for a module that holds a
  ``transformers`` model; the checkpoint records that model's class and config when it is saved.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Literal

from torch import nn

from lightning_zero.checkpoint.formats import deepspeed_files
from lightning_zero.checkpoint.interop.dcp_out import to_dcp
from lightning_zero.checkpoint.interop.deepspeed_out import to_deepspeed
from lightning_zero.checkpoint.reader import META_KEY, read_lightning_checkpoint, to_fabric_layout
from lightning_zero.checkpoint.store import file_io, storage


def convert(src: str, dst: str, *, to: Literal["lightning", "hf", "dcp", "deepspeed"] = "lightning",
            storage_options: dict[str, Any] | None = None, dst_storage_options: dict[str, Any] | None = None,
            max_shard_size: int | str = "5GB", weights_only: bool = True,
            source: Literal["auto", "deepspeed"] = "auto", optimizer: bool = True,
            world_size: int | None = None, stage: int | None = None) -> str:
    """Write checkpoint ``src`` (any mode) as a ``full`` Lightning file, a Hugging Face folder or (``to="dcp"``) a
    DCP folder FSDP2 loads at ``dst``.
    ``weights_only=False``: the caller trusts ``src``, whose non-tensor state may then hold any object.

    ``source="deepspeed"``: ``src`` must be a DeepSpeed ZeRO-1/2 checkpoint folder (a tag folder, a folder whose
    ``latest`` names one, or the ``<file>.ckpt`` folder of Lightning's DeepSpeedStrategy); ``"auto"`` reads one
    too, found by its files. ``optimizer=False``: the weights and Lightning's state only (a DeepSpeed
    checkpoint of an optimizer other than Adam/AdamW then converts).

    ``to="deepspeed"``: a DeepSpeed folder for ``world_size`` data-parallel ranks (None: the source's) at ZeRO
    ``stage`` (None: the source's DeepSpeed stage, else 2); it needs the optimizer state."""
    if to not in ("lightning", "hf", "dcp", "deepspeed"):
        raise ValueError(f"convert(to=...) must be 'lightning', 'hf', 'dcp' or 'deepspeed', got {to!r}.")
    if (world_size is not None or stage is not None) and to != "deepspeed":
        raise ValueError("convert(world_size=..., stage=...) apply to to='deepspeed' only.")
    if source == "deepspeed" and deepspeed_files.tag_folder(storage.resolve(src, storage_options)) is None:
        raise ValueError(f"{src!r} is not a DeepSpeed checkpoint folder (--from deepspeed): it holds neither"
                         f" {deepspeed_files.MODEL_STATES} nor a 'latest' file naming a folder that does.")
    if to == "deepspeed":
        if not optimizer:
            raise ValueError("convert --to deepspeed --no-optimizer: DeepSpeedStrategy's resume loads every rank's"
                             " optimizer partitions, so a DeepSpeed folder is written with the optimizer state only.")
        return to_deepspeed(src, dst, world_size=world_size, stage=stage, storage_options=storage_options,
                            dst_storage_options=dst_storage_options, weights_only=weights_only)
    if to == "dcp":
        return to_dcp(src, dst, storage_options=storage_options, dst_storage_options=dst_storage_options,
                      weights_only=weights_only, optimizer=optimizer)
    checkpoint = read_lightning_checkpoint(src, storage_options, optimizer=optimizer and to == "lightning",
                                           weights_only=weights_only)
    out = storage.resolve(dst, dst_storage_options if dst_storage_options is not None else storage_options)
    if to == "lightning":
        _write_file(out, to_fabric_layout(checkpoint))
        return out.url
    hf = (checkpoint.get(META_KEY) or {}).get("hf")
    if not hf:
        raise ValueError(
            f"{src!r} was not saved from a module holding a transformers PreTrainedModel, so it has no Hugging Face"
            " config to export; convert it to a Lightning file instead (--to lightning)."
        )
    prefix = hf["prefix"]
    state_dict = {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    model = _pretrained_from(hf["class"], hf["config"])
    # In the dtype it was trained in (a `bf16-true` run: bf16), as save_pretrained of the live module
    # writes it; built in fp32, the folder would hold upcast weights and load as another model.
    dtypes = {v.dtype for v in state_dict.values() if v.is_floating_point()}
    if len(dtypes) == 1:
        model.to(dtypes.pop())
    model.load_state_dict(state_dict, strict=True)
    _save_pretrained(model, out, max_shard_size)
    return out.url


def save_pretrained(module: nn.Module, folder: str, *, max_shard_size: int | str = "5GB",
                    storage_options: dict[str, Any] | None = None) -> str:
    """Export the ``transformers`` model inside a live (trained) module as a ``save_pretrained`` folder.

    Call it on rank 0 after training (the parameters are whole on every rank; under ZeroLowLevelStrategy
    ``trainer.fit`` has finished every parameter gather by the time it returns)."""
    from lightning_zero.checkpoint.engine_tree import find_pretrained

    found = find_pretrained(module)
    if found is None:
        raise ValueError(f"{type(module).__name__} holds no transformers PreTrainedModel to export.")
    _save_pretrained(found[1], storage.resolve(folder, storage_options), max_shard_size)
    return folder


def _pretrained_from(class_name: str, config_json: str) -> nn.Module:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("Exporting a Hugging Face folder needs `transformers`: pip install transformers") from exc
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write(config_json)
        config = transformers.AutoConfig.from_pretrained(tmp)
    model_class = getattr(transformers, class_name, None)
    if model_class is None:
        raise ValueError(f"transformers has no class {class_name!r}: install the version the model was trained with.")
    return model_class(config)


def _save_pretrained(model: Any, out: storage.Location, max_shard_size: int | str) -> None:
    with storage.local_directory(out) as directory:
        model.save_pretrained(directory, max_shard_size=max_shard_size)


def _write_file(out: storage.Location, checkpoint: dict[str, Any]) -> None:
    """One ``torch.save`` file, appearing whole or not at all (fsynced, on a local disk)."""
    file_io.torch_save_to(out, out.path, checkpoint, whole=True)

