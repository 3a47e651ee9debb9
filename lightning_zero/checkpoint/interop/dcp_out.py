"""Out to FSDP2: any checkpoint this package reads, as a torch DCP checkpoint in the layout of
``torch.distributed.checkpoint.state_dict`` (``lightning-zero convert --to dcp``).

One CPU process, no process group. The DCP folder holds ``{"model": ..., "optimizer": ...}`` as FSDP2 programs
save it (Lightning Fabric's ``ModelParallelStrategy`` with ``state={"model": model, "optimizer": optimizer}``,
torchtitan's ``model`` / ``optimizer`` states): ``model`` is what ``get_model_state_dict(model)`` returns (keys
are the module's ``state_dict`` names: parameters and persistent buffers), ``optimizer`` what
``get_optimizer_state_dict(model, optimizer)`` returns (``state[<fqn>]`` the parameter's ``step`` and moments,
``param_groups[i]["params"]`` the group's parameter names). DCP flattens them into the keys
``model.<fqn>``, ``optimizer.state.<fqn>.exp_avg``, ``optimizer.param_groups.<i>.lr`` ..., so an FSDP2 program at
any world size loads it with::

    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=DST)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

A model's parameters are its fp32 masters where it trained in a lower precision (``bf16-true``): FSDP2 keeps its
sharded parameters in fp32 and computes in bf16 under ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``, and
its optimizer steps them, so the masters are what its parameters are. Several optimizers are merged into one
``optimizer`` entry, as ``get_optimizer_state_dict(model, [opt1, opt2])`` merges them.

What DCP's layout has no place for (Lightning's loops, callbacks, ``lr_schedulers``, hyper-parameters, the
precision plugin's state) is kept beside it in :data:`LIGHTNING_STATE` (``torch.load(..., weights_only=True)``
reads it when the source was read weights-only, the default).

Memory: the source is read whole once (its tensors are what DCP writes; none is copied for the write, except
a weight cast from the masters' dtype), never twice.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from lightning_zero.checkpoint.interop.named_state import read_named, refuse_existing
from lightning_zero.checkpoint.store import storage

LIGHTNING_STATE = "lightning_state.pt"
"""The file beside the DCP checkpoint with Lightning's state: ``epoch``, ``global_step``, ``loops``,
``callbacks``, ``lr_schedulers``, ``hyper_parameters``, the package's meta (parameter dtypes, tied-weight
aliases) and whatever else the checkpoint held outside its weights and optimizer state."""


def to_dcp(src: str, dst: str, *, storage_options: dict[str, Any] | None = None,
           dst_storage_options: dict[str, Any] | None = None, weights_only: bool = True,
           optimizer: bool = True) -> str:
    """Write checkpoint ``src`` (``full``, ``sharded``, ``local``, a DeepSpeed ZeRO-1/2 folder) as a DCP folder at
    ``dst`` in the FSDP2 layout (module docstring) with :data:`LIGHTNING_STATE` beside it; returns ``dst``.

    ``dst`` must not exist or be an empty directory: DCP writes its data files in place, so a folder holding an
    older checkpoint would mix the two. ``optimizer=False``: the model and Lightning's state only."""
    out = storage.resolve(dst, dst_storage_options if dst_storage_options is not None else storage_options)
    refuse_existing(out, dst, "convert --to dcp writes a new folder (DCP writes its files in place, and a folder"
                    " holding another checkpoint would mix the two).")
    named = read_named(src, storage_options, optimizer=optimizer, weights_only=weights_only)
    state: dict[str, Any] = {"model": named.model}
    if named.optimizer is not None:
        state["optimizer"] = named.optimizer
    _write(out, state, named.rest)
    return out.url


def _write(out: storage.Location, state: dict[str, Any], rest: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    with storage.local_directory(out) as directory:
        os.makedirs(directory, exist_ok=True)
        with warnings.catch_warnings():  # "... no_dist=True ...": one process is the intent
            warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.checkpoint")
            dcp.save(state, storage_writer=dcp.FileSystemWriter(directory, single_file_per_rank=True), no_dist=True)
        torch.save(rest, os.path.join(directory, LIGHTNING_STATE))
