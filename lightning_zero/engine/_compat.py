"""The private torch APIs the engine uses, each behind one function that names it and the torch versions
it was tested with, so a torch upgrade that moves one breaks here and nowhere else. torch only: the engine
is usable without Lightning (``lightning_zero/_compat.py`` holds the Lightning side's).

Internals used in place, stable for many releases and tested all the same (``tests/test_compat.py``):
``Tensor._version`` (grad_bucket.py, zero_engine.py: a parameter replaced in place), ``Module._parameters``
(zero_engine.py), ``torch.autograd.Variable._execution_engine.queue_callback`` (grad_reducer.py: the end of
backward), ``torch._foreach_mul_`` / ``_foreach_clamp_min_`` / ``_foreach_clamp_max_`` (optimizer.py: clipping).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch


def device_types(group: Any) -> list[str]:
    """``torch.distributed.distributed_c10d._device_capability(group)``: the device types the group's
    backends serve, e.g. ``["cpu"]`` for gloo (torch 2.6 and later)."""
    import torch.distributed as dist

    return list(dist.distributed_c10d._device_capability(group))


def process_group_timeout(device: str) -> timedelta:
    """The default group's timeout for its ``device`` backend: ``ProcessGroup._get_backend(device)
    .options._timeout`` (torch 2.13 and 2.14 tested). Raises when the group has no backend for ``device``."""
    import torch.distributed as dist

    return dist.group.WORLD._get_backend(torch.device(device)).options._timeout  # type: ignore[union-attr]


def run_at_trace_time(function: Any) -> None:
    """``torch._dynamo.comptime.comptime(function)``: while ``torch.compile`` traces the calling code,
    ``function(ctx)`` runs once, at trace time, and nothing of it enters the graph or its guards; called
    eagerly, nothing runs (torch 2.0 and later; torch 2.13 and 2.14 tested). ``function`` must have no
    free variables (dynamo refuses closures): a module-level function. Call it only while compiling
    (``torch.compiler.is_compiling()``), when ``torch._dynamo`` is imported; no import here, since dynamo
    would have to trace one."""
    torch._dynamo.comptime.comptime(function)


def is_compiled_function(function: Any) -> bool:
    """Whether ``function`` is what ``torch.compile(fn)`` returned: dynamo's wrapper carries the original
    as ``_torchdynamo_orig_callable`` (torch 2.0 and later; torch 2.13 and 2.14 tested)."""
    return hasattr(function, "_torchdynamo_orig_callable")
