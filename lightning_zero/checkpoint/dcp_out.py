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
from torch import Tensor

from lightning_zero.checkpoint import storage
from lightning_zero.checkpoint.opening import open_checkpoint
from lightning_zero.checkpoint.reader import MASTERS_KEY, META_KEY, read_opened, read_zero_tree, to_lightning

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
    if out.fs.exists(out.path) and (not out.fs.isdir(out.path) or out.fs.ls(out.path)):
        raise FileExistsError(f"{dst!r} exists: convert --to dcp writes a new folder (DCP writes its files in place,"
                              " and a folder holding another checkpoint would mix the two). Remove it or pick another.")
    opened = open_checkpoint(src, storage_options)
    if opened.mode == "full":
        content = read_opened(opened, optimizer=optimizer, weights_only=weights_only)
        model = _full_model(content)
        optim = _named_optimizer(content, src, opened.loc if opened.deepspeed else None) if optimizer else None
        rest = {k: v for k, v in content.items() if k not in ("state_dict", "optimizer_states", MASTERS_KEY)}
    else:
        tree = read_zero_tree(src, storage_options, optimizer=optimizer)
        model = _tree_model(tree)
        optim = _merged(tree["optimizer"]) if optimizer and tree.get("optimizer") else None
        rest = to_lightning({k: v for k, v in tree.items() if k != "optimizer"} | {"model": {}},
                            optimizer=False, weights_only=weights_only)
        rest.pop("state_dict", None)
    state: dict[str, Any] = {"model": model}
    if optim is not None:
        state["optimizer"] = optim
    _write(out, state, rest)
    return out.url


def _tree_model(tree: dict[str, Any]) -> dict[str, Tensor]:
    """The module's ``state_dict`` names -> the saved tensors (parameters: their fp32 masters), tied names too."""
    meta = tree.get("meta") or {}
    saved: dict[str, Tensor] = tree["model"]
    aliases: dict[str, str] = meta.get("aliases", {})
    keys: list[str] = meta.get("state_dict_keys") or list(saved)
    model = {k: saved[aliases.get(k, k)] for k in keys if aliases.get(k, k) in saved}
    model.update({k: v for k, v in saved.items() if k not in model})  # tensors a save hook added
    return model


def _full_model(content: dict[str, Any]) -> dict[str, Tensor]:
    masters: dict[str, Tensor] = content.get(MASTERS_KEY) or {}
    aliases: dict[str, str] = (content.get(META_KEY) or {}).get("aliases", {})
    return {k: masters.get(aliases.get(k, k), v) for k, v in content["state_dict"].items()}


def _merged(optimizers: list[dict[str, Any]]) -> dict[str, Any]:
    """Name-keyed optimizer states as one, as ``get_optimizer_state_dict(model, [opt, ...])`` merges them."""
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for opt in optimizers:
        state.update(opt["state"])
        groups += [dict(group, params=list(group["params"])) for group in opt["param_groups"]]
    return {"state": state, "param_groups": groups}


def _named_optimizer(content: dict[str, Any], src: str,
                     deepspeed: storage.Location | None) -> dict[str, Any] | None:
    """A Lightning file's index-keyed optimizer states keyed by parameter name.

    An index is the parameter's place in its optimizer's groups; the names come from the groups' ``param_names``
    (an optimizer built from ``named_parameters()`` records them) or, for a DeepSpeed folder, from its
    ``param_shapes`` (the groups' order, which the reader also follows). A file that names neither is refused:
    guessing the order from the module would put one parameter's moments on another."""
    states = content.get("optimizer_states") or []
    if not states:
        return None
    names = _deepspeed_names(deepspeed) if deepspeed is not None else None
    named = []
    for number, opt in enumerate(states):
        index: dict[int, str] = {}
        for group_number, group in enumerate(opt["param_groups"]):
            group_names = group.get("param_names") or (names[group_number] if names else None)
            if group_names is None or len(group_names) != len(group["params"]):
                raise ValueError(
                    f"{src!r} holds optimizer {number}'s state by index, without the parameters' names, so it cannot"
                    " be keyed by name as FSDP2 keys it. Resume it under ZeroLowLevelStrategy and save a 'sharded'"
                    " checkpoint (which names them), build the optimizer from model.named_parameters(), or convert"
                    " without the optimizer state (--no-optimizer).")
            index.update(zip((int(i) for i in group["params"]), group_names))
        groups = [{k: v for k, v in group.items() if k != "param_names"} | {"params": [index[int(i)] for i in
                                                                                      group["params"]]}
                  for group in opt["param_groups"]]
        named.append({"state": {index[int(i)]: entry for i, entry in opt["state"].items()}, "param_groups": groups})
    return _merged(named)


def _deepspeed_names(loc: storage.Location) -> list[list[str]]:
    """A DeepSpeed folder's param groups as parameter names, in the order its optimizer's indices count them: its
    ``param_shapes`` (the model states file is memory-mapped, so its weights are not read again), unshuffled as
    :func:`~lightning_zero.checkpoint.deepspeed_in.read_deepspeed` unshuffles them under ``round_robin_gradients``."""
    from lightning_zero.checkpoint import deepspeed_files
    from lightning_zero.checkpoint.deepspeed_in import _name_prefix, _unshuffle

    folder = deepspeed_files.open_folder(loc)
    states = deepspeed_files.load_file(folder, folder.model_states)
    prefix = _name_prefix(states["module"])
    groups = [[name.removeprefix(prefix) for name in group] for group in states["param_shapes"]]
    config = states.get("ds_config") if isinstance(states.get("ds_config"), dict) else {}
    if config.get("zero_optimization", {}).get("round_robin_gradients"):
        groups = [_unshuffle(order, int(states["dp_world_size"])) for order in groups]
    return groups


def _write(out: storage.Location, state: dict[str, Any], rest: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    with storage.local_directory(out) as directory:
        os.makedirs(directory, exist_ok=True)
        with warnings.catch_warnings():  # "... no_dist=True ...": one process is the intent
            warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.checkpoint")
            dcp.save(state, storage_writer=dcp.FileSystemWriter(directory, single_file_per_rank=True), no_dist=True)
        torch.save(rest, os.path.join(directory, LIGHTNING_STATE))
