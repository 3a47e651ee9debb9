"""[Note: hook before weights]: a fit's load whose weights wait for the module's ``on_load_checkpoint``
(:class:`PendingWeights`, applied by :func:`apply_pending_weights`), and the key checks every load of
weights makes as ``strict_loading`` says (:func:`missing_weights`, :func:`keep_own_values`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightning_zero.checkpoint import engine_tree, loader
from lightning_zero.checkpoint.formats.tree import check_same_keys
from lightning_zero.checkpoint.reader import MASTERS_KEY
from lightning_zero.engine import ZeroEngine


@dataclass
class PendingWeights:
    """A fit's load whose weights wait for the module's ``on_load_checkpoint`` ([Note: hook before
    weights]); :func:`apply_pending_weights` finishes it."""

    url: str
    options: dict[str, Any]
    full: dict[str, Any] | None = None
    """A ``full`` checkpoint's content: its state dict is applied after the hook, as edited."""
    placeholders: dict[int, str] = field(default_factory=dict)
    """``local``/``sharded``: id of each placeholder the hook saw in ``state_dict`` -> the saved key."""
    loaded: set[str] = field(default_factory=set)
    """The module's keys the load filled by name, before the hook."""
    own: dict[str, Tensor] = field(default_factory=dict)
    """The module's values of those keys before the load (master shards for sharded parameters)."""
    keep: list[Any] = field(default_factory=list)  # the placeholders themselves, alive while ids are used



# [Note: hook before weights]
# Lightning hands the loaded checkpoint to the module's ``on_load_checkpoint`` before it applies
# ``checkpoint["state_dict"]`` (``load_model_state_dict``): a module migrates an old checkpoint there
# (renamed layers, dropped or new weights), and only then does ``strict_loading`` judge the keys. A
# ``full`` checkpoint is read whole anyway: the hook sees its tensors and the edited state dict is
# applied afterwards. A ``local``/``sharded`` one is read shard by shard into the engine, by name,
# before the hook (its files are checked, and a damaged one falls back to an older checkpoint); the
# hook sees a placeholder per saved weight (a tensor on the ``meta`` device, with the module's shape
# where the name matches). Afterwards a placeholder left under its own name costs nothing, one moved
# to another name is read again into that weight, a tensor the hook put in is used as it is, and a
# weight whose entry the hook removed gets the module's own value back. Only modules that override
# ``on_load_checkpoint`` take this path. The optimizer state of a renamed weight starts fresh.


def own_values(engine: ZeroEngine, module: nn.Module, names: set[str]) -> dict[str, Tensor]:
    """Copies of what the module holds under ``names`` (this rank's master shard for a sharded parameter)."""
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    own = {}
    for fqn in names:
        sp = engine.sharded_params.get(tensors[fqn])  # type: ignore[call-overload]
        own[fqn] = (sp.master if sp is not None else tensors[fqn]).detach().clone()
    return own


def placeholders(module: nn.Module, saved: set[str], record: PendingWeights) -> dict[str, Tensor]:
    shapes = {name: (t.shape, t.dtype) for name, t in [*module.named_parameters(), *module.named_buffers()]}
    state_dict: dict[str, Tensor] = {}
    for key in sorted(saved):
        shape, dtype = shapes.get(key, ((0,), torch.float32))
        placeholder = torch.empty(shape, dtype=dtype, device="meta")
        record.placeholders[id(placeholder)] = key
        record.keep.append(placeholder)
        state_dict[key] = placeholder
    return state_dict


