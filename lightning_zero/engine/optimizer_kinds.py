"""Which optimizers ZeRO can step on flat even shards, and which need whole matrices.

[Note: optimizer kinds] The engine hands the user's optimizer flat 1-D shards of every parameter
(the even split of sharding.py). That is exact only for an *elementwise* optimizer, whose update of an
element reads that element's gradient and state alone (SGD, Adam, AdamW, ...). A *shape-aware*
optimizer reads a whole matrix for part of its update (Muon orthogonalizes it, Adafactor factors its
second moment into rows and columns and scales by the parameter's norm): on a shard it is silently
wrong or fails. So every optimizer is classified before the engine's first collective, the same way
on every rank:

- ``"elementwise"``: stepped on the even shards, as always;
- ``"shape_aware"``: stepped on whole parameters ([Note: whole-matrix step] in whole_step.py);
- anything else is refused with a ``ValueError`` naming the class and the way out:
  :func:`register_optimizer`.

A subclass inherits its base's kind only when it changes none of the base's methods (only
``__init__``, e.g. to fix defaults): an overridden ``step`` or helper may read across elements.
"""

from __future__ import annotations

import inspect
from typing import Literal, get_args

import torch
from torch.optim import Optimizer

OptimizerKind = Literal["elementwise", "shape_aware"]

_KINDS: dict[type, OptimizerKind] = {
    cls: "elementwise"
    for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adamax,
                torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adadelta, torch.optim.ASGD,
                torch.optim.Rprop)
}
_PER_PARAMETER = {torch.optim.Adafactor, *([torch.optim.Muon] if hasattr(torch.optim, "Muon") else [])}
_KINDS.update({cls: "shape_aware" for cls in _PER_PARAMETER})

_REFUSED: dict[type, str] = {
    torch.optim.LBFGS: (
        "it needs a closure that re-evaluates the model several times per step and a whole-parameter view"
        " (one flat vector of every parameter for its line search and curvature pairs), which sharded ZeRO"
        " cannot give it; it is not supported (Lightning's DeepSpeedStrategy refuses it too). Use it under"
        " plain DDP or a single device, or choose an optimizer that steps from gradients alone"
    ),
    torch.optim.SparseAdam: (
        "it takes sparse gradients, which ZeRO cannot split evenly; use dense gradients and torch.optim.Adam"
    ),
}

_ALLOWED_OVERRIDES = frozenset({"__init__", "__doc__", "__module__", "__qualname__", "__dict__", "__weakref__",
                                "__annotations__", "__firstlineno__", "__static_attributes__",
                                "__orig_bases__", "__parameters__"})


def register_optimizer(cls: type[Optimizer], kind: OptimizerKind = "elementwise") -> type[Optimizer]:
    """Declare how ZeRO may step optimizer class ``cls`` (its subclasses that override nothing follow).

    ``"elementwise"``: every element's update reads only that element's gradient and state (Lion,
    Adam variants): stepped on the flat even shards, exact. ``"shape_aware"``: the update reads whole
    parameters (norms, factored moments, orthogonalization): stepped on full-shape parameters
    ([Note: whole-matrix step] in whole_step.py); its ``step`` must skip parameters whose ``grad`` is
    None, as every ``torch.optim`` optimizer does. Returns ``cls``, so it works as a decorator through
    ``functools.partial`` or as a plain call before the engine is built (in every process)."""
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise TypeError(f"register_optimizer takes a torch.optim.Optimizer subclass, got {cls!r}.")
    if kind not in get_args(OptimizerKind):
        raise ValueError(f"kind must be one of {get_args(OptimizerKind)}, got {kind!r}.")
    if cls in _REFUSED:
        raise ValueError(f"{cls.__name__} cannot be declared {kind!r}: {_REFUSED[cls]}.")
    _KINDS[cls] = kind
    return cls


def optimizer_kind(optimizer: Optimizer, index: int = 0) -> OptimizerKind:
    """The kind of ``optimizer`` (the ``index``-th of the engine's), or a ``ValueError`` saying why not
    and what to do. Pure: the same answer on every rank."""
    return _KINDS[_known_base(optimizer, index)]


def updates_each_parameter_alone(optimizer: Optimizer) -> bool:
    """Whether a shape-aware optimizer's ``step`` updates every parameter from its own gradient and
    state only, so that stepping its parameters a group at a time (several ``step()`` calls) gives
    the same result (Muon, Adafactor). Declared optimizers are not assumed to (a step counter of
    their own would count every call)."""
    return _known_base(optimizer) in _PER_PARAMETER


def _known_base(optimizer: Optimizer, index: int = 0) -> type:
    """The registered class ``optimizer`` is, or inherits unchanged from."""
    cls = type(optimizer)
    for base in cls.__mro__:
        if base in _REFUSED:
            raise ValueError(f"Optimizer {index} ({cls.__qualname__}) cannot run under ZeRO: {_REFUSED[base]}.")
        if base not in _KINDS:
            continue
        changed = _changed_methods(cls, base)
        if changed:
            raise ValueError(
                f"Optimizer {index} ({cls.__qualname__}) subclasses {base.__qualname__} but overrides"
                f" {', '.join(changed)}, so ZeRO cannot tell whether it still updates each element on its"
                f" own. Declare it: lightning_zero.register_optimizer({cls.__qualname__}, kind='elementwise')"
                " if every element's update reads only that element's gradient and state, or kind='shape_aware'"
                " to step it on whole parameters."
            )
        return base
    raise ValueError(
        f"Optimizer {index} ({cls.__module__}.{cls.__qualname__}) is unknown to ZeRO: it steps flat shards of"
        " every parameter, which is exact only for optimizers that update each element on its own. Known:"
        f" {', '.join(sorted(c.__name__ for c, k in _KINDS.items() if k == 'elementwise'))} (elementwise),"
        f" {', '.join(sorted(c.__name__ for c, k in _KINDS.items() if k == 'shape_aware'))} (whole parameters)."
        f" Declare yours once, before the strategy sets up (in every process):"
        f" lightning_zero.register_optimizer({cls.__qualname__}, kind='elementwise') for an elementwise one"
        " (e.g. Lion), kind='shape_aware' for one that reads norms or shapes (LAMB, Shampoo)."
    )


def _changed_methods(cls: type, base: type) -> list[str]:
    """Names that classes between ``cls`` and ``base`` define beyond ``__init__``. torch patches a
    profiling wrapper of the inherited ``step`` into a subclass; that one is not a change."""
    base_step = inspect.unwrap(base.step)
    changed = []
    for klass in cls.__mro__[: cls.__mro__.index(base)]:
        for name, value in vars(klass).items():
            if name in _ALLOWED_OVERRIDES:
                continue
            if name == "step" and inspect.unwrap(value) is base_step:
                continue
            if callable(value) or isinstance(value, (staticmethod, classmethod, property)):
                changed.append(f"{klass.__qualname__}.{name}")
    return changed
