"""The sharded optimizer: the user's optimizer stepping this rank's fp32 master shards.

Step order (ARCHITECTURE.md, "The path of a gradient"): the reductions were already waited for when backward
ended (:class:`~lightning_zero.engine.grad_reducer.GradReducer`); the closure runs (Lightning's forward and
backward); the previous step's parameter gathers are finished and the presence of gradients is
read, once; the pre-update hooks run; clipping uses the global norm; the inner optimizer updates
the shards; the updated shards' all-gathers are launched (:class:`~lightning_zero.engine.param_gather.ParamGatherer`),
and either finished before ``step`` returns or, with ``overlap_param_gather``, during the next
forward ([Note: gather overlap] in param_gather.py).

[Note: wrapping the user's optimizer] The user's optimizer object is kept, and its param
groups keep the module's parameters, as Lightning and its callbacks (BaseFinetuning, SWA,
LearningRateMonitor) read them; LR schedulers built over it keep working and every option of every
group is kept. Only for a step (and its state dict) do the groups hold this rank's master shards
(:meth:`ZeroOptimizer.masters_in_groups`), and the state is keyed by the masters. :class:`ZeroOptimizer` shares ``param_groups``,
``state`` and ``defaults`` with it through properties, so that even ``load_state_dict``
(which replaces those attributes on the inner optimizer) cannot make the two disagree.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_zero.engine import collectives as comm
from lightning_zero.engine._compat import is_compiled_function, run_at_trace_time
from lightning_zero.engine.grad_bucket import GradBucket, ShardedParam, adopt_param_writes
from lightning_zero.engine.grad_reducer import GradReducer
from lightning_zero.engine.optimizer_kinds import updates_each_parameter_alone
from lightning_zero.engine.param_gather import ParamGatherer
from lightning_zero.engine.whole_step import WholeParamStep, is_split_state, swap_params


class ZeroOptimizer(Optimizer):
    """Runs ``inner`` on this rank's shards and keeps the model's full parameters up to date."""

    def __init__(self, inner: Optimizer, sharded_params: Sequence[ShardedParam],
                 group: dist.ProcessGroup | None, reducer: GradReducer, gatherer: ParamGatherer,
                 device: torch.device, overlap_param_gather: bool = True, shape_aware: bool = False,
                 whole_step_group_bytes: int | None = None, release_grad_shards: bool = True) -> None:
        if any(_has_stepped(entry) for entry in inner.state.values()):
            raise ValueError(
                f"{type(inner).__name__} already holds optimizer state for {len(inner.state)} parameters."
                " Create the optimizer fresh (in `configure_optimizers`) and let ZeRO shard it before the"
                " first step."
            )
        # State made by the constructor (Adagrad's accumulators; the same on every rank) is sharded.
        constructed = dict(inner.state)
        self.inner = inner
        self.process_group = group
        self._device = device  # for tensors when this rank holds no gradient (fallbacks only)
        self._overlap_param_gather = overlap_param_gather
        self._shape_aware = shape_aware
        self._whole_step_group_bytes = whole_step_group_bytes
        self._release_grad_shards = release_grad_shards  # ZeroConfig.release_grad_shards
        self.save_cache: Any = None
        """What a save keeps of this state until the next (checkpoint/engine_tree.py); a load or the engine drops it."""
        self.groups_changed: Callable[[], None] | None = None
        """Called after ``add_param_group`` during training: the engine rebuilds its buckets (ZeroEngine.rebuild)."""
        self.bind(sharded_params, reducer, gatherer)
        # Optimizer.__init__ resets param_groups/state through the delegating properties and
        # re-adds the very same group dicts (see [Note: wrapping the user's optimizer]).
        groups = list(inner.param_groups)
        self._constructed = False
        super().__init__(groups, inner.defaults)
        self._constructed = True
        self._pre_update_hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()
        self._skip_update = False
        for sp in self.sharded_params:
            if sp.param in constructed:
                self.state[sp.master] = _shard_state(constructed[sp.param], sp)

    def bind(self, sharded_params: Sequence[ShardedParam], reducer: GradReducer, gatherer: ParamGatherer) -> None:
        """Step these shards (in param_groups order) with this reducer's gradients and gatherer; the engine
        binds again when it rebuilds its buckets."""
        self.sharded_params = list(sharded_params)
        self._reducer = reducer
        self._gatherer = gatherer
        self._buckets: list[GradBucket] = list(dict.fromkeys(sp.bucket for sp in sharded_params))
        owned = {id(sp) for sp in sharded_params}
        self._whole_buckets = [b for b in self._buckets if all(id(sp) in owned for sp in b.params)]
        self._partial = [sp for sp in sharded_params if sp.bucket not in self._whole_buckets]
        # Shape-aware optimizers (optimizer_kinds.py) step whole parameters: [Note: whole-matrix step].
        self.whole_step = WholeParamStep(self.inner, self.sharded_params, self.process_group,
                                         updates_each_parameter_alone(self.inner), self._whole_step_group_bytes) \
            if self._shape_aware else None

    # The inner optimizer is the one source of truth for groups, state and defaults.
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.inner.defaults = value

    @property
    def shard_numel(self) -> int:
        """Real elements of master weights (and of each optimizer-state tensor) on this rank."""
        return sum(sp.shard_numel for sp in self.sharded_params)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if torch.compiler.is_compiling():
            run_at_trace_time(_refuse_compiled_step)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._prepare_update()
        for hook in list(self._pre_update_hooks.values()):
            hook()
        if self._skip_update:
            # Every rank decided this together (the strategy's non-finite loss check): no shard
            # changes, so no gather either; zero_grad then drops the (zero) gradients.
            self._skip_update = False
            return loss
        # After the hooks (a save still staging the masters has finished copying them): weights
        # written into the module since the last step reach the masters before the update.
        self.adopt_module_writes()
        self.run_inner_step()
        self.gather_params()
        return loss

    def run_inner_step(self, gather: bool = True) -> None:
        """The user's optimizer on this rank's shards (and, shape-aware, on whole parameters:
        [Note: whole-matrix step], collective over the shard group unless ``gather`` is False, which
        only a zero-lr step creating state before a checkpoint load may use)."""
        with self.masters_in_groups():
            if self.whole_step is None:
                self.inner.step()
            else:
                self.whole_step.run(self.inner.step, gather)

    @contextlib.contextmanager
    def masters_in_groups(self) -> Iterator[None]:
        """The user's optimizer holding this rank's master shards in its param groups, for a step or
        its state dict; the module's parameters again afterwards ([Note: wrapping the user's optimizer])."""
        swap_params(self.inner, {sp.param: sp.master for sp in self.sharded_params})
        try:
            yield
        finally:
            swap_params(self.inner, {sp.master: sp.param for sp in self.sharded_params})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of the module's parameters, as on any optimizer; during training (BaseFinetuning's
        ``unfreeze_and_add_param_group``) the engine then shards them too (every rank alike, between steps)."""
        if not self.__dict__.get("_constructed", False):
            super().add_param_group(param_group)  # Optimizer.__init__ re-adding the user's groups
            return
        if self.groups_changed is None:
            raise RuntimeError(
                f"{type(self.inner).__name__}.add_param_group: this ZeroOptimizer's engine is closed (fit has ended);"
                " parameters can be added while it trains."
            )
        self.inner.add_param_group(param_group)
        self.groups_changed()

    def skip_next_update(self) -> None:
        """Make the next :meth:`step` run its closure but leave the shards and their state as they
        are. Call it on every rank alike (the collectives of the step must still match)."""
        self._skip_update = True

    def _prepare_update(self) -> None:
        """Before anything reads or writes the shards: the last step's gathers done (for fp32
        they read the master shards themselves), ``.grad`` only where some rank had one."""
        self._gatherer.finish()
        self._reducer.resolve_presence()

    def adopt_module_writes(self) -> None:
        """Take weights written in place into the module's parameters (``load_state_dict``,
        ``p.copy_``, a callback's transfer) into this optimizer's master shards: one version read per
        parameter when nothing was written ([Note: the module is the truth] in zero_engine.py)."""
        adopt_param_writes(self.sharded_params, compare_values=False)

    def register_pre_update_hook(self, hook: Callable[[], None]) -> RemovableHandle:
        """Call ``hook()`` in :meth:`step` after the closure and right before the shards change.

        [Note: pre-update hooks] In Lightning's automatic optimization ``training_step`` and
        backward run *inside* ``step(closure)``, after ``register_step_pre_hook`` hooks, so a step
        pre-hook that blocks (a checkpoint still staging the shards) would block before forward.
        These hooks run after the closure, when forward and backward have already overlapped the
        wait, and before the inner optimizer writes the master shards and their state. Hooks run in
        registration order; the handle's ``remove()`` unregisters one.
        """
        handle = RemovableHandle(self._pre_update_hooks)
        self._pre_update_hooks[handle.id] = hook
        return handle

    def gather_params(self, all_buckets: bool = False) -> None:
        """All-gather updated shards into the model's parameters, bucket by bucket, at most
        ``MAX_IN_FLIGHT`` at a time; left to finish during the next forward with
        ``overlap_param_gather`` (never with ``all_buckets``, used at load time).

        Buckets in which no parameter got a gradient on any rank are skipped; ``has_grad`` is
        the same on every rank (it comes from the reduced flags), so the collectives match.
        ``all_buckets`` (after the masters were loaded) includes the frozen buckets, whose
        loaded masters reach the model no other way.
        """
        self._gatherer.start(
            bucket for bucket in self._buckets
            if all_buckets or (bucket.communicates and any(sp.has_grad for sp in bucket.params))
        )
        if all_buckets or not self._overlap_param_gather:
            self._gatherer.finish()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip shard gradients by the norm over *all* shards, like ``clip_grad_norm_`` on one process."""
        self._prepare_update()  # the one presence read of this step (no-op at the step then)
        grads = [sp.grad_shard for sp in self.sharded_params if sp.has_grad]
        device = self._buckets[0].device if self._buckets else self._device
        norm_type = float(norm_type)
        if norm_type == math.inf:
            local = torch.stack([g.abs().max() if g.numel() else g.new_zeros(()) for g in grads]).max() \
                if grads else torch.zeros((), device=device)
            total = comm.all_reduce_(local, self.process_group, dist.ReduceOp.MAX)
        else:
            powered = torch.stack([g.float().abs().pow(norm_type).sum() for g in grads]).sum() \
                if grads else torch.zeros((), device=device)
            total = comm.all_reduce_(powered, self.process_group).pow(1.0 / norm_type)
        clip_coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        if grads:
            torch._foreach_mul_(grads, clip_coef.to(grads[0].dtype))
        return total

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clip shard gradients element-wise, like ``clip_grad_value_`` on the whole gradients."""
        self._prepare_update()
        grads = [sp.grad_shard for sp in self.sharded_params if sp.has_grad]
        if grads:
            torch._foreach_clamp_min_(grads, -clip_value)
            torch._foreach_clamp_max_(grads, clip_value)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget accumulated gradients: full ones not yet reduced and the reduced shards. With
        ``set_to_none`` (the default) and ``ZeroConfig.release_grad_shards`` the shards' storage is
        freed until the next backward reduces into it ([Note: gradient shards between steps] in
        grad_bucket.py); otherwise it is zeroed and kept. Either way no parameter has a ``.grad``
        until the next backward."""
        for sp in self.sharded_params:
            sp.param.grad = None
            sp.master.grad = None  # a view of the bucket's shard: dropped before the shard is freed
            sp.has_grad = False
        # Presence counts of a backward no step consumed go too (they live on the device).
        for bucket in self._whole_buckets:
            if set_to_none and self._release_grad_shards:
                bucket.release_grad_shard()
            elif bucket.holds_grad_shard:
                bucket.grad_shard.zero_()
            bucket.present_count.zero_()
        for sp in self._partial:
            # A bucket shared with another optimizer keeps its storage: that one's shards live in it.
            if sp.bucket.holds_grad_shard:
                sp.grad_shard.zero_()
            sp.present_count.zero_()

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state, in the inner optimizer's format."""
        with self.masters_in_groups():
            return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.save_cache = None  # it would keep the replaced tensors alive
        with self.masters_in_groups():
            self.inner.load_state_dict(state_dict)

    @property
    def optimizer(self) -> Optimizer:
        """The user's optimizer. Lightning's LearningRateMonitor (like other tools that know wrapped
        optimizers, DeepSpeed's among them) reads ``.optimizer`` to name and group it, so learning
        rates are logged once, under the user's optimizer's name."""
        return self.inner

    def __getstate__(self) -> dict[str, Any]:
        # Optimizer's own keeps defaults, state and param_groups only; this wrapper is its attributes
        # (the Trainer pickles and deep-copies after fit, with its optimizers).
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"ZeroOptimizer({self.inner!r})"


