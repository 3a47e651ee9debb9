"""``fabric.save``'s ``state`` <-> the tree a save writes ([Note: Fabric's layout]); the Fabric front end's
mapping, as :mod:`~lightning_zero.checkpoint.lightning.lightning_tree` is the Trainer's. Reading it back is
:func:`~lightning_zero.checkpoint.reader.from_fabric_layout` / :func:`~lightning_zero.checkpoint.reader.to_fabric_layout`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from lightning_zero.checkpoint import engine_tree
from lightning_zero.checkpoint.lightning.lightning_tree import build_tree, plain_tree
from lightning_zero.checkpoint.modes import mode_named
from lightning_zero.checkpoint.reader import FABRIC_KEYS
from lightning_zero.checkpoint.trainer_state import TREE_TAG
from lightning_zero.engine import ZeroEngine


def fabric_tree(state: dict[str, Any], module_key: str, optimizer_keys: dict[str, int], module: nn.Module,
                engine: ZeroEngine, mode: str, meta: dict[str, Any], blob: bytes,
                keep: Callable[[str, Tensor], bool] | None = None) -> dict[str, Any]:
    """The tree ``fabric.save(path, state)`` writes in ``mode``.

    ``state``: the values other than the module and its optimizers (objects with ``state_dict()`` already
    replaced by it); ``optimizer_keys``: the state's key of each optimizer saved -> its index in the engine;
    ``blob``: ``state`` as :func:`~lightning_zero.checkpoint.trainer_state.trainer_state_blob` keeps it;
    ``keep``: ``fabric.save(filter=...)``'s test of the module's weights.

    [Note: Fabric's layout] Under Fabric's DDP, ``fabric.save`` writes one ``torch.save`` file of the state as
    given, ``ckpt[<module key>]`` the module's ``state_dict()`` and ``ckpt[<optimizer key>]`` the optimizer's
    ``state_dict()``; Fabric programs read it back with ``torch.load(path)["model"]``. A ``full`` save writes
    that file (the state's values at the top, then this package's ``lightning_zero_masters`` where the
    parameters are kept in a lower precision, ``lightning_zero_meta`` and the integrity header). ``local`` and
    ``sharded`` saves write the engine's tree (``model``, ``optimizer``, the state in ``trainer``); the meta of
    every mode names the keys (:data:`~lightning_zero.checkpoint.reader.FABRIC_KEYS`), so ``fabric.load(path)``
    and ``lightning-zero convert`` give the same layout back."""
    meta = {**meta, FABRIC_KEYS: {"module": module_key, "optimizers": sorted(optimizer_keys, key=optimizer_keys.get)}}
    if mode_named(mode).lightning_format:
        state_dict = module.state_dict()  # finishes the step's gathers: the file holds the whole weights
        if keep is not None:
            state_dict = {k: v for k, v in state_dict.items() if keep(k, v.detach())}
        checkpoint: dict[str, Any] = {**state, "state_dict": state_dict}
        if optimizer_keys:
            checkpoint["optimizer_states"] = []  # build_tree fills the engine's
        tree = build_tree(checkpoint, module, engine, mode, meta)
        tree.pop(TREE_TAG)
        states = tree.pop("optimizer_states", [])
        tree[module_key] = tree.pop("state_dict")
        tree.update({key: states[index] for key, index in optimizer_keys.items()})
        return tree
    tree = engine_tree.zero_state_dict(engine, module, meta=meta, stable=True)
    if not optimizer_keys:
        tree.pop("optimizer")
    if keep is not None:
        tensors = {**dict(engine.named_parameters()), **dict(module.named_buffers())}
        tree["model"] = {fqn: leaf for fqn, leaf in tree["model"].items() if keep(fqn, tensors[fqn].detach())}
    tree["trainer"] = blob
    return tree


def plain_fabric_tree(state: dict[str, Any], module_key: str, module: nn.Module, engine: ZeroEngine | None,
                      keep: Callable[[str, Tensor], bool] | None = None) -> dict[str, Any]:
    """The file ``fabric.save(path, state)`` writes when ``state`` holds no optimizer, in every mode: what Fabric's
    DDP writes ([Note: model-only saves] in lightning_tree.py), the state's keys in its order with the module as
    its ``state_dict()`` (``keep``: ``fabric.save(filter=...)``'s test) and the other values as given
    (``state_dict()`` of objects that have one)."""
    weights = module.state_dict()  # finishes the step's gathers: the file holds the whole weights
    if keep is not None:
        weights = {k: v for k, v in weights.items() if keep(k, v.detach())}
    tree = plain_tree({key: weights if key == module_key else value for key, value in state.items()}, module, engine)
    tree.pop(TREE_TAG)
    return tree
