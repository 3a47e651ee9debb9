"""The moto S3 server as a module-scoped fixture. Not a conftest.py (tests/conftest.py is shared):
import it where needed with ``from conftest_s3 import s3  # noqa: F401``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from s3_server import S3, moto_s3


@pytest.fixture(scope="module")
def s3() -> Iterator[S3]:
    """moto on 127.0.0.1 with one bucket; AWS_* (endpoint included) set for this module's runs."""
    with moto_s3() as server:
        yield server
