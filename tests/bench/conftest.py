"""The bench scripts' tests: ``bench_import`` imports a script of bench/ as a module (its helpers tested in this
process, without running the benchmark)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="session")
def bench_import() -> Callable[[str], ModuleType]:
    """``bench_import("recovery")``: bench/recovery.py as a module (bench/ on the import path only while it loads)."""

    def load(name: str) -> ModuleType:
        sys.path.insert(0, str(BENCH))
        try:
            return importlib.import_module(name)
        finally:
            sys.path.remove(str(BENCH))

    return load