def _has_stepped(entry: dict[str, Any]) -> bool:
    """Whether a parameter's state comes from a step (every torch optimizer counts ``step``), not
    from the constructor."""
    step = entry.get("step")
    return step is None or float(step) != 0.0


def _shard_state(entry: dict[str, Any], sp: ShardedParam) -> dict[str, Any]:
    """A parameter's full state as this rank holds it: tensors shaped like the parameter cut to the
    rank's elements, the rest whole."""
    split = {key for key, value in entry.items() if is_split_state(key, value, sp.param.shape)}
    sp.split_state_keys = frozenset(split)
    return {key: sp.own_elements(value).clone() if key in split else value for key, value in entry.items()}


def _refuse_compiled_step(_ctx: Any = None) -> None:
    """(trace time) ``torch.compile`` is tracing :meth:`ZeroOptimizer.step`.

    [Note: compiled optimizer step] The step around the user's optimizer waits for gathers on a thread,
    launches collectives and calls hooks: compiled, it breaks into graphs guarded on that state, which
    differs at each step, and its gathers would leave the compiled region. What a compiled step speeds up
    is the user's optimizer over its tensors (one fused kernel per group instead of a loop), and that
    part compiles unchanged: the user's optimizer steps the same master tensors every time."""
    raise RuntimeError(
        "torch.compile of ZeroOptimizer.step (the optimizer the engine or strategy hands back) is not supported:"
        " it runs collectives, a gather thread and hooks. Compile your optimizer's own step instead, before"
        " the engine gets it (`optimizer.step = torch.compile(optimizer.step)`, in configure_optimizers under"
        " Lightning): the engine then steps its master shards through the compiled step. Or use foreach=True"
        " / fused=True, which batch the update without compiling."
    )


def refuse_compiled_shape_aware_steps(optimizers: Sequence[Optimizer], kinds: Sequence[str]) -> None:
    """A shape-aware optimizer whose ``step`` the user compiled is refused (pure: every rank alike,
    before any collective). Its step runs on whole matrices gathered anew at each step ([Note: whole-matrix
    step] in whole_step.py): new tensors each time, so the compiled step would recompile every step until
    torch's ``recompile_limit`` and then run eagerly ([Note: compiled optimizer step])."""
    for index, (optimizer, kind) in enumerate(zip(optimizers, kinds, strict=True)):
        if kind == "shape_aware" and is_compiled_function(optimizer.step):
            raise ValueError(
                f"Optimizer {index} ({type(optimizer).__qualname__}) has a compiled step, and it is shape-aware:"
                " ZeRO steps it on whole matrices gathered anew at every step, so the compiled step would"
                " recompile at every step (then run eagerly after torch's recompile_limit). Pass it uncompiled;"
                " compiling the step works for elementwise optimizers (AdamW, SGD, ...)."
            )
