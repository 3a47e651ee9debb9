"""FaultTolerance's settings, the extra it needs, and what the engine refuses with it (no lighthouse needed here:
tests/faults/test_fault_tolerance.py runs real replica groups)."""

from __future__ import annotations

import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from lightning_zero import FaultTolerance
from lightning_zero.engine.fault_tolerance import FT_EXTRA, ReplicaGroups, import_torchft


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"replica_group_id": -1}, "replica_group_id must be an int >= 0"),
    ({"replica_group_id": "0"}, "replica_group_id must be an int >= 0"),
    ({"replica_group_id": 0, "min_replica_groups": 0}, "min_replica_groups must be at least 1"),
    ({"replica_group_id": 0, "timeout_s": 0}, "timeout_s and quorum_timeout_s must be positive"),
])
def test_bad_settings_are_refused_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FaultTolerance(**kwargs)


def test_the_lighthouse_comes_from_the_argument_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match=r"lighthouse='http://HOST:PORT' or set \$TORCHFT_LIGHTHOUSE.*torchft_lighthouse"):
        FaultTolerance(0).lighthouse_address()
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://10.0.0.1:29510")
    assert FaultTolerance(0).lighthouse_address() == "http://10.0.0.1:29510"
    assert FaultTolerance(0, lighthouse="http://h:1").lighthouse_address() == "http://h:1"


def test_without_torchft_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchft", None)  # as if not installed
    with pytest.raises(ImportError, match=r"Fault tolerance needs torchft.*" + FT_EXTRA.replace("[", r"\[").replace("]", r"\]")):
        import_torchft()


def test_fault_tolerance_off_imports_nothing_of_torchft() -> None:
    """The default strategy, a fit's setup included, never imports torchft."""
    code = ("import sys, lightning_zero; from lightning_zero import ZeroLowLevelStrategy;"
            " ZeroLowLevelStrategy(stage=2); print('torchft' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_reports_start_empty_and_the_settings_print() -> None:
    ft = FaultTolerance(3, lighthouse="http://h:1", min_replica_groups=2, timeout_s=4)
    assert (ft.committed, ft.participants, ft.heals, ft.discarded, ft.steps) == (False, 0, 0, 0, 0)
    assert ft.last_heal_s is None and ft.last_stall_s is None and ft.quorum_timeout_s == 60.0
    assert repr(ft) == "FaultTolerance(replica_group_id=3, lighthouse='http://h:1', min_replica_groups=2, timeout_s=4.0)"


class _NoGroups:
    """Stands in for a ReplicaGroups: the engine's checks run before it is used."""

    def bind(self, buckets: object) -> None:
        pass


def _engine_refusal(rank: int, world_size: int, case: str) -> str:
    import torch

    from lightning_zero.engine import ZeroConfig, ZeroEngine

    model = torch.nn.Linear(4, 4)
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1)]
    config = ZeroConfig(stage=2)
    if case == "hybrid":
        config = ZeroConfig(stage=2, shard_group_size=1)
    elif case == "full_gradients":
        config = ZeroConfig(stage=1, full_gradients=True)
    elif case == "two_optimizers":
        first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        model = torch.nn.Sequential(first, second)
        optimizers = [torch.optim.SGD(first.parameters(), lr=0.1), torch.optim.SGD(second.parameters(), lr=0.1)]
    try:
        ZeroEngine(model, optimizers, config, replica_groups=_NoGroups())  # type: ignore[arg-type]
    except ValueError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.parametrize(("settings", "message"), [
    ({"val_check_interval": 0.25}, "Trainer(val_check_interval=0.25) is a fraction"),
    ({"limit_train_batches": 0.5}, "Trainer(limit_train_batches=0.5) is a fraction"),
    ({"limit_train_batches": 0.01, "overfit_batches": 0.01}, "Trainer(overfit_batches=0.01) is a fraction"),
    ({"automatic_optimization": False}, "turn fault_tolerance off"),
])
def test_settings_without_a_meaning_across_groups_are_refused_before_joining(settings: dict, message: str) -> None:
    from lightning_zero.trainer_fault_tolerance import TrainerReplicaGroups

    settings = {"val_check_interval": 1.0, "limit_train_batches": 1.0, "overfit_batches": 0.0,
                "automatic_optimization": True, **settings}
    module = SimpleNamespace(automatic_optimization=settings.pop("automatic_optimization"))
    trainer = SimpleNamespace(lightning_module=module, **settings)
    # The lighthouse is never reached: the refusal comes first.
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainerReplicaGroups(FaultTolerance(0, lighthouse="http://127.0.0.1:9"), trainer, 0, 1, torch.device("cpu"))


