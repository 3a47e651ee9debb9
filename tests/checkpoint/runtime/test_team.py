"""The team (checkpoint/runtime/team.py): which ranks a save or load runs over and who coordinates it,
checked the same way on every rank before any collective; and its exchanges, which check on every rank
and then agree: a failure on one rank is raised on all of them, a read on the coordinator reaches all.

The checks run on one in-process rank; the exchanges on 2 gloo ranks (one run, shared by the tests)."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist
from _dist import run_distributed

from lightning_zero.checkpoint import CheckpointCorruptError
from lightning_zero.checkpoint.runtime.team import checked_on_every_rank, from_coordinator, make_team
from lightning_zero.checkpoint.store import storage


def test_the_default_team_is_every_rank_coordinated_by_rank_0(single_rank_group: None) -> None:
    team = make_team()
    assert (team.rank, team.world_size, team.coordinator, team.coordinator_global) == (0, 1, 0, 0)
    assert team.default and team.is_coordinator and team.global_ranks == (0,)


def test_a_coordinator_outside_the_world_is_refused(single_rank_group: None) -> None:
    with pytest.raises(ValueError, match=r"coordinator_rank=1 is not a rank of the world \(size 1\)"):
        make_team(coordinator_rank=1)


def test_a_coordinator_outside_the_process_group_is_refused(single_rank_group: None) -> None:
    group = dist.new_group([0], backend="gloo")
    with pytest.raises(ValueError, match=r"coordinator_rank=1 is not in process_group \(ranks \[0\]\)"):
        make_team(group, coordinator_rank=1)
    team = make_team(group)  # without coordinator_rank: the group's lowest rank
    assert team.group is group and team.coordinator_global == 0 and team.is_coordinator


def _outcome(call: Any) -> tuple[str, Any, list[str]]:
    try:
        return "ok", call(), []
    except Exception as exc:
        return type(exc).__name__, str(exc), list(getattr(exc, "__notes__", []))


def exchanges(rank: int, world_size: int) -> dict[str, Any]:
    """(gloo worker) Each exchange of the team, and what this rank got from it."""
    loc = storage.resolve("/runs/step-2.ckpt")
    reads: list[int] = []

    def fails_on_rank_1() -> str:
        if rank == 1:
            raise OSError("rank 1 cannot read its file")
        return "read"

    def read_on_coordinator() -> dict[str, int]:
        reads.append(rank)
        return {"items": 3}

    def coordinator_fails() -> None:
        raise FileNotFoundError("no .metadata")

    team = make_team()
    return {
        "one_rank_fails": _outcome(lambda: checked_on_every_rank(fails_on_rank_1, loc)),
        "none_fails": _outcome(lambda: checked_on_every_rank(lambda: f"rank {rank}", loc)),
        "coordinator_reads": _outcome(lambda: from_coordinator(read_on_coordinator, team, "the marker")),
        "reads": reads,
        "coordinator_fails": _outcome(lambda: from_coordinator(coordinator_fails, team, ".metadata")),
    }


@pytest.fixture(scope="module")
def on_two_ranks() -> list[dict[str, Any]]:
    return run_distributed(exchanges, 2, start_method="forkserver")


def test_a_check_that_fails_on_one_rank_fails_on_every_rank_naming_it(
        on_two_ranks: list[dict[str, Any]]) -> None:
    first, second = (result["one_rank_fails"] for result in on_two_ranks)
    assert first[0] == CheckpointCorruptError.__name__
    assert "'/runs/step-2.ckpt' failed on another rank" in first[1]
    assert "rank 1: OSError: rank 1 cannot read its file" in first[1]
    assert second[:2] == ("OSError", "rank 1 cannot read its file")  # the failing rank raises its own error


def test_checks_that_pass_everywhere_give_each_rank_its_own_result(
        on_two_ranks: list[dict[str, Any]]) -> None:
    assert [result["none_fails"] for result in on_two_ranks] == [("ok", "rank 0", []), ("ok", "rank 1", [])]


def test_a_read_runs_on_the_coordinator_only_and_reaches_every_rank(
        on_two_ranks: list[dict[str, Any]]) -> None:
    assert [result["coordinator_reads"] for result in on_two_ranks] == [("ok", {"items": 3}, [])] * 2
    assert [result["reads"] for result in on_two_ranks] == [[0], []]


def test_a_read_that_fails_on_the_coordinator_fails_every_rank_with_its_error(
        on_two_ranks: list[dict[str, Any]]) -> None:
    coordinator, other = (result["coordinator_fails"] for result in on_two_ranks)
    assert coordinator[:2] == other[:2] == ("FileNotFoundError", "no .metadata")
    assert other[2] == ["rank 0 read .metadata for every rank ([Note: shared metadata])."]
