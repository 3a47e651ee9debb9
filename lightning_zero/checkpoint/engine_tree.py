"""What a checkpoint holds: the engine's sharded state as a tree, and how it is put back.

``zero_state_dict`` (local and sharded modes) keeps every sharded tensor as a :class:`FlatShard`
keyed by parameter name: ``model/<fqn>`` the fp32 master shard (buffers and parameters no
optimizer holds are plain tensors), ``optimizer/<i>/state/<fqn>/<key>`` the optimizer state
shards, ``optimizer/<i>/param_groups`` the hyper-parameters. ``full_state_dict`` builds
Lightning's own checkpoint format instead, with optimizer state in PyTorch's per-parameter
form (indices in param-group order), so plain DDP can resume from it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_zero._compat import persistent_buffers
from lightning_zero.checkpoint.formats.tree import FlatShard, StableDict
from lightning_zero.engine import ZeroEngine
from lightning_zero.engine.grad_bucket import ShardedParam
from lightning_zero.engine.optimizer import ZeroOptimizer
from lightning_zero.engine.whole_step import is_split_state


def _shard_fields(sp: ShardedParam, world_size: int) -> tuple[tuple[int, ...], int, int, int, int]:
    """A :class:`FlatShard`'s fields after ``local`` for ``sp``'s tensors. ``world_size``: the shard group's size;
    the replicas come from the parameter's bucket."""
    return tuple(sp.param.shape), sp.rank, world_size, sp.bucket.replicas, sp.bucket.replica_rank


def _flat(sp: ShardedParam, local: Tensor, world_size: int) -> FlatShard:
    return FlatShard(local, *_shard_fields(sp, world_size))


def _is_sharded_state(key: str, value: Any, sp: ShardedParam) -> bool:
    """Optimizer state shaped like the master shard is sharded; scalars (Adam's step) are not. A
    shape-aware optimizer's state says by its key ([Note: whole-matrix step] in engine/whole_step.py): its
    whole values (Adafactor's row factor) may be 1-D too."""
    if sp.shape_aware:
        return key in sp.split_state_keys
    # dim and numel, not a comparison of torch.Size objects: a save asks this of every state tensor
    return isinstance(value, Tensor) and value.dim() == 1 and value.numel() == sp.master.numel()


def _is_full_state(key: str, value: Any, sp: ShardedParam) -> bool:
    """In PyTorch's format, state shaped like the parameter is per-element. A 0-dim parameter's
    state is shaped like Adam's scalar ``step``, so the key decides there."""
    return is_split_state(key, value, sp.param.shape)


def _param_groups(opt: ZeroOptimizer) -> list[dict[str, Any]]:
    fqn = {id(tensor): sp.fqn for sp in opt.sharded_params for tensor in (sp.param, sp.master)}  # no tensor hashing
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [fqn[id(p)] for p in g["params"]]}
            for g in opt.param_groups]


def flat_master(sp: ShardedParam, world_size: int) -> FlatShard:
    return _flat(sp, sp.master, world_size)


def zero_state_dict(engine: ZeroEngine, module: nn.Module, for_load: bool = False,
                    meta: dict[str, Any] | None = None, stable: bool = False) -> dict[str, Any]:
    """This rank's part of the training state as a tree for :func:`~lightning_zero.checkpoint.async_save`
    (``model/<fqn>`` master shards and whole tensors, ``optimizer/<i>/state/<fqn>/<key>`` and
    ``optimizer/<i>/param_groups``, ``meta``: the layout of ``local`` and ``sharded`` checkpoints).
    ``for_load``: the tree a load fills (buffers not copied, no ``meta``). ``meta``: the module's metadata
    (parameter dtypes, key order, tied weights), if already known (the strategy computes it once at setup).
    ``stable`` (a save that only reads the tree): each optimizer's ``state`` is the previous save's object while its
    tensors are the same ([Note: stable subtrees] in formats/tree.py)."""
    ws = engine.shard_size
    buffers = list(persistent_buffers(module))  # as state_dict(): no buffer registered persistent=False
    model = _stable_params(engine, ws) if stable and not for_load and not buffers else _params(engine, ws)
    for fqn, b in buffers:
        # Forward mutates buffers: a save copies them now, not at staging; a load fills them.
        model[fqn] = b.detach() if for_load else b.detach().clone()
    optimizers = []
    for opt in engine.optimizers:
        state = _stable_state(opt, ws) if stable and not for_load else _state(opt, ws)
        optimizers.append({"state": state, "param_groups": _param_groups(opt)})
    tree: dict[str, Any] = {"model": model, "optimizer": optimizers}
    if not for_load:
        tree["meta"] = meta if meta is not None else module_meta(module)
    return tree


