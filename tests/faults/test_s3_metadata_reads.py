"""On S3, a ``sharded`` load at 2 ranks fetches ``.metadata`` from the bucket once: rank 0 reads it
for every rank ([Note: shared metadata]). Counted by a proxy in front of moto (s3_proxy.py) that
sees every request the ranks make."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from _dist import run_distributed
from checkpoint_cases import assert_same_state, load_with_options, save_and_gather
from s3_proxy import faulty_proxy

if TYPE_CHECKING:
    from s3_server import S3  # the type of the s3 fixture (tests/conftest.py)

pytestmark = pytest.mark.s3


def test_a_sharded_load_at_two_ranks_gets_the_metadata_from_the_bucket_once(s3: S3) -> None:
    root = s3.fresh_prefix("shared-metadata")
    saved = run_distributed(save_and_gather, 2, root, ("sharded",), start_method="forkserver")[0]
    with faulty_proxy(s3.endpoint_url) as proxy:
        options = s3.options(proxy.endpoint_url, skip_instance_cache=True)
        loaded = run_distributed(load_with_options, 2, f"{root}/sharded.ckpt", sorted(saved["state"]), options,
                                 start_method="forkserver")
        requests = list(proxy.requests)
    for rank, state in enumerate(loaded):
        assert_same_state(state, saved, f"rank {rank}")
    metadata_gets = [r for r in requests if r.startswith("GET ") and r.split("?")[0].endswith("/.metadata")]
    assert len(metadata_gets) == 1, requests
    assert any(r.startswith("GET ") and ".distcp" in r for r in requests), requests  # the proxy saw the data reads
