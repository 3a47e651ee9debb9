"""Any checkpoint this package reads, whole and keyed by parameter name: what the writers of another system's
layout start from (:mod:`~lightning_zero.checkpoint.interop.dcp_out`, :mod:`~lightning_zero.checkpoint.interop.deepspeed_out`).

One CPU process, no process group; the source is read once (``full`` files and DeepSpeed folders through
:func:`~lightning_zero.checkpoint.reader.read_opened`, ``local`` and ``sharded`` checkpoints as their whole tree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_zero.checkpoint.opening import open_checkpoint
from lightning_zero.checkpoint.reader import (
    MASTERS_KEY,
    META_KEY,
    OPTIMIZER_NAMES,
    read_opened,
    read_zero_tree,
    to_lightning,
)
from lightning_zero.checkpoint.store import storage


@dataclass
class NamedCheckpoint:
    """A checkpoint's content keyed by the module's ``state_dict`` names."""

    model: dict[str, Tensor]
    """The module's ``state_dict`` names (tied names too) -> the saved tensors; parameters as their fp32 masters
    where they trained in a lower precision (``bf16-true``), whose dtype :attr:`param_dtypes` gives."""
    optimizer: dict[str, Any] | None
    """Every optimizer's state merged into one, as ``get_optimizer_state_dict(model, [opt, ...])`` merges them:
    ``state[<fqn>]`` a parameter's step and moments, ``param_groups[i]["params"]`` the group's names in order
    (None: not read, or none saved)."""
    rest: dict[str, Any]
    """Lightning's other state (loops, callbacks, ``lr_schedulers``, hyper-parameters, the precision plugin's
    state) and the package's meta (:data:`~lightning_zero.checkpoint.reader.META_KEY`)."""
    world_size: int | None
    """The data-parallel world size that saved it, where the checkpoint records one."""

    @property
    def meta(self) -> dict[str, Any]:
        meta = self.rest.get(META_KEY)
        return meta if isinstance(meta, dict) else {}

    def param_dtypes(self) -> dict[str, str]:
        """Parameter name -> the dtype it trained in (``"bfloat16"``), for every parameter the checkpoint names
        as one (the package's meta; a plain Lightning file records none)."""
        return dict(self.meta.get("param_dtypes") or {})


def refuse_existing(out: storage.Location, dst: str, why: str) -> None:
    """``dst`` must not exist, or be an empty directory: ``why`` says what a folder holding files would break."""
    if out.store.exists(out.path) and (not out.store.isdir(out.path) or out.store.ls(out.path)):
        raise FileExistsError(f"{dst!r} exists: {why} Remove it or pick another.")


def read_named(src: str, storage_options: dict[str, Any] | None = None, *, optimizer: bool = True,
               weights_only: bool = True) -> NamedCheckpoint:
    """Checkpoint ``src`` (``full``, ``sharded``, ``local``, a DeepSpeed ZeRO-1/2 folder) keyed by name.

    A full file whose optimizer state names no parameters is refused: guessing the order from the module would put
    one parameter's moments on another (``optimizer=False`` reads it)."""
    opened = open_checkpoint(src, storage_options)
    if opened.mode.lightning_format:
        content = read_opened(opened, optimizer=optimizer, weights_only=weights_only)
        model = _full_model(content)
        optim = _named_optimizer(content, src) if optimizer else None
        rest = {k: v for k, v in content.items() if k not in ("state_dict", "optimizer_states", MASTERS_KEY)}
        source = (rest.get(META_KEY) or {}).get("source") or {}
        world_size = source.get("world_size") if source.get("format") == "deepspeed" else None
    else:
        tree = read_zero_tree(src, storage_options, optimizer=optimizer)
        model = _tree_model(tree)
        optim = _merged(tree["optimizer"]) if optimizer and tree.get("optimizer") else None
        rest = to_lightning({k: v for k, v in tree.items() if k != "optimizer"} | {"model": {}},
                            optimizer=False, weights_only=weights_only)
        rest.pop("state_dict", None)
        world_size = int(opened.marker["world_size"]) if opened.marker else None
    return NamedCheckpoint(model, optim, rest, world_size)


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


def _named_optimizer(content: dict[str, Any], src: str) -> dict[str, Any] | None:
    """A Lightning file's index-keyed optimizer states keyed by parameter name.

    An index is the parameter's place in its optimizer's groups; the names come from the groups' ``param_names``
    (an optimizer built from ``named_parameters()`` records them) or the meta's
    :data:`~lightning_zero.checkpoint.reader.OPTIMIZER_NAMES` (a DeepSpeed folder, and the file converted from
    one, in :func:`~lightning_zero.checkpoint.formats.deepspeed_in.optimizer_order`). A file that names neither is refused."""
    states = content.get("optimizer_states") or []
    if not states:
        return None
    recorded = (content.get(META_KEY) or {}).get(OPTIMIZER_NAMES) or []
    named = []
    for number, opt in enumerate(states):
        names = recorded[number] if number < len(recorded) else None
        index: dict[int, str] = {}
        for group_number, group in enumerate(opt["param_groups"]):
            group_names = group.get("param_names") or (names[group_number] if names else None)
            if group_names is None or len(group_names) != len(group["params"]):
                raise ValueError(
                    f"{src!r} holds optimizer {number}'s state by index, without the parameters' names, so it cannot"
                    " be keyed by name. Resume it under ZeroLowLevelStrategy and save a 'sharded' checkpoint (which"
                    " names them), build the optimizer from model.named_parameters(), or convert without the"
                    " optimizer state (--no-optimizer).")
            index.update(zip((int(i) for i in group["params"]), group_names))
        groups = [{k: v for k, v in group.items() if k != "param_names"} | {"params": [index[int(i)] for i in
                                                                                      group["params"]]}
                  for group in opt["param_groups"]]
        named.append({"state": {index[int(i)]: entry for i, entry in opt["state"].items()}, "param_groups": groups})
    return _merged(named)
