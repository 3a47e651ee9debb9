"""Lightning's checkpoint dict -> the ZeRO tree a save writes (the resume that reads it back is
:mod:`~lightning_zero.checkpoint.lightning.resume`).

The tree of ``local`` and ``sharded`` checkpoints (built by :func:`build_tree`)::

    model/<fqn>                      fp32 master shard (FlatShard) of each parameter the engine holds;
                                     other parameters and the buffers as whole tensors (rank 0's)
    optimizer/<i>/state/<fqn>/<key>  optimizer state shards (FlatShard) and scalars
    optimizer/<i>/param_groups       hyper-parameters, params named by fqn
    trainer                          Lightning's loops, callbacks, hyper-parameters (one blob)
    meta                             parameter dtypes, state_dict key order and tied-weight aliases,
                                     the Hugging Face config when the module holds a transformers model

``full`` checkpoints are Lightning's own format (``state_dict``, ``optimizer_states`` in PyTorch's
per-parameter form), plus the fp32 masters of parameters kept in a lower precision.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zero._compat import persistent_buffers
from lightning_zero.checkpoint import engine_tree
from lightning_zero.checkpoint.formats.tree import snapshot
from lightning_zero.checkpoint.modes import full, mode_named
from lightning_zero.checkpoint.reader import (
    MASTERS_KEY,
    META_KEY,
)
from lightning_zero.checkpoint.trainer_state import (
    MARKER_FIELDS,
    PLAIN,
    TREE_TAG,
    marker_fields,
    trainer_state_blob,
)
from lightning_zero.engine import ZeroEngine

# ---- save ---------------------------------------------------------------------------------


def build_tree(checkpoint: dict[str, Any], module: nn.Module, engine: ZeroEngine | None, mode: str,
               meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The tree ``ZeroCheckpointIO(mode)`` writes for Lightning's ``checkpoint`` dict.

    Without an engine (a save after ``validate``/``test``/``predict``, or before ``fit``) the
    weights are the module's own, and no optimizer state is saved. ``meta``: the module's
    :func:`~lightning_zero.checkpoint.engine_tree.module_meta`, computed now when not given."""
    meta = meta if meta is not None else engine_tree.module_meta(module)
    trainer_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    # Lightning's lr_schedulers stay as it put them (a list, empty without a fit): a fit resumed from a
    # save made outside fit restores them as under DDP.
    with_optimizer = engine is not None and "optimizer_states" in checkpoint  # absent for save_weights_only
    if mode_named(mode).lightning_format:
        # The file is written in the background: only the parameters are held still until staged (the
        # optimizer's fence), so everything else is copied now, buffers and hook-added tensors
        # included, and the callbacks' state (SWA's and EMA's averages change in place).
        state_dict = snapshot(checkpoint["state_dict"], _fence(_parameters(module, engine)))
        tree: dict[str, Any] = {**snapshot(trainer_state), "state_dict": state_dict, META_KEY: meta}
        if engine is not None:
            # Masters only where the checkpoint holds the parameter itself (a hook may have replaced it).
            kept = {_storage_key(v) for v in state_dict.values() if isinstance(v, Tensor)}
            masters = {sp.fqn: engine_tree.flat_master(sp, engine.shard_size) for sp in engine.sharded_params.values()
                       if sp.master.dtype != sp.param.dtype and _storage_key(sp.param) in kept}
            if masters:
                tree[MASTERS_KEY] = masters
        if with_optimizer:
            assert engine is not None
            tree["optimizer_states"] = engine_tree.full_optimizer_states(engine)
    else:
        tree = (engine_tree.zero_state_dict(engine, module, meta=meta, stable=True) if engine is not None
                else _weights_tree(module))
        if "state_dict" in checkpoint:
            tree["model"] = model_after_hooks(tree["model"], checkpoint["state_dict"], module,
                                              engine.named_parameters() if engine is not None else None)
        if not with_optimizer:
            tree.pop("optimizer", None)
        tree["trainer"] = trainer_state_blob(trainer_state)
        tree["meta"] = meta
        tree[MARKER_FIELDS] = marker_fields(trainer_state)
    tree[TREE_TAG] = mode
    return tree


def holds_optimizer_state(checkpoint: dict[str, Any], engine: ZeroEngine | None) -> bool:
    """Whether a save of Lightning's ``checkpoint`` holds optimizer state: not for ``save_weights_only``
    (Lightning leaves ``optimizer_states`` out) nor without an engine (a save outside ``fit``)."""
    return engine is not None and "optimizer_states" in checkpoint


def holds_module_parameters(tree: dict[str, Any]) -> bool:
    """Whether a tree :func:`build_tree` or :func:`plain_tree` built holds the module's own parameters (Lightning's
    format, or the plain file), which the hooks that run before the next step may change in place: its staging
    copy must end before the save call returns. The engine's tree holds the masters, which only the fenced
    optimizer update changes."""
    return tree[TREE_TAG] == PLAIN or mode_named(tree[TREE_TAG]).lightning_format


