"""FaultTolerance's settings, the extra it needs, and what the engine refuses with it (no lighthouse needed here:
tests/faults/test_fault_tolerance.py runs real replica groups)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_zero import FaultTolerance
from lightning_zero.engine.fault_tolerance import FT_EXTRA, import_torchft


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


@pytest.mark.parametrize(("case", "message"), [
    ("hybrid", "shard_group_size must be None"),
    ("full_gradients", "full_gradients=True"),
    ("two_optimizers", "has 2 optimizers; use one"),
])
def test_the_engine_refuses_what_fault_tolerance_cannot_average(case: str, message: str) -> None:
    from _dist import run_distributed

    [result, _] = run_distributed(_engine_refusal, 2, case, start_method="forkserver")
    assert message in result
