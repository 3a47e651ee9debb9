"""Checkpoints of hybrid engines (``shard_group_size``): written once, spread, and resharded on load.

Layouts are named ``N<shard group size>xR<replica groups>``. The reference is the full state rebuilt
from the saving ranks' shards with all_gather_object (``checkpoint_cases.gather_full_state``).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_distributed
from checkpoint_cases import assert_same_state, fit
from hybrid_cases import load_hybrid, save_and_load_by_group, save_hybrid

from lightning_zero.checkpoint.store import storage
from lightning_zero.engine.sharding import EvenShard

SAVES = {"N2xR2": (4, 2), "N4xR1": (4, None)}


@functools.cache
def saved(name: str, root: str) -> tuple[Path, list[dict[str, Any]]]:
    world_size, size = SAVES[name]
    folder = Path(root) / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder, run_distributed(save_hybrid, world_size, str(folder), size, start_method="forkserver")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("hybrid_ckpt"))


def test_hybrid_save_gathers_the_same_state_on_every_rank(root: str) -> None:
    _, results = saved("N2xR2", root)
    for rank, result in enumerate(results[1:], 1):
        assert_same_state(result["full"], results[0]["full"], f"rank {rank}")


def test_sharded_save_of_2x2_writes_one_copy_in_total(root: str) -> None:
    _, hybrid = saved("N2xR2", root)
    _, flat = saved("N4xR1", root)
    assert sum(r["written"]["sharded"] for r in hybrid) == sum(r["written"]["sharded"] for r in flat)
    # One copy: every master and optimizer-state element once (plus Adam's per-parameter step scalars).
    full = hybrid[0]["full"]
    elements = sum(v.numel() for v in full["master"].values())
    elements += sum(v.numel() for entry in full["state"].values() for k, v in entry.items() if k != "step")
    steps = sum(1 for entry in full["state"].values() if "step" in entry)
    assert sum(r["written"]["sharded"] for r in hybrid) == 4 * elements + steps * 4


def test_sharded_save_of_2x2_spreads_the_writes_over_the_replica_groups(root: str) -> None:
    folder, hybrid = saved("N2xR2", root)
    written = [r["written"]["sharded"] for r in hybrid]
    mean = sum(written) / len(written)
    assert all(abs(w - mean) <= 0.05 * mean for w in written), written
    # Every rank wrote a data file of its own (replica group 1 is not idle).
    files = sorted(p.name for p in folder.rglob("*.distcp"))
    assert {name.split("_")[2] for name in files} == {"0", "1", "2", "3"}, files


RESHARDS = [
    # (saved layout, loaded world size, loaded shard_group_size)
    ("N2xR2", 3, 3),  # 1 x 3
    ("N2xR2", 3, 1),  # 3 x 1
    ("N2xR2", 2, 1),  # 2 x 1
    ("N2xR2", 2, None),  # flat, 2 ranks
    ("N4xR1", 4, 2),  # 1 x 4 -> 2 x 2
]


@pytest.mark.parametrize(("name", "world_size", "size"), RESHARDS,
                         ids=[f"{n}-to-ws{w}-N{s}" for n, w, s in RESHARDS])
def test_sharded_checkpoint_reshards_to_any_world_size_and_shard_group_size(
        root: str, name: str, world_size: int, size: int | None) -> None:
    folder, results = saved(name, root)
    expected = results[0]["full"]
    sharded, full = str(folder / "sharded.ckpt"), str(folder / "full.ckpt")
    loaded = run_distributed(load_hybrid, world_size, [sharded, full], sorted(expected["state"]), size,
                             start_method="forkserver")
    n = size or world_size
    for rank, result in enumerate(loaded):
        where = f"{name} -> world {world_size}, shard_group_size {size}, rank {rank}"
        assert result[sharded]["shard_numel"] == sum(EvenShard(v.numel(), n).shard_numel(rank % n)
                                                     for v in expected["master"].values()), where
        assert_same_state(result[sharded]["loaded"], expected, where)
        assert_same_state(result[full]["loaded"], expected, where + " (full)")
        for fqn, value in expected["master"].items():
            assert torch.equal(result[sharded]["params"][fqn], value), f"{where}: {fqn}"
            assert torch.equal(result[sharded]["after_steps"][fqn], result[full]["after_steps"][fqn]), where


def test_local_checkpoint_resumes_with_fewer_replica_groups_of_the_same_shard_group_size(root: str) -> None:
    folder, results = saved("N2xR2", root)
    expected = results[0]["full"]
    local = str(folder / "local.ckpt")
    loaded = run_distributed(load_hybrid, 2, [local], sorted(expected["state"]), 2, start_method="forkserver")
    for rank, result in enumerate(loaded):
        assert "error" not in result[local], result[local]
        assert_same_state(result[local]["loaded"], expected, f"N2xR2 -> N2xR1, rank {rank}")


@pytest.mark.parametrize(("world_size", "size"), [(4, 1), (4, None)], ids=["N1xR4", "N4xR1"])
def test_local_checkpoint_refuses_another_shard_group_size_clearly(root: str, world_size: int,
                                                                   size: int | None) -> None:
    folder, results = saved("N2xR2", root)
    local = str(folder / "local.ckpt")
    loaded = run_distributed(load_hybrid, world_size, [local], sorted(results[0]["full"]["state"]), size,
                             start_method="forkserver")
    for result in loaded:
        message = result[local]["error"]
        assert "2 replica groups of shard_group_size 2" in message, message
        assert "resumes only with shard_group_size 2 and a world size in [2, 4]" in message, message
        assert "mode='sharded'" in message


@functools.cache
def by_group(root: str) -> list[dict[str, Any]]:
    folder = Path(root) / "by_group"
    folder.mkdir(parents=True, exist_ok=True)
    return run_distributed(save_and_load_by_group, 4, str(folder), start_method="forkserver")


def test_one_replica_group_saves_as_a_unit_with_process_group_and_coordinator_rank(root: str) -> None:
    results = by_group(root)
    for rank, result in enumerate(results):
        assert_same_state(result["loaded"]["sharded"], result["expected"], f"sharded, rank {rank}")
        assert_same_state(result["loaded"]["local"], result["expected"], f"local over the shard group, rank {rank}")
    marker = storage.read_marker(storage.resolve(str(Path(root) / "by_group" / "sharded.ckpt")))
    assert marker is not None and marker["world_size"] == 2  # the group's ranks only


def test_group_arguments_are_validated_on_every_rank(root: str) -> None:
    for result in by_group(root):
        assert "is not in process_group" in result["errors"]["coordinator-outside"]
        assert "mode='full' saves over every rank" in result["errors"]["full-with-group"]


def _hybrid_trainer(mode: str, dirpath: Path, max_epochs: int) -> Any:
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_zero import ZeroLowLevelStrategy
    from lightning_zero.checkpoint import ZeroCheckpointIO

    return Trainer(
        accelerator="cpu", devices=4, max_epochs=max_epochs, use_distributed_sampler=False, logger=False,
        strategy=ZeroLowLevelStrategy(stage=2, shard_group_size=2, start_method="forkserver"),  # type: ignore[arg-type]
        plugins=[ZeroCheckpointIO(mode=mode)],  # type: ignore[arg-type]
        callbacks=[ModelCheckpoint(dirpath=str(dirpath), save_last=True)],
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(dirpath),
    )


@pytest.mark.parametrize("mode", ["sharded", "local"])
def test_trainer_2x2_resumes_from_last_exactly(tmp_path: Path, mode: str) -> None:
    uninterrupted = fit(_hybrid_trainer(mode, tmp_path / "straight", 2), world_size=4)
    fit(_hybrid_trainer(mode, tmp_path / "resumed", 1), world_size=4)
    resumed = fit(_hybrid_trainer(mode, tmp_path / "resumed", 2), ckpt_path="last", perturb=True, world_size=4)
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), name


@pytest.mark.parametrize("mode", ["sharded", "local", "full"])
def test_convert_reads_a_2x2_checkpoint_in_one_process(root: str, mode: str) -> None:
    from lightning_zero.checkpoint import convert

    folder, results = saved("N2xR2", root)
    expected = results[0]["full"]
    out = folder / f"converted-{mode}.ckpt"
    convert(str(folder / f"{mode}.ckpt"), str(out))
    content = torch.load(out, weights_only=True)
    # Every mode becomes Lightning's format, a functional-API tree saved whole ('full') too.
    weights = content["state_dict"]
    for fqn, value in expected["master"].items():
        assert torch.equal(weights[fqn].float(), value), f"{mode}: {fqn}"
