"""fabric.save / fabric.load on S3 (moto's server on 127.0.0.1, through the real s3fs client): an async save
of every mode, and a resume at 2 ranks that is bit-exact against the uninterrupted run."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import pytest
import torch
from _dist import run_distributed
from fabric_cases import FabricCase, run_load_and_continue, run_save_and_continue

if TYPE_CHECKING:
    from s3_server import S3  # the type of the s3 fixture (tests/conftest.py)

pytestmark = pytest.mark.s3

CASE = FabricCase(strategy="zero2", steps=4, accumulate=2, clip_norm=0.05)


@pytest.mark.parametrize("mode", ["local", "sharded", "full"])
def test_resume_from_s3_is_bit_exact(mode: str, s3: S3) -> None:
    path = f"{s3.fresh_prefix(f'fabric-{mode}')}/step-2.ckpt"
    uninterrupted = run_distributed(run_save_and_continue, 2, CASE, mode, path, 2, True, s3.storage_options,
                                    start_method="forkserver")
    assert s3.keys(path), "nothing was written to the bucket"
    resumed = run_distributed(run_load_and_continue, 2, replace(CASE), path, s3.storage_options,
                              start_method="forkserver")
    for rank in range(2):
        assert resumed[rank]["start"] == 2
        for fqn, value in uninterrupted[rank]["params"].items():
            assert torch.equal(resumed[rank]["params"][fqn], value), f"rank {rank}: {fqn}"
