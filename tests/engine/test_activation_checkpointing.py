"""Activation checkpointing (``torch.utils.checkpoint``, reentrant and not) under zero1 and zero2 through the
Trainer, 2 CPU processes: the weights of ddp with the same checkpointing, and of ddp without it, bit for bit.

The reentrant variant runs the checkpointed layer's backward inside its own ``torch.autograd.backward``
call, so the engine's gradient hooks for that layer fire there; a hook that did not fire, or a reduction
that waited for one, would leave a gradient out (different weights) or hang (the collective timeout of
tests/_dist.py fails the test instead). Bit for bit for the reasons in tests/engine/test_compile.py: two ranks add
the same two numbers, AdamW is elementwise, and recomputing a layer gives the same activations.
"""

from __future__ import annotations

import functools
import tempfile
from typing import Any

import pytest
import torch
from _dist import run_distributed
from compile_cases import fit

pytestmark = pytest.mark.slow  # 2 processes per fit on shared cores

STEPS = 4


@functools.cache
def fitted(strategy: str, reentrant: bool | None) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as root:
        return run_distributed(fit, 2, strategy, root, STEPS, None, reentrant, start_method="forkserver")


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_checkpointed_layers_reach_ddps_weights_bit_for_bit(strategy: str, reentrant: bool) -> None:
    for rank in range(2):
        got = fitted(strategy, reentrant)[rank]["params"]
        for reference in (fitted("ddp", reentrant), fitted("ddp", None)):
            expected = reference[rank]["params"]
            assert got.keys() == expected.keys()
            for name, value in expected.items():
                assert torch.equal(got[name], value), \
                    f"{strategy} use_reentrant={reentrant} rank {rank}: {name} differs by {(got[name] - value).abs().max()}"
