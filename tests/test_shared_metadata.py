"""A ``sharded`` checkpoint's ``.metadata`` (every rank's items: ~110 MB at 1024 ranks) is read by one
rank per load and broadcast ([Note: shared metadata] in saver.py), in the functional ``load`` and in
the Trainer's resume, whose key check used to read it a second time; a failed read fails every rank."""

from __future__ import annotations

from typing import Any

import pytest
from _dist import run_distributed
from checkpoint_cases import assert_same_state, metadata_reads


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(metadata_reads, 2, str(tmp_path_factory.mktemp("shared_metadata")),
                           start_method="forkserver")


@pytest.mark.parametrize("kind", ["load", "resume"])
def test_only_the_coordinator_reads_the_metadata(results: list[dict[str, Any]], kind: str) -> None:
    assert [result[kind]["reads"] for result in results] == [1, 0]


@pytest.mark.parametrize("kind", ["load", "resume"])
def test_the_shared_metadata_loads_the_saved_state(results: list[dict[str, Any]], kind: str) -> None:
    for rank, result in enumerate(results):
        assert_same_state(result[kind]["loaded"], results[0]["saved"], f"{kind}, rank {rank}")


def test_metadata_the_coordinator_cannot_read_fails_every_rank_and_loads_nothing(
        results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        error = result["missing"]["error"]
        assert error is not None and "CheckpointCorruptError" in error, (rank, error)
        assert "is committed but its DCP metadata is missing" in error, (rank, error)
        assert result["missing"]["untouched"], rank