def plain_tree(checkpoint: dict[str, Any], module: nn.Module, engine: ZeroEngine | None) -> dict[str, Any]:
    """The tree of a save that holds no optimizer state, in every mode: ``checkpoint`` itself.

    [Note: model-only saves] ZeRO-1 and ZeRO-2 hold the whole parameters on every rank, so a save without
    optimizer state needs no sharding: it is the file DDP writes, one ``torch.save`` of the dict the front end
    built (Lightning's ``dump_checkpoint``, or Fabric's state with each module's ``state_dict()``), written by
    rank 0 alone, with nothing of this package in it (no masters, no meta, no integrity header), so every tool
    reads it (``torch.load(path)["state_dict"]`` or ``["model"]``, a plain Trainer, litgpt). It is committed as a
    ``full`` file is (a temporary name renamed, in the background with ``async_save``). The module's parameters
    are held still by the optimizer's staging fence; everything else is copied now. The modes decide how
    optimizer state is stored; a weights-only resume starts the optimizers fresh, as under DDP."""
    tree = snapshot(checkpoint, _fence(_parameters(module, engine)))
    tree[TREE_TAG] = PLAIN
    return tree


def _parameters(module: nn.Module, engine: ZeroEngine | None) -> list[Tensor]:
    """The parameters the optimizer's staging fence protects (the engine's list: no wait for gathers)."""
    return [p for _, p in (engine.named_parameters() if engine is not None else module.named_parameters())]


def _fence(parameters: Iterable[Tensor]) -> Any:
    keys = {_storage_key(p) for p in parameters}
    return lambda tensor: _storage_key(tensor) in keys


def gather_full_checkpoint(checkpoint: dict[str, Any], module: nn.Module, engine: ZeroEngine | None,
                           meta: dict[str, Any] | None = None, group: Any = None) -> dict[str, Any] | None:
    """(collective on ``group``, default the training group) Lightning's ``checkpoint`` as one whole dict
    on rank 0, None elsewhere: what a plain ``CheckpointIO`` (``TorchCheckpointIO``) writes."""
    whole = full.gather_tree_to_rank0(build_tree(checkpoint, module, engine, "full", meta), group)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    whole.pop(TREE_TAG)
    whole.pop(MARKER_FIELDS, None)
    return whole


def model_after_hooks(model: dict[str, Any], state_dict: dict[str, Any], module: nn.Module,
                      named_parameters: list[tuple[str, nn.Parameter]] | None = None) -> dict[str, Any]:
    """The ``model`` part of a ``local``/``sharded`` tree for Lightning's ``checkpoint["state_dict"]`` as
    the ``on_save_checkpoint`` hooks left it ([Note: what a checkpoint holds]).

    [Note: what a checkpoint holds] Lightning builds ``checkpoint["state_dict"]`` from the module, then
    lets callbacks and the module edit it: a LoRA setup drops the frozen base, EMA puts its averaged
    weights in, SWA's averaged weights are the module's own by then. A key whose value is still the
    module's own tensor (the same storage) is written as it is in ``model`` (the exact fp32 master
    shard of a sharded parameter, under its parameter name, once for tied names); a key whose value
    was replaced or added is written whole, as every rank holds it; a key the hooks removed is not
    written. ``named_parameters``: the engine's list (no wait for gathers), else the module's."""
    own: dict[tuple[int, int, torch.dtype, tuple[int, ...]], str] = {}
    for fqn, tensor in [*(named_parameters if named_parameters is not None else module.named_parameters()),
                        *module.named_buffers()]:
        own.setdefault(_storage_key(tensor), fqn)
    edited: dict[str, Any] = {}
    for key, value in state_dict.items():
        if not isinstance(value, Tensor):
            continue  # extra state of a module is not a tensor: it stays out of the tree, as before
        fqn = own.get(_storage_key(value))
        if fqn is not None and fqn in model:
            edited.setdefault(fqn, model[fqn])
        else:
            edited[key] = value.detach().clone()
    # Nothing edited: the model part itself, which a save's walks may have kept ([Note: stable subtrees]).
    if len(edited) == len(model) and list(edited) == list(model) and all(
            a is b for a, b in zip(edited.values(), model.values())):
        return model
    return edited


def _storage_key(tensor: Tensor) -> tuple[int, int, torch.dtype, tuple[int, ...]]:
    """Equal for a parameter and its detached views in ``state_dict()``; different for any other tensor."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.dtype, tuple(tensor.shape))


def _weights_tree(module: nn.Module) -> dict[str, Any]:
    """Weights only, without an engine: whole tensors (DCP writes each once, from rank 0)."""
    model = {fqn: p.detach() for fqn, p in module.named_parameters()}
    model.update({fqn: b.detach().clone() for fqn, b in persistent_buffers(module)})
    return {"model": model}
