"""A local S3 for the tests: moto's server mode on 127.0.0.1, reached through the real s3fs client.

No test touches the internet. The server runs in a thread of the pytest process and keeps its
buckets in memory; every process that knows the endpoint (gloo ranks, spawned Trainer workers)
reaches it.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import boto3
import requests
from _dist import free_port
from moto.server import ThreadedMotoServer

logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

ROOT_KEY = "testing"
REGION = "us-east-1"


@dataclass(frozen=True)
class S3:
    endpoint_url: str
    bucket: str

    @property
    def storage_options(self) -> dict[str, Any]:
        """What users pass to ``ZeroCheckpointIO(storage_options=...)``."""
        return {"endpoint_url": self.endpoint_url, "key": ROOT_KEY, "secret": ROOT_KEY}

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", *parts])

    def fresh_prefix(self, name: str) -> str:
        """A prefix no other test writes to."""
        return self.url(f"{name}-{uuid.uuid4().hex[:8]}")

    def client(self, key: str = ROOT_KEY, secret: str = ROOT_KEY) -> Any:
        return boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id=key,
                            aws_secret_access_key=secret, region_name=REGION)

    def keys(self, prefix: str) -> list[str]:
        """Object keys under ``s3://bucket/prefix`` as the server has them (no client-side cache)."""
        prefix = prefix.removeprefix(f"s3://{self.bucket}/")
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))

    def read(self, url: str) -> bytes:
        key = url.removeprefix(f"s3://{self.bucket}/")
        return self.client().get_object(Bucket=self.bucket, Key=key)["Body"].read()

    @contextmanager
    def access_denied_user(self) -> Iterator[dict[str, Any]]:
        """Storage options of an IAM user with no permissions, while moto enforces IAM.

        moto checks signatures and IAM policies once its request counter passes
        ``INITIAL_NO_AUTH_ACTION_COUNT``; ``/moto-api/reset-auth`` sets that number on the
        running server. The user is created first (unauthenticated), then enforcement starts
        with zero free requests, and is switched off again afterwards.
        """
        iam = boto3.client("iam", endpoint_url=self.endpoint_url, aws_access_key_id=ROOT_KEY,
                           aws_secret_access_key=ROOT_KEY, region_name=REGION)
        name = f"denied-{uuid.uuid4().hex[:8]}"
        iam.create_user(UserName=name)
        access_key = iam.create_access_key(UserName=name)["AccessKey"]
        requests.post(f"{self.endpoint_url}/moto-api/reset-auth", data=b"0", timeout=10).raise_for_status()
        try:
            yield {"endpoint_url": self.endpoint_url, "key": access_key["AccessKeyId"],
                   "secret": access_key["SecretAccessKey"]}
        finally:
            requests.post(f"{self.endpoint_url}/moto-api/reset-auth", data=b"inf", timeout=10).raise_for_status()


PORT_VARIABLE = "LIGHTNING_ZERO_TEST_S3_PORT"

ENV = {
    "AWS_ACCESS_KEY_ID": ROOT_KEY,
    "AWS_SECRET_ACCESS_KEY": ROOT_KEY,
    "AWS_DEFAULT_REGION": REGION,
}


@contextmanager
def moto_s3(bucket: str = "lightning-zero-tests") -> Iterator[S3]:
    """Start moto on a free port of 127.0.0.1 with one bucket, and point the AWS environment at it.

    The environment matters for code that builds its own s3fs filesystem without our
    ``storage_options``: Lightning's ``ModelCheckpoint`` and its ``ckpt_path="last"`` lookup.
    Processes started with ``spawn`` after this inherit it (a fork server started earlier does not).
    """
    # conftest.py picks the port and exports the endpoint before any fork server starts, so that
    # Trainer workers forked from it reach moto too.
    port = int(os.environ.get(PORT_VARIABLE) or free_port())
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in [*ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update(ENV, AWS_ENDPOINT_URL=endpoint)
    try:
        s3 = S3(endpoint, bucket)
        s3.client().create_bucket(Bucket=bucket)
        yield s3
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()
