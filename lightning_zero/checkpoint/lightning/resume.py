"""The resume: which load fills what of the training state, and the Trainer's ``load_checkpoint`` in one
named place (:class:`TrainerResume`).

* :func:`load_engine_state` (``trainer.fit(ckpt_path=...)``, Fabric's ``load``): this rank's master and
  optimizer-state shards, at any world size for ``sharded``/``full`` (``local`` through the tier's reshard);
  :func:`publish` then gathers the masters into the model. :func:`load_zero_state_dict` is both in one call.
* :func:`load_weights` (``validate/test/predict(ckpt_path=...)``): the whole weights into the module, at any
  world size and from every mode (:mod:`~lightning_zero.checkpoint.reader`).
* :func:`load_with_fallback`: a damaged or incomplete ``last*`` checkpoint gives way to the newest complete
  one beside it, every rank agreeing before any state is used.
* :class:`TrainerResume`: the strategy's ``load_checkpoint`` as steps: choose the tier (``ckpt_path="last"``
  with a local tier), load on every rank (:meth:`TrainerResume.load_one`), agree, fall back, record the
  figures. The strategy builds one per load and keeps only what it returns.

The tree these read is :mod:`~lightning_zero.checkpoint.lightning.lightning_tree`'s; the load verbs are
:mod:`~lightning_zero.checkpoint.loader`'s."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_zero.checkpoint import engine_tree, loader
from lightning_zero.checkpoint.formats.tree import tensor_paths
from lightning_zero.checkpoint.lightning.hook_weights import (
    PendingWeights,
    keep_own_values,
    missing_weights,
    own_values,
    placeholders,
)
from lightning_zero.checkpoint.opening import open_checkpoint
from lightning_zero.checkpoint.reader import MASTERS_KEY, read_full_content, read_opened
from lightning_zero.checkpoint.runtime.team import checked_on_every_rank, make_team
from lightning_zero.checkpoint.store import cleanup, storage
from lightning_zero.checkpoint.store.storage import CheckpointCorruptError
from lightning_zero.checkpoint.trainer_state import read_trainer_state
from lightning_zero.engine import ZeroEngine

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy

    from lightning_zero.checkpoint.lightning.plugin import StrategyLink
    from lightning_zero.checkpoint.tiered.recovery import TierChoice


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
    # the ranks agree, so that no rank is left alone in the collectives of loader.load (over the
    # coordination group) while another has already left for the caller's agreement.
    whole = opened.mode.lightning_format
    keys: set[str] = set()
    content: dict[str, Any] = {}
    if whole:
        # Also a DeepSpeed ZeRO-1/2 folder, read into the same Lightning dict (reader.read_full_content).
        content = checked_on_every_rank(lambda: read_full_content(opened, weights_only, fabric_keys=fabric_keys), loc)
    else:
        keys = checked_on_every_rank(lambda: loader.saved_tensor_keys(opened), loc)
    if whole:
        if "state_dict" in content and pending is not None:
            pending.append(PendingWeights(checkpoint_id, options, full=content))
            return content
        if "state_dict" in content:  # Lightning's format (ZeroCheckpointIO or convert wrote it)
            keep_own_values(module, content["state_dict"], checkpoint_id, strict, may_lack)
            engine_tree.load_full_into_engine(engine, module, content, strict=strict,
                                             masters=content.get(MASTERS_KEY))
            return content
        keys = tensor_paths(content)  # a zero_state_dict tree saved whole by the functional API
    if not whole:  # [Note: groups added during fit]
        engine_tree.restore_added_groups(engine, module, checked_on_every_rank(lambda: loader.saved_param_groups(opened),
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
        record.own = own_values(engine, module, record.loaded)
    else:
        lacking = missing_weights(set(tree["model"]), saved_model, checkpoint_id, strict, may_lack)
    for fqn in lacking:
        del tree["model"][fqn]  # its master keeps the module's value
    objects = loader.load_opened(tree, opened, strict=strict and record is None)
    for optimizer, saved in zip(engine.optimizers, objects.get("optimizer", [])):
        engine_tree.apply_param_groups(optimizer, saved["param_groups"])
    content = read_trainer_state(objects["trainer"], checkpoint_id, weights_only) if "trainer" in objects else {}
    if record is None:
        return {**content, "state_dict": module.state_dict()}
    state_dict = placeholders(module, saved_model, record)
    assert pending is not None
    pending.append(record)
    return {**content, "state_dict": state_dict}


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
        candidates += cleanup.newest_siblings(storage.resolve(path, storage_options))
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


@dataclass
class TrainerResume:
    """One ``Strategy.load_checkpoint`` (every rank): what the load fills and how the ranks settle on one
    checkpoint. :meth:`run` is the whole of it; the strategy keeps :attr:`pending` (the weights that wait for
    the module's ``on_load_checkpoint``) and publishes the masters once it returns."""

    strategy: Strategy
    """Its ``reduce_boolean_decision`` over the training group is how the ranks agree (:meth:`agree`)."""
    module: nn.Module
    engine: ZeroEngine | None
    """None outside ``fit``: the whole weights go into the module (:func:`load_weights`)."""
    options: dict[str, Any]
    strict: bool
    may_lack: frozenset[str]
    hook_first: bool
    """The module overrides ``on_load_checkpoint``: the weights wait for it ([Note: hook before weights])."""
    shared: bool
    """A ``ZeroCheckpointIO`` made the coordination group: rank 0 reads the marker for every rank."""
    trusted: bool
    """Lightning's ``weights_only=False``: the non-tensor state may hold any object."""
    pending: list[PendingWeights] = field(default_factory=list)

    def agree(self, ok: bool) -> bool:
        """(collective, training group) True when ``ok`` is True on every rank."""
        return bool(self.strategy.reduce_boolean_decision(ok, all=True))

    def load_one(self, candidate: str) -> dict[str, Any]:
        """(every rank) One checkpoint into the engine (in ``fit``) or the module; no agreement yet."""
        self.pending.clear()
        if self.engine is None:
            return load_weights(self.module, candidate, self.options, strict=self.strict, may_lack=self.may_lack,
                                apply=not self.hook_first, shared=self.shared, weights_only=not self.trusted)
        return load_engine_state(self.engine, self.module, candidate, self.options, strict=self.strict,
                                 may_lack=self.may_lack, pending=self.pending if self.hook_first else None,
                                 weights_only=not self.trusted)

    def run(self, path: str, link: StrategyLink | None, shard_group_size: int | None) -> dict[str, Any]:
        """(every rank) Load ``path`` (for ``ckpt_path="last"`` with a local tier: the tier the plugin's ``link``
        chooses), falling back as :func:`load_with_fallback` does; ``link`` records the figures. Returns
        Lightning's part."""
        started = time.perf_counter()
        choice = link.resolve_last(shard_group_size) if link is not None else None
        if choice is not None and choice.tier == "local":
            loaded, result = self.from_local_tier(choice)
        else:
            loaded, result = load_with_fallback(choice.path if choice is not None else path, self.options,
                                                self.load_one, self.agree, rank_zero_warn)
        if choice is not None and link is not None:
            link.record_load(as_loaded(choice, loaded, result), time.perf_counter() - started)
        return result

    def from_local_tier(self, choice: TierChoice) -> tuple[str, dict[str, Any]]:
        """A resume from the local tier (every rank its own node's path), or, if it fails on any rank, from
        the durable tier with a warning. Returns the path loaded and Lightning's part."""
        error: BaseException | None = None
        result: dict[str, Any] = {}
        try:
            result = self.load_one(choice.path)
        except Exception as exc:  # every rank reaches the agreement below
            error = exc
        if self.agree(error is None):
            return choice.path, result
        if choice.durable is None:
            raise error if error is not None else RuntimeError(
                f"Loading the local-tier checkpoint {choice.path!r} failed on another rank; see its error.")
        rank_zero_warn(f"Loading the local-tier checkpoint {choice.path!r} failed ({error or 'on another rank'});"
                       f" resuming from the durable tier, {choice.durable!r}.")
        return load_with_fallback(choice.durable, self.options, self.load_one, self.agree, rank_zero_warn)


def as_loaded(choice: TierChoice, loaded: str, result: dict[str, Any]) -> TierChoice:
    """``choice`` as the resume turned out: when another checkpoint than the chosen one loaded (the local
    tier failed on some rank and the durable one was read, or a damaged one gave way to an older sibling),
    its tier, path and step are those of the one loaded, and the steps lost count from it."""
    if loaded == choice.path:
        return choice
    step = result.get("global_step")
    step = step if isinstance(step, int) else None
    lost = choice.steps_lost + (choice.step - step) if step is not None and choice.step is not None else choice.steps_lost
    return replace(choice, tier="durable", path=loaded, step=step, steps_lost=lost, resharded_from=None,
                   reason=f"{choice.reason}; it failed to load, and {loaded!r} was loaded instead")
