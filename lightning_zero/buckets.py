"""Kept only for the checkpoint package's ``from lightning_zero.buckets import ShardedParam``: import
from :mod:`lightning_zero.grad_bucket` instead. The engine's buckets are split by concern into
:mod:`~lightning_zero.comm_pool`, :mod:`~lightning_zero.grad_bucket`, :mod:`~lightning_zero.grad_reducer`
and :mod:`~lightning_zero.param_gather` (ARCHITECTURE.md); delete this module once nothing imports it."""

from lightning_zero.grad_bucket import ShardedParam

__all__ = ["ShardedParam"]
