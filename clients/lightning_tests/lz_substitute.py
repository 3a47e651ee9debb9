"""A pytest plugin that runs Lightning's own tests with ``ZeroLowLevelStrategy`` in place of DDP.

Loaded with ``-p lz_substitute`` (this folder on ``PYTHONPATH``). It wraps ``lightning.pytorch.Trainer.__init__``
and replaces a DDP strategy (a registered ``ddp*`` name such as ``"ddp_spawn"`` or
``"ddp_find_unused_parameters_true"``, or an instance whose type is exactly ``DDPStrategy``) with
``ZeroLowLevelStrategy`` of the chosen stage, keeping the start method and the standard constructor arguments
of an instance (accelerator, devices, cluster environment, checkpoint IO, precision plugin, backend, timeout).
Subclasses of ``DDPStrategy`` (a test's own strategy, or ours) pass through untouched, as do DDP's own
arguments (``find_unused_parameters``, comm hooks), which ``ZeroLowLevelStrategy`` has no use for.

Environment:
  ``LZ_MODE``      ``control`` (pass everything through: the baseline), ``zero1`` or ``zero2`` (default ``zero2``).
  ``LZ_SWAP_AUTO`` ``1`` also replaces the DDP that ``strategy="auto"`` picks for more than one device.
  ``LZ_ONLY_DDP``  ``1`` deselects tests whose source and parameters never mention DDP (they cannot be affected).

Each test where a DDP strategy was seen gets a ``lz_ddp`` property in the JUnit XML (what was asked for, in
both modes), so a comparison can tell the tests the substitution touched from the rest.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
from typing import Any

import pytest

_MODE = os.environ.get("LZ_MODE", "zero2")
if _MODE not in ("control", "zero1", "zero2"):
    raise ValueError(f"LZ_MODE must be 'control', 'zero1' or 'zero2', got {_MODE!r}.")
_SWAP_AUTO = os.environ.get("LZ_SWAP_AUTO", "0") == "1"
_ONLY_DDP = os.environ.get("LZ_ONLY_DDP", "0") == "1"

_current_item: pytest.Item | None = None
_DDP_WORD = re.compile(r"ddp|DDPStrategy|DistributedDataParallel", re.IGNORECASE)


def _ddp_start_method(strategy: Any) -> str | None:
    """The start method of a DDP strategy to replace, or None when ``strategy`` is not one."""
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

    if isinstance(strategy, str):
        # dict.get, not the registry's own get(), which builds the strategy.
        entry = dict.get(StrategyRegistry, strategy.lower())
        if entry is None or entry["strategy"] is not DDPStrategy:
            return None
        return entry["init_params"].get("start_method", "popen")
    if type(strategy) is DDPStrategy:
        return strategy._start_method
    return None


def _zero_strategy(strategy: Any, start_method: str) -> Any:
    from lightning_zero import ZeroLowLevelStrategy

    stage = 1 if _MODE == "zero1" else 2
    if isinstance(strategy, str):
        return ZeroLowLevelStrategy(stage=stage, start_method=start_method)
    return ZeroLowLevelStrategy(
        stage=stage,
        accelerator=strategy._accelerator,
        parallel_devices=strategy.parallel_devices,
        cluster_environment=strategy.cluster_environment,
        checkpoint_io=strategy._checkpoint_io,
        precision_plugin=strategy._precision_plugin,
        process_group_backend=strategy._process_group_backend,
        timeout=strategy._timeout,
        start_method=start_method,
    )


def _note(what: str) -> None:
    if _current_item is not None:
        _current_item.user_properties.append(("lz_ddp", what))


def _wrap_trainer_init() -> None:
    from lightning.pytorch import Trainer

    original = Trainer.__init__
    if getattr(original, "_lz_wrapped", False):
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        # Trainer's arguments are keyword-only after `self`, so `strategy` is always a keyword.
        strategy = kwargs.get("strategy", "auto")
        start_method = _ddp_start_method(strategy)
        if start_method is not None:
            _note(strategy if isinstance(strategy, str) else f"DDPStrategy(start_method={start_method!r})")
            if _MODE != "control":
                kwargs["strategy"] = _zero_strategy(strategy, start_method)
        original(self, *args, **kwargs)

    __init__._lz_wrapped = True  # type: ignore[attr-defined]
    Trainer.__init__ = __init__  # type: ignore[method-assign]


def _wrap_auto_choice() -> None:
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    original = _AcceleratorConnector._choose_strategy

    @functools.wraps(original)
    def _choose_strategy(self: Any) -> Any:
        choice = original(self)
        start_method = _ddp_start_method(choice)
        if start_method is not None:
            _note(f"auto->{choice}")
            if _MODE != "control":
                return _zero_strategy(choice, start_method)
        return choice

    _AcceleratorConnector._choose_strategy = _choose_strategy  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    _wrap_trainer_init()
    if _SWAP_AUTO:
        _wrap_auto_choice()


def pytest_report_header(config: pytest.Config) -> str:
    return f"lz_substitute: mode={_MODE} swap_auto={_SWAP_AUTO} only_ddp={_ONLY_DDP}"


def _mentions_ddp(item: pytest.Item) -> bool:
    if _DDP_WORD.search(item.nodeid):
        return True
    function = getattr(item, "function", None)
    try:
        source = inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        source = ""
    if _DDP_WORD.search(source):
        return True
    callspec = getattr(item, "callspec", None)
    return callspec is not None and any(_DDP_WORD.search(repr(v)) for v in callspec.params.values())


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _ONLY_DDP:
        return
    kept = [item for item in items if _mentions_ddp(item)]
    dropped = [item for item in items if not _mentions_ddp(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    global _current_item
    _current_item = item


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    global _current_item
    _current_item = None
