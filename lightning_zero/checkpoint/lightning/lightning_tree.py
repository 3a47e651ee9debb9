"""Lightning's checkpoint dict <-> the ZeRO tree, and which part of the training state each load fills.

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

Which load fills what:

* :func:`load_zero_state_dict` (``trainer.fit(ckpt_path=...)``, and the functional resume in one
  call): this rank's master and optimizer-state shards, at any world size for ``sharded``/``full``;
* :func:`load_weights` (``validate/test/predict(ckpt_path=...)``): the whole weights into the
  module, at any world size and from every mode (:mod:`~lightning_zero.checkpoint.reader`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightning_zero._compat import persistent_buffers
from lightning_zero.checkpoint import engine_tree, saver
from lightning_zero.checkpoint.formats.tree import check_same_keys, snapshot, tensor_paths
from lightning_zero.checkpoint.modes import full
from lightning_zero.checkpoint.opening import open_checkpoint
from lightning_zero.checkpoint.reader import (
    MASTERS_KEY,
    META_KEY,
    read_full_content,
    read_opened,
)
from lightning_zero.checkpoint.runtime.team import checked_on_every_rank, make_team
from lightning_zero.checkpoint.store import storage
from lightning_zero.checkpoint.store.storage import CheckpointCorruptError
from lightning_zero.checkpoint.trainer_state import (
    MARKER_FIELDS,
    TREE_TAG,
    marker_fields,
    read_trainer_state,
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
    if mode == "full":
        # The file is written in the background: only the parameters are held still until staged (the
        # optimizer's fence), so everything else is copied now, buffers and hook-added tensors
        # included, and the callbacks' state (SWA's and EMA's averages change in place).
        fenced = {_storage_key(p) for _, p in (engine.named_parameters() if engine is not None
                                               else module.named_parameters())}
        state_dict = {k: v if isinstance(v, Tensor) and _storage_key(v) in fenced else snapshot(v)
                      for k, v in checkpoint["state_dict"].items()}
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
        tree = engine_tree.zero_state_dict(engine, module, meta=meta) if engine is not None else _weights_tree(module)
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
    return edited


def _storage_key(tensor: Tensor) -> tuple[int, int, torch.dtype, tuple[int, ...]]:
    """Equal for a parameter and its detached views in ``state_dict()``; different for any other tensor."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.dtype, tuple(tensor.shape))


def _weights_tree(module: nn.Module) -> dict[str, Any]:
    """Weights only, without an engine: whole tensors (DCP writes each once, from rank 0)."""
    model = {fqn: p.detach() for fqn, p in module.named_parameters()}
    model.update({fqn: b.detach().clone() for fqn, b in persistent_buffers(module)})
    return {"model": model}


# ---- load ---------------------------------------------------------------------------------


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


