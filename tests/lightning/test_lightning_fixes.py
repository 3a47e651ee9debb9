"""The work-arounds of ``lightning_zero/_lightning_fixes.py`` leave Lightning's own behaviour alone elsewhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities import cloud_io
from lightning.pytorch.core import saving

import lightning_zero  # noqa: F401  (installs the checkpoint reader)
from lightning_zero._lightning_fixes import install_checkpoint_reader


class _Opaque:
    """A pickled class: a ``weights_only=True`` load refuses it, a ``weights_only=False`` load accepts it."""


class _Tiny(pl.LightningModule):
    def __init__(self, thing: Any = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)


def _outcome(path: Path) -> str:
    try:
        _Tiny.load_from_checkpoint(path)
    except Exception as error:  # the kind of failure is the outcome compared
        return type(error).__name__
    return "loaded"


def test_load_from_checkpoint_weights_only_default_is_lightnings_own(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": _Tiny().state_dict(), "pytorch-lightning_version": pl.__version__,
                "hyper_parameters": {"thing": _Opaque()}}, path)
    with_reader = _outcome(path)
    monkeypatch.setattr(saving, "pl_load", cloud_io._load)  # Lightning's loader, as without this package
    assert with_reader == _outcome(path)


def test_checkpoint_reader_passes_on_only_the_callers_arguments(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, Any]] = []

    def lightning_loader(path_or_url: Any, map_location: Any = None, weights_only: Any = "lightning's default") -> Any:
        calls.append((map_location, weights_only))
        return {}

    monkeypatch.setattr(saving, "pl_load", lightning_loader)
    install_checkpoint_reader()
    path = tmp_path / "plain.ckpt"
    torch.save({}, path)
    saving.pl_load(path)
    saving.pl_load(path, map_location="cpu", weights_only=True)
    assert calls == [(None, "lightning's default"), ("cpu", True)]
