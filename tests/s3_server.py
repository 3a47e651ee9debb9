"""A local S3 for the tests: moto's server mode on 127.0.0.1, reached through a real client: s3fs (the default)
or s3torchconnector (``storage_options["client"]``), the ``s3`` fixture's two parameters.

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


CLIENTS = ("s3fs", "s3torchconnector")
"""The S3 clients every S3 test runs through (``storage_options["client"]``; s3fs is the default)."""


@dataclass(frozen=True)
class S3:
    endpoint_url: str
    bucket: str
    client_name: str = "s3fs"

    @property
    def storage_options(self) -> dict[str, Any]:
        """What users pass to ``ZeroCheckpointIO(storage_options=...)``."""
        return self.options()

    def options(self, endpoint_url: str | None = None, **s3fs_options: Any) -> dict[str, Any]:
        """Storage options for this client through ``endpoint_url`` (a proxy; default: moto itself). ``s3fs_options``
        (s3fs's cache, block size, botocore config) go to s3fs only; s3torchconnector takes the credentials from the
        environment (conftest.py exports them) and its part size is the same 5 MiB minimum."""
        endpoint_url = endpoint_url or self.endpoint_url
        if self.client_name == "s3torchconnector":
            options: dict[str, Any] = {"client": "s3torchconnector", "endpoint_url": endpoint_url}
            if "default_block_size" in s3fs_options:
                options["part_size"] = s3fs_options["default_block_size"]
            if "retries" in s3fs_options.get("config_kwargs", {}):
                options["max_attempts"] = s3fs_options["config_kwargs"]["retries"]["max_attempts"]
            return options
        return {"endpoint_url": endpoint_url, "key": ROOT_KEY, "secret": ROOT_KEY, **s3fs_options}

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
    def access_denied_user(self) -> Iterator[tuple[dict[str, Any], tuple[str, str]]]:
        """Storage options of an IAM user with no permissions, while moto enforces IAM, and its key and secret
        (in the options for s3fs; for s3torchconnector in a profile of a credentials file).

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
        if self.client_name == "s3torchconnector":  # the CRT client takes keys from a profile, not options
            import tempfile

            credentials = os.path.join(tempfile.mkdtemp(), "credentials")
            with open(credentials, "w") as f:
                f.write(f"[{name}]\naws_access_key_id = {access_key['AccessKeyId']}\n"
                        f"aws_secret_access_key = {access_key['SecretAccessKey']}\n")
            os.environ["AWS_SHARED_CREDENTIALS_FILE"] = credentials
            options = {**self.options(), "profile": name}
        else:
            options = {"endpoint_url": self.endpoint_url, "key": access_key["AccessKeyId"],
                       "secret": access_key["SecretAccessKey"]}
        requests.post(f"{self.endpoint_url}/moto-api/reset-auth", data=b"0", timeout=10).raise_for_status()
        try:
            yield options, (access_key["AccessKeyId"], access_key["SecretAccessKey"])
        finally:
            requests.post(f"{self.endpoint_url}/moto-api/reset-auth", data=b"inf", timeout=10).raise_for_status()


PORT_VARIABLE = "LIGHTNING_ZERO_TEST_S3_PORT"

ENV = {
    "AWS_ACCESS_KEY_ID": ROOT_KEY,
    "AWS_SECRET_ACCESS_KEY": ROOT_KEY,
    "AWS_DEFAULT_REGION": REGION,
}


@contextmanager
def moto_s3(bucket: str = "lightning-zero-tests", client: str = "s3fs") -> Iterator[S3]:
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
        s3 = S3(endpoint, bucket, client)
        s3.client().create_bucket(Bucket=bucket)
        yield s3
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()
