"""Shared by the fault tests: the modes and a tiny checkpoint tree."""

from __future__ import annotations

from typing import Any

import torch

from lightning_zero.checkpoint import FlatShard

MODES = ("local", "sharded", "full")


def tree(value: float) -> dict[str, Any]:
    return {"w": FlatShard(torch.full((50,), value), (50,), 0, 1), "b": torch.full((3,), value), "meta": {"n": 1}}