def load_engine_state(engine: ZeroEngine, module: nn.Module, checkpoint_id: str,
                          storage_options: dict[str, Any] | None = None, *, strict: bool = True,
                          may_lack: frozenset[str] = frozenset(),
                          pending: list[PendingWeights] | None = None, weights_only: bool = True,
                          fabric_keys: dict[str, Any] | None = None) -> dict[str, Any]:
    """Fill this rank's shards (masters, optimizer state, hyper-parameters) and the buffers from a
    checkpoint of any mode; Lightning's part of it comes back. No collective on the training group:
    call :func:`publish` on every rank once every rank has loaded.

    ``strict`` (the LightningModule's ``strict_loading``): False keeps the module's values of weights
    the checkpoint lacks and ignores the ones it holds in excess, with Lightning's warnings;
    ``may_lack``: weights it may lack either way (saved with ``exclude_frozen_parameters``).

    ``pending`` (a list): the weights wait for the module's ``on_load_checkpoint`` ([Note: hook before
    weights]): the returned ``state_dict`` holds placeholders (``local``/``sharded``) or the saved tensors
    (``full``), and a :class:`PendingWeights` appended to the list says how to finish with
    :func:`apply_pending_weights`; the key checks wait for it too. ``weights_only=False``: the caller trusts
    the file (Lightning's ``weights_only`` argument): its non-tensor state may hold any object.
    ``fabric_keys``: ``fabric.load``'s state keys, so a file Fabric's DDP wrote reads as Fabric's layout
    (:func:`~lightning_zero.checkpoint.reader.from_fabric_layout`)."""
    options = storage_options or {}
    # Opened once for the whole load: the team's coordinator reads the marker and a sharded
    # checkpoint's .metadata for every rank ([Note: shared metadata] in opening.py).
    opened = open_checkpoint(checkpoint_id, options, team=make_team())
    loc = opened.loc
    # Everything that can fail on one rank only (a file it cannot read, another model) fails before
    # the ranks agree, so that no rank is left alone in the collectives of saver.load (over the
    # coordination group) while another has already left for the caller's agreement.
    mode = opened.mode
    keys: set[str] = set()
    content: dict[str, Any] = {}
    if mode == "full":
        # Also a DeepSpeed ZeRO-1/2 folder, read into the same Lightning dict (reader.read_full_content).
        content = checked_on_every_rank(lambda: read_full_content(opened, weights_only, fabric_keys=fabric_keys), loc)
    else:
        keys = checked_on_every_rank(lambda: saver.saved_tensor_keys(opened), loc)
    if mode == "full":
        if "state_dict" in content and pending is not None:
            pending.append(PendingWeights(checkpoint_id, options, full=content))
            return content
        if "state_dict" in content:  # Lightning's format (ZeroCheckpointIO or convert wrote it)
            keep_own_values(module, content["state_dict"], checkpoint_id, strict, may_lack)
            engine_tree.load_full_into_engine(engine, module, content, strict=strict,
                                             masters=content.get(MASTERS_KEY))
            return content
        keys = tensor_paths(content)  # a zero_state_dict tree saved whole by the functional API
    if mode != "full":  # [Note: groups added during fit]
        engine_tree.restore_added_groups(engine, module, checked_on_every_rank(lambda: saver.saved_param_groups(opened),
                                                                               loc))
    for index, optimizer in enumerate(engine.optimizers):
        engine_tree.materialize_optimizer_state(optimizer, engine_tree.saved_optimizer_fqns(keys, index))
    tree = engine_tree.zero_state_dict(engine, module, for_load=True)
    if not any(k.startswith("optimizer/") for k in keys):
        tree.pop("optimizer")
    saved_model = {k.removeprefix("model/") for k in keys if k.startswith("model/")}
    # Files written before saves left out buffers registered with persistent=False hold them: read as before.
    tree["model"].update({fqn: b.detach() for fqn, b in module.named_buffers() if fqn in saved_model
                          and fqn not in tree["model"]})
    record = None
    if pending is not None:  # by name, leniently: the hook decides what stays ([Note: hook before weights])
        lacking = set(tree["model"]) - saved_model
        record = PendingWeights(checkpoint_id, options, loaded=set(tree["model"]) & saved_model)
        record.own = _own_values(engine, module, record.loaded)
    else:
        lacking = missing_weights(set(tree["model"]), saved_model, checkpoint_id, strict, may_lack)
    for fqn in lacking:
        del tree["model"][fqn]  # its master keeps the module's value
    objects = saver.load_opened(tree, opened, strict=strict and record is None)
    for optimizer, saved in zip(engine.optimizers, objects.get("optimizer", [])):
        engine_tree.apply_param_groups(optimizer, saved["param_groups"])
    content = read_trainer_state(objects["trainer"], checkpoint_id, weights_only) if "trainer" in objects else {}
    if record is None:
        return {**content, "state_dict": module.state_dict()}
    state_dict = _placeholders(module, saved_model, record)
    assert pending is not None
    pending.append(record)
    return {**content, "state_dict": state_dict}


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


def _own_values(engine: ZeroEngine, module: nn.Module, names: set[str]) -> dict[str, Tensor]:
    """Copies of what the module holds under ``names`` (this rank's master shard for a sharded parameter)."""
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    own = {}
    for fqn in names:
        sp = engine.sharded_params.get(tensors[fqn])  # type: ignore[call-overload]
        own[fqn] = (sp.master if sp is not None else tensors[fqn]).detach().clone()
    return own


