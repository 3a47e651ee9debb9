"""S3 failures: a bucket that does not exist, and access refused by moto's IAM enforcement.

Access refusal is real: moto checks request signatures and IAM policies once its
auth counter is switched on (``/moto-api/reset-auth``), and the user here has no policy.
Nothing a failed save or load touches may change the checkpoint that is there.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import pytest
from fault_cases import MODES, tree

from lightning_zero.checkpoint import (
    CheckpointNotFoundError,
    CheckpointSaveError,
    async_save,
    load,
    maybe_finalize_async_calls,
    save,
)

if TYPE_CHECKING:
    from s3_server import S3  # the type of the s3 fixture (tests/conftest.py)

pytestmark = [pytest.mark.s3, pytest.mark.usefixtures("one_rank")]  # one in-process gloo rank (tests/conftest.py)


def loaded_value(url: str, storage_options: dict[str, Any]) -> float:
    target = tree(0.0)
    load(target, url, storage_options=storage_options)
    return target["w"].local.unique().item()


@pytest.mark.parametrize("mode", MODES)
def test_save_to_a_bucket_that_does_not_exist_fails_clearly(s3: S3, mode: str) -> None:
    url = f"s3://no-such-bucket-{mode}/run/last.ckpt"
    async_save(tree(1.0), url, mode=mode, storage_options=s3.storage_options)
    with pytest.raises(CheckpointSaveError, match=rf"{re.escape(url)}.*the bucket or prefix does not exist"):
        maybe_finalize_async_calls(blocking=True)
    assert "no-such-bucket" not in str(s3.client().list_buckets()["Buckets"])


@pytest.mark.parametrize("mode", MODES)
def test_load_from_a_bucket_that_does_not_exist_names_the_bucket(s3: S3, mode: str) -> None:
    target = tree(0.0)
    with pytest.raises(CheckpointNotFoundError, match=r"the bucket 'no-such-bucket' does not exist"):
        load(target, "s3://no-such-bucket/run/last.ckpt", storage_options=s3.storage_options)
    assert target["w"].local.eq(0.0).all()


@pytest.mark.parametrize("mode", MODES)
def test_refused_access_fails_clearly_and_leaves_the_checkpoint_alone(s3: S3, mode: str) -> None:
    url = s3.url(f"refused/{mode}/last.ckpt")
    save(tree(1.0), url, mode=mode, storage_options=s3.storage_options)
    before = {key: s3.read(s3.url(key)) for key in s3.keys(s3.url(f"refused/{mode}"))}
    with s3.access_denied_user() as (denied, secrets):
        async_save(tree(2.0), url, mode=mode, storage_options=denied)
        with pytest.raises(CheckpointSaveError, match=rf"{re.escape(url)}.*access was refused") as save_error:
            maybe_finalize_async_calls(blocking=True)
        target = tree(0.0)
        with pytest.raises(OSError, match=rf"Could not read checkpoint at {re.escape(repr(url))}: access was refused") \
                as load_error:
            load(target, url, storage_options=denied)
        assert target["w"].local.eq(0.0).all()
    for error in (save_error.value, load_error.value):
        assert all(secret not in str(error) for secret in secrets)
    after = {key: s3.read(s3.url(key)) for key in s3.keys(s3.url(f"refused/{mode}"))}
    assert after == before
    assert loaded_value(url, s3.storage_options) == 1.0
