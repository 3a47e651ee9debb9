"""The whole of a checkpoint of any mode, read in one process with no process group.

Everything that needs full tensors rather than this rank's shards reads through here: evaluation
from a checkpoint (``validate/test/predict(ckpt_path=...)`` at any world size),
``lightning-zero convert``, and ``LightningModule.load_from_checkpoint`` on a sharded checkpoint.

``read_zero_tree`` rebuilds the saved tree with every :class:`FlatShard` replaced by the whole
tensor (``local``: the rank files' pieces put side by side in rank order; ``sharded``: DCP reads
each tensor whole, which is resharding to one process). ``to_lightning`` turns that tree into
Lightning's own checkpoint format (see :mod:`lightning_zero.checkpoint.lightning.lightning_tree` for the tree).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_zero.checkpoint.formats import deepspeed_files, deepspeed_in
from lightning_zero.checkpoint.modes import OpenedCheckpoint, full
from lightning_zero.checkpoint.opening import open_checkpoint
from lightning_zero.checkpoint.store import storage
from lightning_zero.checkpoint.store.storage import CheckpointCorruptError
from lightning_zero.checkpoint.trainer_state import read_trainer_state
from lightning_zero.engine import dtype_from_name

MASTERS_KEY = "lightning_zero_masters"
"""Top-level key of a ``full`` file holding the fp32 master weights of parameters kept in a lower
precision (``bf16-true``), so a resume restores the exact masters."""
META_KEY = "lightning_zero_meta"
"""Top-level key of a ``full`` file holding what a reader without the module needs (parameter dtypes,
tied-weight aliases, the Hugging Face config)."""


OPTIMIZER_NAMES = "optimizer_param_names"
"""Entry of a checkpoint's meta naming, per optimizer and param group, the parameters its index-keyed state counts
(a DeepSpeed folder read into Lightning's format records them, so its file converts on by name)."""
FABRIC_KEYS = "fabric"
"""Entry of a checkpoint's ``meta`` that ``fabric.save`` writes: ``{"module": <the state's key of the module>,
"optimizers": [<the state's key of each saved optimizer, in the engine's order>]}``, so the checkpoint reads
back in the layout Fabric programs use (:func:`to_fabric_layout`)."""


def _fabric_keys(content: dict[str, Any]) -> dict[str, Any] | None:
    meta = content.get(META_KEY)
    keys = meta.get(FABRIC_KEYS) if isinstance(meta, dict) else None
    return keys if isinstance(keys, dict) else None


def from_fabric_layout(content: Any, caller_keys: dict[str, Any] | None = None) -> Any:
    """A file in Fabric's layout (what ``fabric.save`` writes in ``full`` mode: the state's keys at the top, the
    module's ``state_dict`` and each optimizer's per-parameter state under their own keys) in Lightning's
    (``state_dict``, ``optimizer_states``), the other keys as they are. Any other content is returned as it is.

    ``caller_keys`` (``fabric.load(path, state)``: the state's keys, in the form of :data:`FABRIC_KEYS`) read a
    file another strategy's ``fabric.save`` wrote (Fabric's DDP), which records no keys, the same way."""
    keys = _fabric_keys(content) if isinstance(content, dict) else None
    if keys is None and caller_keys is not None and _foreign_fabric_file(content, caller_keys["module"]):
        keys = caller_keys
    if keys is None or keys["module"] not in content:
        return content
    out = dict(content)
    out["state_dict"] = out.pop(keys["module"])
    optimizers = [key for key in keys["optimizers"] if key in out]
    if optimizers:
        out["optimizer_states"] = [out.pop(key) for key in optimizers]
    return out


def _foreign_fabric_file(content: Any, module_key: str) -> bool:
    """A plain ``torch.save`` of ``{module_key: state_dict, ...}``: none of this package's keys, not Lightning's."""
    ours = ("state_dict", META_KEY, "meta", "trainer")
    return isinstance(content, dict) and not any(key in content for key in ours) \
        and isinstance(content.get(module_key), dict) and all(isinstance(v, Tensor) for v in content[module_key].values())


def to_fabric_layout(content: dict[str, Any]) -> dict[str, Any]:
    """:func:`from_fabric_layout` undone: a checkpoint ``fabric.save`` wrote (any mode, read whole) as the dict
    it was given, ``content[<module key>]`` the module's ``state_dict``. Others are returned as they are."""
    keys = _fabric_keys(content)
    if keys is None or "state_dict" not in content:
        return content
    out = dict(content)
    out[keys["module"]] = out.pop("state_dict")
    for key, state in zip(keys["optimizers"], out.pop("optimizer_states", None) or []):
        out[key] = state
    return out


def read_zero_tree(checkpoint_id: str, storage_options: dict[str, Any] | None = None, *,
                   optimizer: bool = True) -> dict[str, Any]:
    """The tree a ``local`` or ``sharded`` checkpoint was saved from, with whole tensors.

    ``optimizer=False`` reads only the model (evaluation needs no optimizer state)."""
    opened = open_checkpoint(checkpoint_id, storage_options)
    return opened.mode.read_whole(opened, optimizer)


def to_lightning(tree: dict[str, Any], *, optimizer: bool = True, weights_only: bool = True) -> dict[str, Any]:
    """Lightning's checkpoint format from a whole ZeRO tree: ``state_dict`` in the parameters'
    dtypes, optimizer state in PyTorch's per-parameter form, the fp32 masters where the parameters
    are kept in a lower precision, and Lightning's loops, callbacks and hyper-parameters."""
    meta = tree.get("meta") or {}
    dtypes: dict[str, str] = meta.get("param_dtypes", {})
    model: dict[str, Tensor] = tree["model"]
    content = read_trainer_state(tree["trainer"], "checkpoint", weights_only) if "trainer" in tree else {}
    state_dict: dict[str, Tensor] = {}
    masters: dict[str, Tensor] = {}
    for fqn, value in model.items():
        dtype = dtype_from_name(dtypes[fqn]) if dtypes.get(fqn) else None
        if dtype is not None and dtype != value.dtype:
            masters[fqn] = value
            value = value.to(dtype)
        state_dict[fqn] = value
    aliases: dict[str, str] = meta.get("aliases", {})
    keys: list[str] = meta.get("state_dict_keys") or list(state_dict)
    content["state_dict"] = {k: state_dict[aliases.get(k, k)] for k in keys if aliases.get(k, k) in state_dict}
    # Tensors an on_save_checkpoint hook added under keys the module does not have ([Note: what a
    # checkpoint holds] in lightning_tree.py) follow the module's keys.
    named = set(keys) | set(aliases.values())
    content["state_dict"].update({k: v for k, v in state_dict.items() if k not in named})
    if masters:
        content[MASTERS_KEY] = masters
    if meta:
        content[META_KEY] = meta
    if optimizer and "optimizer" in tree:
        content["optimizer_states"] = [_per_parameter(opt) for opt in tree["optimizer"]]
    return content


def _per_parameter(opt: dict[str, Any]) -> dict[str, Any]:
    """``{"state": {fqn: ...}, "param_groups": [{"params": [fqn]}]}`` -> ``torch.optim`` indices."""
    index: dict[str, int] = {}
    groups = []
    for group in opt["param_groups"]:
        ids = []
        for fqn in group["params"]:
            index.setdefault(fqn, len(index))
            ids.append(index[fqn])
        groups.append({**group, "params": ids})
    state = {index[fqn]: dict(entry) for fqn, entry in opt["state"].items()}
    return {"state": state, "param_groups": groups}


def read_lightning_checkpoint(checkpoint_id: str, storage_options: dict[str, Any] | None = None, *,
                              optimizer: bool = True, weights_only: bool = True) -> dict[str, Any]:
    """Any checkpoint of this package (or an ordinary Lightning file) in Lightning's format, whole.
    ``weights_only=False``: the caller trusts the file, whose non-tensor state may hold any object."""
    return read_opened(open_checkpoint(checkpoint_id, storage_options), optimizer=optimizer, weights_only=weights_only)


def read_opened(opened: OpenedCheckpoint, *, optimizer: bool = True, weights_only: bool = True) -> dict[str, Any]:
    """:func:`read_lightning_checkpoint` of a checkpoint opened for this read (its marker is not read again)."""
    if opened.mode.lightning_format:
        content = read_full_content(opened, weights_only, optimizer)
        # One file holding an engine tree whole (``save(zero_state_dict(...), mode="full")``, Fabric's
        # ``full`` saves before they took Fabric's layout) reads as the other modes do; Lightning's own
        # format is returned as it is, Fabric's in Lightning's.
        return to_lightning(content, optimizer=optimizer, weights_only=weights_only) if is_engine_tree(content) \
            else content
    return to_lightning(opened.mode.read_whole(opened, optimizer), optimizer=optimizer, weights_only=weights_only)


def read_full_content(opened: OpenedCheckpoint, weights_only: bool = True, optimizer: bool = True,
                      fabric_keys: dict[str, Any] | None = None) -> Any:
    """A ``full`` checkpoint's content, Fabric's layout read as Lightning's (``fabric_keys``: as in
    :func:`from_fabric_layout`); a DeepSpeed folder as the same Lightning dict (its files are always read
    restricted: ``weights_only`` does not apply to them)."""
    if opened.deepspeed:
        return deepspeed_as_lightning(deepspeed_in.read_deepspeed(opened.loc, optimizer=optimizer))
    return from_fabric_layout(full.read_full_checked(opened.loc, weights_only), fabric_keys)


def deepspeed_as_lightning(checkpoint: deepspeed_in.DeepSpeedCheckpoint) -> dict[str, Any]:
    """A DeepSpeed checkpoint in Lightning's format (what ``convert --from deepspeed`` writes): the client state's
    loops, callbacks and schedulers at the top, ``state_dict`` in the module's names and training dtype,
    ``optimizer_states[0]`` per parameter in the param groups' order, the fp32 masters of low-precision weights."""
    import lightning

    content: dict[str, Any] = {**checkpoint.client_state, "state_dict": checkpoint.state_dict}
    # A DeepSpeed user's folder has no Lightning version; Lightning migrates a checkpoint by it, and this one
    # is built in the installed version's format.
    content.setdefault("pytorch-lightning_version", lightning.__version__)
    if checkpoint.optimizer_state is not None:
        content["optimizer_states"] = [checkpoint.optimizer_state]
    if checkpoint.masters:
        content[MASTERS_KEY] = checkpoint.masters
    if checkpoint.scaler_state is not None:
        content["MixedPrecision"] = checkpoint.scaler_state  # Lightning restores its precision plugin by class name
    content[META_KEY] = {"param_dtypes": checkpoint.param_dtypes, "state_dict_keys": list(checkpoint.state_dict),
                         "aliases": checkpoint.aliases, "source": checkpoint.source,
                         OPTIMIZER_NAMES: [checkpoint.group_names]}
    return content


def is_engine_tree(content: Any) -> bool:
    """Whether a whole checkpoint is the tree of ``zero_state_dict`` (``model/...``), not Lightning's format, nor
    a file another strategy's ``fabric.save`` wrote (``{"model": state_dict, "optimizer": {...}, ...}``: no
    ``meta`` or ``trainer`` entry, an optimizer that is one state dict, not the tree's list)."""
    return isinstance(content, dict) and isinstance(content.get("model"), dict) and "state_dict" not in content \
        and ("meta" in content or "trainer" in content or isinstance(content.get("optimizer"), list))


def is_zero_checkpoint(checkpoint_id: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether the path is a commit marker of this package (a ``local``/``sharded`` checkpoint) or a DeepSpeed
    ZeRO-1/2 folder: a checkpoint :func:`read_lightning_checkpoint` assembles and ``torch.load`` cannot read."""
    try:
        loc = storage.resolve(checkpoint_id, storage_options)
        try:
            return storage.read_marker(loc) is not None
        except storage.CheckpointNotFoundError:
            return deepspeed_files.tag_folder(loc) is not None
    except (storage.CheckpointNotFoundError, CheckpointCorruptError, OSError, ValueError):
        return False