def _params(engine: ZeroEngine, ws: int, named: list[tuple[str, nn.Parameter]] | None = None) -> dict[str, Any]:
    """The parameters as a tree: the master shard (FlatShard) of each the engine shards, the others whole."""
    model: dict[str, Any] = {}
    # The engine's list, not module.named_parameters(): that would wait for the step's parameter
    # gathers on the training thread, and a save needs only the masters of the sharded ones.
    for fqn, p in named if named is not None else engine.named_parameters():
        sp = engine.sharded_params.get(p)
        model[fqn] = _flat(sp, sp.master, ws) if sp is not None else p.detach()
    return model


def _stable_params(engine: ZeroEngine, ws: int) -> StableDict:
    """:func:`_params` as the same :class:`StableDict` as the previous call's while the parameters, their shards and
    their shapes and the layouts of those held whole are the same ([Note: stable subtrees] in formats/tree.py; a module with
    persistent buffers copies them at each save, so its model part is built afresh instead)."""
    named = engine.named_parameters()
    sharded = engine.sharded_params
    identities: list[Any] = [ws]
    for fqn, p in named:
        sp = sharded.get(p)
        identities += (fqn, id(p), p.shape, id(sp) if sp is not None else (p.data_ptr(), p.stride(), p.dtype))
    engine.save_cache["model"] = kept = _reuse(engine.save_cache.get("model"), identities,
                                               lambda: _params(engine, ws, named))
    return kept[1]


def _reuse(kept: tuple[list[Any], StableDict] | None, identities: list[Any],
           build: Callable[[], dict[str, Any]]) -> tuple[list[Any], StableDict]:
    """``kept`` (the identities a tree was built from, the tree) while they are ``identities``, else ``build()`` as a
    :class:`StableDict` with them: the tree holds those objects, so no other object takes their ids meanwhile."""
    return kept if kept is not None and kept[0] == identities else (identities, StableDict(build()))


def _state(opt: ZeroOptimizer, ws: int, entries: list[dict[str, Any] | None] | None = None) -> dict[str, Any]:
    """``opt``'s state as a tree: per parameter name, its sharded tensors as FlatShards, its scalars as they are."""
    state: dict[str, Any] = {}
    for sp, entry in zip(opt.sharded_params, entries or [opt.state.get(sp.master) for sp in opt.sharded_params]):
        if entry:
            # The shard's fields read once per parameter, not per state tensor: a save of a deep model
            # builds thousands of these on the training thread.
            fields = _shard_fields(sp, ws)
            state[sp.fqn] = {k: FlatShard(v, *fields) if _is_sharded_state(k, v, sp) else v for k, v in entry.items()}
    return state


_SCALARS = frozenset((int, float, bool, str, bytes, type(None)))
"""State values that cannot change inside: with tensors, the only ones a kept state tree may hold."""


def _stable_state(opt: ZeroOptimizer, ws: int) -> dict[str, Any]:
    """:func:`_state` as the same :class:`StableDict` as the previous call's while every parameter is the same and
    every state value the same tensor at the same address and shape, or the same immutable scalar ([Note: stable
    subtrees] in formats/tree.py): an optimizer that updates its state in place keeps it. Kept on the optimizer
    (``save_cache``, which its load and the engine drop)."""
    entries = [opt.state.get(sp.master) for sp in opt.sharded_params]
    identities: list[Any] = [ws, *map(id, opt.sharded_params)]
    kinds: set[type] = set()
    for entry in entries:
        if entry:
            values = entry.values()
            kinds.update(map(type, values))
            identities += entry
            identities += map(id, values)
            identities += [(v.data_ptr(), v.shape) for v in values if isinstance(v, Tensor)]
        else:
            identities.append(None)
    if not all(kind in _SCALARS or issubclass(kind, Tensor) for kind in kinds):
        opt.save_cache = None
        return _state(opt, ws, entries)  # a container value may change inside: built afresh each save
    opt.save_cache = _reuse(opt.save_cache, identities, lambda: _state(opt, ws, entries))
    return opt.save_cache[1]


