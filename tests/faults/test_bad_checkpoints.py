"""Loading what is not a (complete, matching, intact) checkpoint fails with a clear error, and
touches neither the files nor the state it was loading into.

One gloo rank in this process (the engine and sharded mode need a process group); the
``local`` checkpoint for the world-size check is written by 2 ranks.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_distributed
from checkpoint_cases import OtherNet, build, fit, make_trainer, save_and_gather, train
from torch import nn

from lightning_zero import ZeroEngine
from lightning_zero.checkpoint import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    engine_tree,
    load,
    save,
)
from lightning_zero.checkpoint.formats.tree import FlatShard, walk
from lightning_zero.checkpoint.store import storage

pytestmark = pytest.mark.usefixtures("one_rank")  # one in-process gloo rank (tests/conftest.py)

MODES = ("local", "sharded", "full")


def load_target(model: nn.Module | None = None) -> tuple[nn.Module, ZeroEngine, dict[str, Any]]:
    """A one-rank engine with other weights and the tree a load fills. The engine cases' Net takes
    one step first, so that it has optimizer state for the parameters the saved one had; another
    model gets state for all its parameters."""
    model, engine = build(0, 1, model=model, perturb=1.0)
    opt = engine.optimizers[0]
    if isinstance(model, OtherNet):
        engine_tree.materialize_optimizer_state(opt, {sp.fqn for sp in opt.sharded_params})
    else:
        train(model, engine, range(1), 0, 1)
    return model, engine, engine_tree.zero_state_dict(engine, model, for_load=True)


def tensors(tree: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {"/".join(path): (leaf.local if isinstance(leaf, FlatShard) else leaf).clone()
            for path, leaf in walk(tree) if isinstance(leaf, (FlatShard, torch.Tensor))}


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_load_fails(path: Path, error: type[BaseException], match: str, root: Path | None = None,
                      model: nn.Module | None = None, state_untouched: bool = True) -> None:
    """``load`` raises ``error`` matching ``match``; the files under ``root`` (and the target) are untouched."""
    root = root or path.parent
    before = files(root)
    _, engine, tree = load_target(model)
    state = tensors(tree)
    with pytest.raises(error, match=match):
        load(tree, str(path))
    engine.close()
    assert files(root) == before, "a failed load changed the files"
    if state_untouched:
        after = tensors(tree)
        assert all(torch.equal(after[k], v) for k, v in state.items()), "a failed load changed the state"


@pytest.fixture
def saved(tmp_path: Path) -> Callable[[str], Path]:
    """``<tmp>/<mode>.ckpt`` of the engine cases' Net after one AdamW step."""

    def save_mode(mode: str) -> Path:
        model, engine = build(0, 1)
        train(model, engine, range(1), 0, 1)
        path = tmp_path / f"{mode}.ckpt"
        save(engine_tree.zero_state_dict(engine, model), str(path), mode=mode)
        engine.close()
        return path

    return save_mode


# ---- not a checkpoint ----------------------------------------------------------------------


def make_random_file(path: Path) -> None:
    path.write_bytes(torch.randint(0, 256, (1000,), dtype=torch.uint8).numpy().tobytes())


def make_directory(path: Path) -> None:
    path.mkdir()
    (path / "weights.bin").write_bytes(b"\0" * 10)


def make_foreign_json(path: Path) -> None:
    path.write_text(json.dumps({"format": "something-else", "step": 3}))


NOT_CHECKPOINTS = {
    "missing": (lambda path: None, CheckpointNotFoundError, r"No checkpoint at .*did not commit"),
    "random-file": (make_random_file, CheckpointCorruptError, r"damaged or not a checkpoint"),
    "directory": (make_directory, CheckpointNotFoundError, r"is a directory without a lightning_zero commit marker"),
    "foreign-json": (make_foreign_json, CheckpointNotFoundError, r"is a JSON file, not a lightning_zero checkpoint"),
}


@pytest.mark.parametrize("case", NOT_CHECKPOINTS)
def test_a_path_that_is_not_a_checkpoint_fails_clearly(tmp_path: Path, case: str) -> None:
    make, error, match = NOT_CHECKPOINTS[case]
    path = tmp_path / "model.ckpt"
    make(path)
    assert_load_fails(path, error, match)


