"""A ``sharded`` checkpoint's ``.metadata`` (every rank's items: ~110 MB at 1024 ranks) is read by one
rank per load and broadcast ([Note: shared metadata] in opening.py), in the functional ``load`` and in
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


def test_a_load_finalizes_a_save_still_in_flight_first(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        assert_same_state(result["in_flight"]["loaded"], results[0]["saved"], f"the load, rank {rank}")
        assert_same_state(result["in_flight"]["loaded_later"], result["in_flight"]["saved"],
                          f"the save that was in flight, rank {rank}")


def test_a_coordinator_that_cannot_read_the_metadata_fails_every_rank_with_its_error(
        results: list[dict[str, Any]]) -> None:
    errors = [result["unreadable_on_0"] for result in results]
    assert [e["opens"] for e in errors] == [1, 0]  # rank 1 fails without touching the file
    for rank, error in enumerate(errors):
        assert error["error"] is not None and error["error"].startswith("OSError: Could not read checkpoint"), error
        assert "Input/output error" in error["error"], error
        assert error["untouched"], rank
    assert errors[1]["error"] == errors[0]["error"]
    assert any("rank 0 read this checkpoint's commit marker and .metadata for every rank" in note
               for note in errors[1]["notes"])


def test_a_rank_that_cannot_read_the_metadata_still_loads_it_from_the_coordinator(
        results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        loaded = result["unreadable_on_1"]
        assert loaded["error"] is None, loaded["error"]
        assert_same_state(loaded["loaded"], results[0]["saved"], f"rank {rank}")
    assert [result["unreadable_on_1"]["opens"] for result in results] == [1, 0]


@pytest.mark.parametrize("mode", ["sharded", "local"])
def test_a_resume_and_a_validate_read_the_commit_marker_once_on_the_coordinator_only(tmp_path: Any,
                                                                                     mode: str) -> None:
    """Through the Trainer, each in a fresh Trainer: the checkpoint is opened once per load, and its
    coordinator's read of the marker is broadcast with ``.metadata`` (it was read 3 to 4 times per rank)."""
    from contract_cases import marker_reads

    results = run_distributed(marker_reads, 2, str(tmp_path), mode, start_method="forkserver")
    assert [r["resumed_step"] for r in results] == [3, 3]
    assert [r["resume"] for r in results] == [1, 0], results
    assert [r["validate"] for r in results] == [1, 0], results