def module_meta(module: nn.Module) -> dict[str, Any]:
    """What a reader without the module needs to rebuild ``state_dict`` and a Hugging Face folder.

    It walks every parameter and calls ``state_dict()``, which waits for the parameter all-gathers
    still in flight (see [Note: guarded parameter reads] in engine/zero_engine.py): computed during training it
    would end the overlap of every step that saves, so ZeroLowLevelStrategy computes it once at setup."""
    names = {id(p): fqn for fqn, p in module.named_parameters()}
    aliases = {fqn: names[id(p)] for fqn, p in module.named_parameters(remove_duplicate=False)
               if names[id(p)] != fqn}
    meta: dict[str, Any] = {
        "param_dtypes": {fqn: str(p.dtype).removeprefix("torch.") for fqn, p in module.named_parameters()},
        "state_dict_keys": list(module.state_dict().keys()),
        "aliases": aliases,
    }
    hf = find_pretrained(module)
    if hf is not None:
        prefix, model = hf
        meta["hf"] = {"prefix": prefix, "class": type(model).__name__, "config": model.config.to_json_string()}
    return meta


def find_pretrained(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The first ``transformers.PreTrainedModel`` inside ``module`` and its state_dict prefix."""
    # A module holding a PreTrainedModel has imported transformers.modeling_utils already. `transformers`
    # alone is a lazy module that other imports (Lightning's) load: importing PreTrainedModel from it
    # here took the first save ~0.5 s of the training thread, in every run without a transformers model.
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if modeling_utils is None:
        return None
    PreTrainedModel = modeling_utils.PreTrainedModel
    for name, sub in module.named_modules():
        if isinstance(sub, PreTrainedModel):
            return (f"{name}." if name else ""), sub
    return None



def full_optimizer_states(engine: ZeroEngine) -> list[dict[str, Any]]:
    """Per-parameter optimizer state (``torch.optim.Optimizer.state_dict`` layout), shards as FlatShard."""
    out = []
    for opt in engine.optimizers:
        index = {tensor: i for i, sp in enumerate(opt.sharded_params) for tensor in (sp.param, sp.master)}
        state: dict[int, Any] = {}
        for sp in opt.sharded_params:
            entry = opt.state.get(sp.master)
            if entry:
                state[index[sp.master]] = {
                    k: _flat(sp, v, engine.shard_size) if _is_sharded_state(k, v, sp) else v for k, v in entry.items()
                }
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[p] for p in g["params"]]}
                  for g in opt.param_groups]
        out.append({"state": state, "param_groups": groups})
    return out


def saved_optimizer_fqns(tensor_keys: set[str], opt_index: int) -> set[str]:
    prefix = f"optimizer/{opt_index}/state/"
    return {k[len(prefix):].rsplit("/", 1)[0] for k in tensor_keys if k.startswith(prefix)}


def materialize_optimizer_state(opt: ZeroOptimizer, keep: set[str]) -> None:
    """Create the lazily built optimizer state (a zero-lr step on zero gradients), then keep it only
    for the parameters named in ``keep`` (those that had state when the checkpoint was saved)."""
    if not opt.state:
        lrs = [g["lr"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"] = 0.0
        for sp in opt.sharded_params:
            sp.master.grad = torch.zeros_like(sp.master)
        opt.run_inner_step(gather=False)  # no collective: the values are overwritten by the load
        for g, lr in zip(opt.param_groups, lrs):
            g["lr"] = lr
        for sp in opt.sharded_params:
            sp.master.grad = None
    for sp in opt.sharded_params:
        if sp.fqn not in keep:
            opt.state.pop(sp.master, None)


def restore_added_groups(engine: ZeroEngine, module: nn.Module, saved: list[list[dict[str, Any]]]) -> int:
    """(every rank alike, before a ``local``/``sharded`` load) Give each optimizer back the param groups the
    checkpoint's had beyond its own; the number added.

    [Note: groups added during fit] A fine-tuning callback adds groups while it trains (BaseFinetuning's
    ``unfreeze_and_add_param_group``), so a checkpoint's optimizer can hold more groups than
    ``configure_optimizers`` builds, their parameters saved as flat shards. Under DDP the callback puts
    the groups back in ``on_fit_start``, before the optimizer state is loaded; here the state is loaded
    into the engine earlier ([Note: restore before on_fit_start] in strategy.py), so the groups are
    added here, by name, with the saved hyper-parameters: the engine shards their parameters as it did
    when it saved, and the load then finds every shard where it was. Only a checkpoint whose first
    groups are the optimizer's own, and whose further groups name parameters of the module that no
    optimizer holds, qualifies; any other difference stays the load's error. The callback's later
    ``optimizer.param_groups = ...`` assigns the same parameters in the same groups."""
    params = dict(module.named_parameters())
    held = {sp.fqn for sp in engine.sharded_params.values()}
    added = 0
    for opt, groups in zip(engine.optimizers, saved):
        current = [g["params"] for g in _param_groups(opt)]
        extra = groups[len(current):]
        names = [name for group in extra for name in group["params"]]
        if (not extra or [g["params"] for g in groups[:len(current)]] != current
                or any(name not in params or name in held for name in names) or len(set(names)) != len(names)):
            continue
        for group in extra:
            opt.add_param_group({**{k: v for k, v in group.items() if k != "params"},
                                 "params": [params[name] for name in group["params"]]})
            added += 1
        held.update(names)
    return added


def apply_param_groups(opt: ZeroOptimizer, saved: list[dict[str, Any]]) -> None:
    if len(saved) != len(opt.param_groups):
        raise ValueError(
            f"The checkpoint's optimizer has {len(saved)} param groups, this one {len(opt.param_groups)}:"
            " build the optimizer the way it was built when the checkpoint was saved. Groups a callback added"
            " during fit (BaseFinetuning) are given back from 'sharded' and 'local' checkpoints, whose groups"
            " name their parameters; a 'full' file numbers them only, as torch does."
        )
    for group, saved_group in zip(opt.param_groups, saved):
        group.update({k: v for k, v in saved_group.items() if k != "params"})


@torch.no_grad()
def load_full_into_engine(engine: ZeroEngine, module: nn.Module, content: dict[str, Any], strict: bool = True,
                          masters: dict[str, Tensor] | None = None) -> None:
    """Put a ``full`` (Lightning-format) checkpoint into the engine, at any world size.

    ``masters``: the exact fp32 masters of parameters saved in a lower precision; without them the
    masters are rebuilt from the (rounded) weights."""
    module.load_state_dict(content["state_dict"], strict=strict)
    engine.refresh_masters_from_params()
    for sp in engine.sharded_params.values():
        if masters and sp.fqn in masters:
            sp.master.copy_(sp.own_elements(masters[sp.fqn]))
    saved_states = content.get("optimizer_states") or []
    if not saved_states:
        return  # saved without optimizer state (outside fit, save_weights_only): the optimizers start fresh
    if len(saved_states) != len(engine.optimizers):
        raise ValueError(
            f"The checkpoint holds {len(saved_states)} optimizer states, the model configures"
            f" {len(engine.optimizers)} optimizers."
        )
    for opt, saved in zip(engine.optimizers, saved_states):
        apply_param_groups(opt, saved["param_groups"])
        opt.state.clear()
        for index, entry in saved["state"].items():
            sp = opt.sharded_params[int(index)]
            if sp.shape_aware:
                sp.split_state_keys = frozenset(k for k, v in entry.items() if _is_full_state(k, v, sp))
            opt.state[sp.master] = {
                k: sp.own_elements(v).to(sp.master.device, sp.master.dtype).clone()
                if _is_full_state(k, v, sp) else _whole_value(v, sp)
                for k, v in entry.items()
            }


def _whole_value(value: Any, sp: ShardedParam) -> Any:
    """A shape-aware optimizer's whole state tensor (Adafactor's factors) goes where its step runs."""
    if sp.shape_aware and isinstance(value, Tensor) and value.dim() > 0:
        return value.to(sp.master.device)
    return value