# ---- incomplete ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["local", "sharded"])
def test_data_without_commit_marker_is_not_a_checkpoint(saved: Callable[[str], Path], mode: str) -> None:
    path = saved(mode)
    path.unlink()  # what a crash between the data and the commit leaves
    assert (path.parent / "_zero_data" / path.name).exists()
    assert_load_fails(path, CheckpointNotFoundError, r"did not commit .*commit marker")


@pytest.mark.parametrize("mode", ["local", "sharded"])
def test_a_save_that_fails_at_the_commit_is_not_a_checkpoint_and_keeps_the_previous(
        saved: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    path = saved(mode)
    before = path.read_bytes()
    model, engine = build(0, 1)
    with monkeypatch.context() as patch:
        def no_commit(loc: Any, marker: Any, fields: Any = None) -> None:
            raise OSError("injected: the commit marker could not be written")

        patch.setattr(storage, "write_marker", no_commit)
        with pytest.raises(CheckpointSaveError, match=rf"{path.name}.*commit marker could not be written"):
            save(engine_tree.zero_state_dict(engine, model), str(path), mode=mode)
        with pytest.raises(CheckpointSaveError, match=r"new\.ckpt.*commit marker could not be written"):
            save(engine_tree.zero_state_dict(engine, model), str(path.parent / "new.ckpt"), mode=mode)
    engine.close()
    assert path.read_bytes() == before
    _, fresh, tree = load_target()
    load(tree, str(path))  # the previous, complete checkpoint
    fresh.close()
    # The uncommitted one is not a checkpoint, although its data was written.
    assert (path.parent / "_zero_data" / "new.ckpt").exists()
    assert_load_fails(path.parent / "new.ckpt", CheckpointNotFoundError, r"did not commit")


# ---- another world size, another model -----------------------------------------------------


def test_local_checkpoint_at_another_world_size_names_both_sizes_and_sharded(tmp_path: Path) -> None:
    run_distributed(save_and_gather, 2, str(tmp_path), ("local",), start_method="forkserver")
    assert_load_fails(tmp_path / "local.ckpt", ValueError,
                      r"saved in 'local' mode with world size 2.*not 1.*mode='sharded'")


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_of_another_model_lists_missing_and_unexpected_keys(saved: Callable[[str], Path], mode: str) -> None:
    path = saved(mode)
    assert_load_fails(path, KeyError,
                      r"does not match this model/optimizer: missing keys \[.*'model/extra\.weight'.*'model/tail\.weight'"
                      r".*\].*, unexpected keys \[.*'model/head\.weight'.*saved from another model",
                      model=OtherNet())


# ---- damaged data --------------------------------------------------------------------------


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "local-rank-file-truncated": ("local", "rank00000-of-00001.pt", truncate),
    "local-rank-file-deleted": ("local", "rank00000-of-00001.pt", Path.unlink),
    "sharded-data-truncated": ("sharded", "__0_0.distcp", truncate),
    "sharded-metadata-truncated": ("sharded", ".metadata", truncate),
    "sharded-objects-truncated": ("sharded", "objects.pt", truncate),
    "full-file-truncated": ("full", None, truncate),
    "marker-truncated": ("sharded", "marker", truncate),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_file_raises_checkpoint_corrupt_error(saved: Callable[[str], Path], case: str) -> None:
    mode, name, damage = DAMAGE[case]
    path = saved(mode)
    if name is None or name == "marker":
        target = path
    else:
        (version,) = (path.parent / "_zero_data" / path.name).iterdir()
        target = version / name
    damage(target)
    # Sharded loads read into fresh buffers first, so even a data file damaged half-way (DCP copies
    # item by item) leaves the state it was loading into untouched.
    assert_load_fails(path, CheckpointCorruptError, r"damaged|truncated")


# ---- through the Trainer -------------------------------------------------------------------


@pytest.mark.slow
def test_trainer_resume_from_a_file_that_is_not_a_checkpoint_fails_clearly(tmp_path: Path) -> None:
    path = tmp_path / "model.ckpt"
    make_foreign_json(path)
    before = path.read_bytes()
    with pytest.raises(Exception, match=r"is a JSON file, not a lightning_zero checkpoint"):
        fit(make_trainer("sharded", tmp_path / "ckpts", 1), ckpt_path=str(path))
    assert path.read_bytes() == before
    assert not (tmp_path / "ckpts").exists() or not any((tmp_path / "ckpts").iterdir())