@pytest.mark.parametrize(("case", "message"), [
    ("hybrid", "shard_group_size must be None"),
    ("full_gradients", "full_gradients=True"),
    ("two_optimizers", "has 2 optimizers; use one"),
])
def test_the_engine_refuses_what_fault_tolerance_cannot_average(case: str, message: str) -> None:
    from _dist import run_distributed

    [result, _] = run_distributed(_engine_refusal, 2, case, start_method="forkserver")
    assert message in result


class FakeWork:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def wait(self, timeout: object = None) -> bool:
        if self.fail:
            raise RuntimeError("Connection closed by peer")
        return True


class FakeProcessGroup:
    """torchft's process group as the cross-group hop sees it: sums by 2 (two groups alike) unless told to fail."""

    def __init__(self) -> None:
        self.sums: list[int] = []
        self.fail = False

    def allreduce(self, tensors: list[torch.Tensor], options: object) -> FakeWork:
        self.sums.append(tensors[0].numel())
        tensors[0].mul_(2)
        return FakeWork(self.fail)


class FakeManager:
    """torchft's Manager at a given step of a 2-group quorum, this group participating."""

    def __init__(self, step: int) -> None:
        self.step, self.errors = step, []

    def current_step(self) -> int:
        return self.step

    def num_participants(self) -> int:
        return 2

    def is_participating(self) -> bool:
        return True

    def errored(self) -> object:
        return self.errors[-1] if self.errors else None

    def report_error(self, exc: Exception) -> None:
        self.errors.append(exc)

    def start_quorum(self) -> None:
        pass

    def wait_quorum(self) -> None:
        pass


def replica_groups_at(step: int) -> tuple[ReplicaGroups, FakeProcessGroup, FakeManager]:
    """A ReplicaGroups of 2 ranks per group over the fakes above (its torchft parts replaced, nothing started)."""
    groups = object.__new__(ReplicaGroups)
    groups.config, groups.group_size = FaultTolerance(0, timeout_s=1), 2
    groups.manager, groups._pg = FakeManager(step), FakeProcessGroup()
    groups._device, groups._buckets = torch.device("cpu"), ()
    groups._started_at, groups._reducing, groups._factor, groups._contributors_work = None, False, None, None
    return groups, groups._pg, groups.manager


@pytest.mark.parametrize(("step", "contributors_sums"), [(0, 1), (7, 0)])
def test_the_contributors_are_counted_only_at_the_quorums_first_step_and_once_a_step(
        step: int, contributors_sums: int) -> None:
    """[Note: contributors]: only the weight sync of step 0 can count a healing group among the participants."""
    groups, pg, _ = replica_groups_at(step)
    groups.before_reduction()
    groups.before_reduction()  # the backward's end calls it again: nothing more is launched
    assert pg.sums == [1] * contributors_sums
    row = torch.ones(3)
    assert groups.all_reduce(row).wait()
    # Two groups contributed, two participate: the sum is the sum, rescaled by 1 (or not at all).
    assert torch.equal(row, torch.full((3,), 2.0))
    assert pg.sums == [1] * contributors_sums + [3]


def test_a_failed_cross_group_sum_is_reported_and_nothing_follows_in_that_step() -> None:
    groups, pg, manager = replica_groups_at(7)
    groups.before_reduction()
    pg.fail = True
    assert groups.all_reduce(torch.ones(3)).wait()  # swallowed: the commit discards the step
    assert len(manager.errors) == 1 and "Connection closed" in str(manager.errors[0])
    pg.fail = False
    untouched = torch.ones(3)
    groups.all_reduce(untouched).wait()  # the step has failed: no collective, as torchft's Manager.allreduce
    assert pg.sums == [3] and torch.equal(untouched, torch.ones(3))
