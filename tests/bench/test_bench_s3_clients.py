"""bench/s3_clients.py (in ``make bench``): s3fs and s3torchconnector against the same moto server, side by side.
A tiny run in this process, and the report's rows and ratios."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def s3_clients(bench_import: Any) -> Any:
    return bench_import("s3_clients")


def test_the_report_has_a_row_per_mode_and_client_and_their_ratios(s3_clients: Any) -> None:
    rows = {("sharded", "s3fs"): [(2.0, 1.0)], ("sharded", "s3torchconnector"): [(1.0, 1.5)]}
    text = s3_clients.report(rows, 64, 1, "cmd", "machine.")
    assert "| sharded | s3fs | 2.00 | 34 | 1.00 | 67 |" in text
    assert "| sharded | s3torchconnector | 1.00 | 67 | 1.50 | 45 |" in text
    assert "- sharded: save 0.50, load 1.50" in text
    assert "not S3" in text  # the report says what the server is


def test_the_clients_are_chosen_as_users_choose_them(s3_clients: Any) -> None:
    assert s3_clients.storage_options("s3torchconnector", "http://h:1") == {"client": "s3torchconnector",
                                                                             "endpoint_url": "http://h:1"}
    assert "client" not in s3_clients.storage_options("s3fs", "http://h:1")


@pytest.mark.s3
@pytest.mark.slow
def test_a_tiny_run_saves_and_loads_through_both_clients(s3_clients: Any, tmp_path: Path) -> None:
    pytest.importorskip("s3torchconnector")
    out = tmp_path / "s3_clients.md"
    text = s3_clients.main(["--size-mb", "1", "--repeats", "1", "--modes", "sharded", "full", "--out", str(out)])
    assert out.read_text() == text
    for mode in ("sharded", "full"):
        for client in ("s3fs", "s3torchconnector"):
            assert f"| {mode} | {client} |" in text
