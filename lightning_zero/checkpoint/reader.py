"""The whole of a checkpoint of any mode, read in one process with no process group.

Everything that needs full tensors rather than this rank's shards reads through here: evaluation
from a checkpoint (``validate/test/predict(ckpt_path=...)`` at any world size),
``lightning-zero convert``, and ``LightningModule.load_from_checkpoint`` on a sharded checkpoint.

``read_zero_tree`` rebuilds the saved tree with every :class:`FlatShard` replaced by the whole
tensor (``local``: the rank files' pieces put side by side in rank order; ``sharded``: DCP reads
each tensor whole, which is resharding to one process). ``to_lightning`` turns that tree into
Lightning's own checkpoint format (see :mod:`lightning_zero.checkpoint.trainer` for the tree).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from lightning_zero.checkpoint import saver, storage
from lightning_zero.checkpoint.storage import CheckpointCorruptError, Location
from lightning_zero.checkpoint.tree import FlatShard, map_with_path, walk

MASTERS_KEY = "lightning_zero_masters"
"""Top-level key of a ``full`` file holding the fp32 master weights of parameters kept in a lower
precision (``bf16-true``), so a resume restores the exact masters (DESIGN.md, Lifecycle)."""
META_KEY = "lightning_zero_meta"
"""Top-level key of a ``full`` file holding what a reader without the module needs (parameter dtypes,
tied-weight aliases, the Hugging Face config)."""


def read_zero_tree(checkpoint_id: str, storage_options: dict[str, Any] | None = None, *,
                   optimizer: bool = True) -> dict[str, Any]:
    """The tree a ``local`` or ``sharded`` checkpoint was saved from, with whole tensors.

    ``optimizer=False`` reads only the model (evaluation needs no optimizer state)."""
    loc = storage.resolve(checkpoint_id, storage_options)
    marker = storage.read_marker(loc)
    if marker is None:
        raise ValueError(f"{loc.url!r} is a 'full' checkpoint file; read it with torch.load.")
    mode = saver.validate_marker_mode(loc, marker)
    if mode == "local":
        return _read_local(loc, marker, optimizer)
    return _read_sharded(loc, marker, optimizer)


def _read_local(loc: Location, marker: dict[str, Any], optimizer: bool) -> dict[str, Any]:
    # Hybrid: the first shard group's files hold every shard once ([Note: hybrid layout]).
    world_size = int(marker.get("shard_group_size", marker["world_size"]))
    files = [saver.read_rank_file(loc, marker, rank) for rank in range(world_size)]
    pieces: dict[str, list[FlatShard]] = {}
    for content in files:
        for path, leaf in walk(content):
            if isinstance(leaf, FlatShard):
                pieces.setdefault("/".join(path), []).append(leaf)

    def whole(path: str, leaf: Any) -> Any:
        if not isinstance(leaf, FlatShard):
            return leaf  # rank 0's: buffers, replicated tensors, objects
        shards = sorted(pieces[path], key=lambda s: s.rank)
        if [s.rank for s in shards] != list(range(world_size)):
            raise CheckpointCorruptError(f"Checkpoint {loc.url!r}: the rank files do not all hold {path!r}.")
        return torch.cat([s.local for s in shards]).reshape(leaf.shape)

    tree = map_with_path(files[0], whole)
    if not optimizer:
        tree.pop("optimizer", None)
    return tree


def _read_sharded(loc: Location, marker: dict[str, Any], optimizer: bool) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    _, objects, _, reader, dcp_metadata = saver.open_sharded(loc, marker)
    metadata = dcp_metadata.state_dict_metadata
    targets: dict[str, Tensor] = {}
    for key, md in metadata.items():
        if not isinstance(md, TensorStorageMetadata) or (not optimizer and key.startswith("optimizer/")):
            continue
        targets[key] = torch.empty(md.size, dtype=md.properties.dtype)
    try:
        # The reader that read .metadata (it keeps what it read): DCP's load sets it up for this plan.
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(targets, storage_reader=reader, no_dist=True)
    except CheckpointException as exc:
        cause = saver._dcp_failure(exc)
        if isinstance(cause, CheckpointCorruptError):
            raise cause from exc
        raise CheckpointCorruptError(
            f"Could not read the data of checkpoint {loc.url!r} ({type(cause).__name__}: {cause}); its files are"
            " damaged or missing. Resume from another checkpoint."
        ) from exc

    def whole(path: str, leaf: Any) -> Any:
        if path not in targets:
            return leaf
        if isinstance(leaf, dict) and "flat_shard_shape" in leaf:
            return targets[path].reshape(leaf["flat_shard_shape"])
        return targets[path]

    tree = map_with_path(objects, whole, is_leaf=lambda leaf: isinstance(leaf, dict) and "flat_shard_shape" in leaf)
    if not optimizer:
        tree.pop("optimizer", None)
    return tree


def to_lightning(tree: dict[str, Any], *, optimizer: bool = True) -> dict[str, Any]:
    """Lightning's checkpoint format from a whole ZeRO tree: ``state_dict`` in the parameters'
    dtypes, optimizer state in PyTorch's per-parameter form, the fp32 masters where the parameters
    are kept in a lower precision, and Lightning's loops, callbacks and hyper-parameters."""
    from lightning_zero.checkpoint.trainer import read_trainer_state

    meta = tree.get("meta") or {}
    dtypes: dict[str, str] = meta.get("param_dtypes", {})
    model: dict[str, Tensor] = tree["model"]
    content = read_trainer_state(tree["trainer"], "checkpoint") if "trainer" in tree else {}
    state_dict: dict[str, Tensor] = {}
    masters: dict[str, Tensor] = {}
    for fqn, value in model.items():
        dtype = _dtype(dtypes.get(fqn))
        if dtype is not None and dtype != value.dtype:
            masters[fqn] = value
            value = value.to(dtype)
        state_dict[fqn] = value
    aliases: dict[str, str] = meta.get("aliases", {})
    keys: list[str] = meta.get("state_dict_keys") or list(state_dict)
    content["state_dict"] = {k: state_dict[aliases.get(k, k)] for k in keys if aliases.get(k, k) in state_dict}
    # Tensors an on_save_checkpoint hook added under keys the module does not have ([Note: what a
    # checkpoint holds] in trainer.py) follow the module's keys.
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


def _dtype(name: str | None) -> torch.dtype | None:
    if not name:
        return None
    value = getattr(torch, name.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else None


def read_lightning_checkpoint(checkpoint_id: str, storage_options: dict[str, Any] | None = None, *,
                              optimizer: bool = True) -> dict[str, Any]:
    """Any checkpoint of this package (or an ordinary Lightning file) in Lightning's format, whole."""
    loc = storage.resolve(checkpoint_id, storage_options)
    if storage.read_marker(loc) is None:
        return saver.read_full(checkpoint_id, storage_options)
    return to_lightning(read_zero_tree(checkpoint_id, storage_options, optimizer=optimizer), optimizer=optimizer)


def is_zero_checkpoint(checkpoint_id: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether the path is a commit marker of this package (a ``local``/``sharded`` checkpoint)."""
    try:
        return storage.read_marker(storage.resolve(checkpoint_id, storage_options)) is not None
    except (storage.CheckpointNotFoundError, CheckpointCorruptError, OSError, ValueError):
        return False
