"""``pip install .`` as a user runs it, from a copy of the sources: it leaves the source tree as it was
(no ``build/``, no ``*.egg-info`` that a second install could pick stale files from) and installs every
file of the package, ``py.typed`` included, and the ``lightning-zero`` command. pip builds the wheel with
the build backend pyproject.toml names, fetched from the package index into an isolated environment."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]


def package_files(root: Path) -> set[str]:
    """The package's source files under ``root`` as paths from it, without caches."""
    return {path.relative_to(root).as_posix() for path in (root / "lightning_zero").rglob("*")
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"}


def test_pip_install_dot_writes_nothing_into_the_sources_and_installs_the_whole_package(tmp_path: Path) -> None:
    sources = tmp_path / "sources"
    sources.mkdir()
    shutil.copytree(REPO / "lightning_zero", sources / "lightning_zero",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, sources / name)
    before = sorted(path.relative_to(sources).as_posix() for path in sources.rglob("*"))
    target = tmp_path / "installed"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), "."],
                          cwd=sources, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    assert sorted(path.relative_to(sources).as_posix() for path in sources.rglob("*")) == before
    assert not (sources / "build").exists() and not list(sources.glob("*.egg-info"))
    assert package_files(target) == package_files(sources)
    assert "lightning_zero/py.typed" in package_files(target)
    [dist_info] = target.glob("lightning_zero-*.dist-info")
    entry_points = (dist_info / "entry_points.txt").read_text()
    assert "[console_scripts]" in entry_points and "lightning-zero = lightning_zero.cli:main" in entry_points
    assert (target / "bin" / "lightning-zero").is_file()
