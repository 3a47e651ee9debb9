"""Fault tests' setup: one in-process gloo rank, every save finalized after the test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lightning_zero.checkpoint import maybe_finalize_async_calls


@pytest.fixture
def one_rank(single_rank_group: None) -> Iterator[None]:
    """sharded mode saves through DCP, which needs a process group."""
    yield
    maybe_finalize_async_calls(blocking=True)
