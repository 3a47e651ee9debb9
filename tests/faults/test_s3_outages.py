"""S3 that throttles, errs or goes away, through a real proxy in front of moto (s3_proxy.py).

Transient 5xx / ``SlowDown`` answers are retried with backoff and the save succeeds. A server
that goes away in the middle of a multipart upload fails the save at the next finalize, within a
bounded time, with nothing committed and the previous checkpoint intact.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

import pytest
import torch
from s3_proxy import faulty_proxy

from lightning_zero.checkpoint import (
    CheckpointSaveError,
    FlatShard,
    async_save,
    load,
    maybe_finalize_async_calls,
    save,
)
from lightning_zero.checkpoint.store.s3torch import FROZEN_ATTEMPT_S

if TYPE_CHECKING:
    from s3_server import S3  # the type of the s3 fixture (tests/conftest.py)

pytestmark = [pytest.mark.s3, pytest.mark.usefixtures("one_rank")]  # one in-process gloo rank (tests/conftest.py)

MODES = ("local", "sharded", "full")


def tree(value: float, numel: int = 1000) -> dict[str, Any]:
    return {"w": FlatShard(torch.full((numel,), value), (numel,), 0, 1), "b": torch.full((3,), value),
            "meta": {"n": 1}}


def loaded_value(url: str, storage_options: dict[str, Any], numel: int = 1000) -> float:
    target = tree(0.0, numel)
    load(target, url, storage_options=storage_options)
    return target["w"].local.unique().item()


def through(proxy_url: str, s3: S3, **config: Any) -> dict[str, Any]:
    # 5 MiB blocks (S3's smallest part): BIG goes up as a multipart upload of 3 parts.
    return s3.options(proxy_url, skip_instance_cache=True, default_block_size=5 * 2**20,
                      **({"config_kwargs": config} if config else {}))


@pytest.mark.parametrize("mode", MODES)
def test_transient_5xx_and_throttling_are_retried_and_the_save_succeeds(s3: S3, mode: str) -> None:
    url = s3.fresh_prefix(f"throttled-{mode}") + "/last.ckpt"
    with faulty_proxy(s3.endpoint_url) as proxy:
        proxy.fail_next(503, 500, 503)
        save(tree(1.0), url, mode=mode, storage_options=through(proxy.endpoint_url, s3))
        assert proxy.failed == 3 and proxy.forwarded > 0
    assert loaded_value(url, s3.storage_options) == 1.0


BIG = 3 * 2**20  # 12 MiB of float32


def upload_part_2(method: str, path: str) -> bool:
    return method == "PUT" and "partNumber=2" in path


@pytest.mark.parametrize("how", ["refuse", pytest.param("freeze", marks=pytest.mark.slow)])  # freeze: 7-20 s (CRT: 95)
@pytest.mark.parametrize("mode", MODES)
def test_a_server_gone_mid_upload_fails_the_save_in_bounded_time_and_keeps_the_previous(
        s3: S3, mode: str, how: str) -> None:
    url = s3.fresh_prefix(f"gone-{mode}-{how}") + "/last.ckpt"
    save(tree(1.0), url, mode=mode, storage_options=s3.storage_options)
    before = {key: s3.read(s3.url(key)) for key in s3.keys(url.rsplit("/", 1)[0])}
    with faulty_proxy(s3.endpoint_url) as proxy:
        proxy.go_away_at(upload_part_2, how)
        options = through(proxy.endpoint_url, s3, connect_timeout=1, read_timeout=1,
                          retries={"max_attempts": 2, "mode": "standard"})
        async_save(tree(2.0, BIG), url, mode=mode, storage_options=options)
        start = time.perf_counter()
        with pytest.raises(CheckpointSaveError, match=rf"{re.escape(url)}.*failed"):
            maybe_finalize_async_calls(blocking=True)
        seconds = time.perf_counter() - start
        assert proxy.gone == how, f"the upload never reached part 2: {proxy.requests}"
    # s3fs's read timeout is 1 s here; the CRT client has no such option: about FROZEN_ATTEMPT_S per attempt (2).
    bound = 45 if s3.client_name == "s3fs" else 2 * FROZEN_ATTEMPT_S + 15
    assert seconds < bound, f"the failed save took {seconds:.0f} s to report"
    after = {key: s3.read(s3.url(key)) for key in s3.keys(url.rsplit("/", 1)[0])}
    committed = {k: v for k, v in after.items() if "/_zero_data/" not in k or k in before}
    assert committed == before, "the failed save changed the committed checkpoint"
    assert loaded_value(url, s3.storage_options) == 1.0