@torch.no_grad()
def apply_pending_weights(engine: ZeroEngine, module: nn.Module, record: PendingWeights, state_dict: dict[str, Any],
                          strict: bool, may_lack: frozenset[str] = frozenset()) -> None:
    """Finish a load after the module's ``on_load_checkpoint`` edited ``state_dict`` ([Note: hook before
    weights]): the key check as ``strict_loading`` says, then renamed, replaced and removed weights.
    No collective on the training group: call :func:`publish` afterwards."""
    if record.full is not None:
        keep_own_values(module, state_dict, record.url, strict, may_lack)
        masters = {fqn: master for fqn, master in (record.full.get(MASTERS_KEY) or {}).items()
                   if isinstance(state_dict.get(fqn), Tensor)
                   and torch.equal(master.reshape(state_dict[fqn].shape).to(state_dict[fqn].dtype), state_dict[fqn])}
        engine_tree.load_full_into_engine(engine, module, {**record.full, "state_dict": state_dict}, strict=strict,
                                         masters=masters)
        return
    own_keys = set(module.state_dict())
    lacking = missing_weights(own_keys, set(state_dict), record.url, strict, may_lack)
    if strict:
        check_same_keys(own_keys - lacking, set(state_dict), record.url)
    renamed: dict[str, str] = {}
    replaced: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        saved_key = record.placeholders.get(id(value))
        if saved_key is not None:
            if saved_key != key and key in own_keys:
                renamed[key] = saved_key
        elif isinstance(value, Tensor) and value.device.type == "meta":
            raise ValueError(
                f"on_load_checkpoint put a tensor without data under {key!r}: the weights of checkpoint"
                f" {record.url!r} ({'local/sharded'}) are placeholders until they are applied, so a hook can rename,"
                " drop or replace them but not compute from them. Convert the checkpoint to one full file"
                " (`lightning-zero convert`) and resume from that, where the hook sees the tensors."
            )
        elif isinstance(value, Tensor) and key in own_keys:
            replaced[key] = value
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    for key in record.loaded:  # filled by name before the hook, no longer the saved weight of that name
        if record.placeholders.get(id(state_dict.get(key))) != key and key not in renamed and key not in replaced:
            _set_own(engine, tensors[key], record.own[key], shard=True)
    for key, value in replaced.items():
        _set_own(engine, tensors[key], value, shard=False)
    if renamed:
        targets = engine_tree.zero_state_dict(engine, module, for_load=True)["model"]
        loader.load({"model": {saved: targets[key] for key, saved in renamed.items()}}, record.url,
                   storage_options=record.options, strict=False)
        rank_zero_warn(f"on_load_checkpoint renamed {len(renamed)} weights of {record.url!r}"
                       f" ({_some(sorted(renamed))}): their optimizer state starts fresh.")


def _set_own(engine: ZeroEngine, tensor: Tensor, value: Tensor, shard: bool) -> None:
    """``value`` into a module tensor: into its master shard if the engine holds it (``shard``: ``value`` is
    that shard already; else a whole tensor), else the tensor itself."""
    sp = engine.sharded_params.get(tensor)  # type: ignore[call-overload]
    if sp is None:
        tensor.copy_(value)
    elif shard:
        sp.master.copy_(value)
    else:
        sp.load_master_from(value.to(sp.master.device))


def missing_weights(expected: set[str], saved: set[str], url: str, strict: bool,
                    may_lack: frozenset[str] = frozenset()) -> set[str]:
    """The expected weights a checkpoint lacks, which a load leaves as the module has them: those in
    ``may_lack`` always, any with ``strict=False`` (warned about as Lightning's ``load_from_checkpoint``
    warns, as are the weights it holds in excess). With ``strict`` any other difference is left for
    the load's own key check to refuse."""
    lacking = expected - saved
    if strict:
        return lacking & may_lack
    reported = sorted(lacking - may_lack)
    if reported:
        rank_zero_warn(f"Found {len(reported)} keys that are in the model state dict but not in the checkpoint"
                       f" {url!r}: {_some(reported)} (they keep the module's values: strict_loading is False)")
    excess = sorted(saved - expected)
    if excess:
        rank_zero_warn(f"Found {len(excess)} keys that are not in the model state dict but in the checkpoint"
                       f" {url!r}: {_some(excess)} (ignored: strict_loading is False)")
    return lacking


def _some(keys: list[str], shown: int = 10) -> str:
    return f"{keys[:shown]}{' ...' if len(keys) > shown else ''}"


def keep_own_values(module: nn.Module, state_dict: dict[str, Any], url: str, strict: bool,
                    may_lack: frozenset[str] = frozenset()) -> None:
    """Put the module's own values into a whole ``state_dict`` where it lacks weights a load leaves as
    they are (:func:`missing_weights`), so that ``load_state_dict`` checks the rest as asked."""
    own = module.state_dict()
    lacking = missing_weights(set(own), set(state_dict), url, strict, may_lack)
    if strict:
        check_same_keys(set(own) - lacking, set(state_dict), url)
    for key in lacking:
        state_dict[key] = own[key]