def _placeholders(module: nn.Module, saved: set[str], record: PendingWeights) -> dict[str, Tensor]:
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
        saver.load({"model": {saved: targets[key] for key, saved in renamed.items()}}, record.url,
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


def publish(engine: ZeroEngine, module: nn.Module) -> None:
    """(collective, every rank) Gather the loaded masters into the model and take rank 0's buffers."""
    engine.publish_masters()
    engine.broadcast_buffers()


def load_zero_state_dict(engine: ZeroEngine, module: nn.Module, checkpoint_id: str, *,
                         storage_options: dict[str, Any] | None = None, strict: bool = True,
                         weights_only: bool = True, fabric_keys: dict[str, Any] | None = None) -> dict[str, Any]:
    """(every rank) Resume a fresh engine from a checkpoint of any mode, in one call: master weights,
    optimizer state and hyper-parameters, the model's weights and buffers. Returns the checkpoint's
    other content (for a Lightning checkpoint: loops, callbacks, ...). ``strict=False``: weights the
    checkpoint lacks keep the module's values and the ones it holds in excess are ignored, with a
    warning each (Lightning's ``strict_loading``)."""
    content = load_engine_state(engine, module, checkpoint_id, storage_options, strict=strict,
                                weights_only=weights_only, fabric_keys=fabric_keys)
    publish(engine, module)
    return content


@torch.no_grad()
def load_weights(module: nn.Module, checkpoint_id: str, storage_options: dict[str, Any] | None = None, *,
                 strict: bool = True, may_lack: frozenset[str] = frozenset(), apply: bool = True,
                 shared: bool = False, weights_only: bool = True) -> dict[str, Any]:
    """The saved weights (fp32 masters cast to each parameter's dtype) and buffers into ``module``,
    from any mode and at any world size; no optimizer state. Returns Lightning's part. ``strict`` and
    ``may_lack`` as in :func:`load_engine_state`. ``apply=False``: the weights are only returned, in
    ``state_dict`` (the exact masters where kept), for the module's ``on_load_checkpoint`` to see first.
    ``shared`` (collective: every rank loads the same checkpoint): rank 0 reads the commit marker and a
    sharded checkpoint's ``.metadata`` for every rank ([Note: shared metadata] in opening.py)."""
    opened = open_checkpoint(checkpoint_id, storage_options, team=make_team() if shared else None)
    content = read_opened(opened, optimizer=False, weights_only=weights_only)
    state_dict = dict(content["state_dict"])
    masters = content.get(MASTERS_KEY) or {}
    params = dict(module.named_parameters())
    for fqn, master in masters.items():
        if fqn in params:
            state_dict[fqn] = master.reshape(params[fqn].shape)  # exact values; load_state_dict casts once
    content.pop("optimizer_states", None)
    if not apply:
        return {**content, "state_dict": state_dict}
    keep_own_values(module, state_dict, checkpoint_id, strict, may_lack)
    module.load_state_dict(state_dict, strict=strict)
    return {**content, "state_dict": module.state_dict()}


def load_with_fallback(path: str, storage_options: dict[str, Any], load_one: Callable[[str], dict[str, Any]],
                       agree: Callable[[bool], bool], warn: Callable[[str], None]) -> tuple[str, dict[str, Any]]:
    """(every rank) ``load_one(path)``, or, when a ``last*`` checkpoint is damaged or incomplete on
    any rank, the newest complete checkpoint beside it (as SageMaker HyperPod's adapter does).

    ``agree(ok)`` is True when ``ok`` is True on every rank: all ranks settle on the same
    checkpoint before any state is used. Returns the path loaded and ``load_one``'s result."""
    from torch.distributed.checkpoint.api import CheckpointException

    candidates = [path]
    if path.rstrip("/").rsplit("/", 1)[-1].startswith("last"):
        candidates += storage.newest_siblings(storage.resolve(path, storage_options))
    fallback_errors = (CheckpointCorruptError, storage.CheckpointNotFoundError, CheckpointException)
    first_error: BaseException | None = None
    for candidate in candidates:
        error: BaseException | None = None
        result: dict[str, Any] = {}
        try:
            result = load_one(candidate)
        except Exception as exc:  # every rank reaches the agreements below, whatever it raised
            error = exc
        if agree(error is None):
            if candidate != path:
                reason = first_error or "it failed to load on another rank"
                warn(f"Checkpoint {path!r} could not be loaded ({reason}); resumed from {candidate!r}, the newest"
                     " complete checkpoint beside it.")
            return candidate, result
        # A damaged or missing checkpoint is worth a fallback; another model, another world size or
        # an unreachable store is not: every rank must decide the same, so they agree on that too.
        if not agree(error is None or isinstance(error, fallback_errors)):
            if error is not None:
                raise error
            raise CheckpointCorruptError(f"Checkpoint {path!r} failed to load on another rank; see its error.")
        first_error = first_error or error
    if first_error is None:  # another rank failed; this one has nothing to report
        raise CheckpointCorruptError(f"Checkpoint {path!r} failed to load on another rank; see its error.")
    raise first_error
