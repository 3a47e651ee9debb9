"""Shared fixtures: an in-process one-rank gloo group, and a hypothesis profile for slow CPUs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, settings

from _dist import free_port

settings.register_profile("lightning_zero", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("lightning_zero")


@pytest.fixture
def single_rank_group() -> Iterator[None]:
    """A world of one gloo rank in this process, destroyed afterwards so later tests start clean."""
    assert not dist.is_initialized(), "a previous test leaked a process group"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
