"""Checkpoints on S3: moto's server on 127.0.0.1 through the real s3fs client.

Functional round trips of all three modes at 2 ranks, and Trainer runs for ``sharded`` and
``full`` with ``ModelCheckpoint(dirpath="s3://...")`` resumed from ``s3://.../last.ckpt`` and
from ``"last"``. Trainer ranks fork from the fork server, which inherits the AWS endpoint that

Lightning's own s3fs calls need because conftest.py exports it before the server starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import torch
from _dist import run_distributed
from checkpoint_cases import (
    MODES,
    assert_same_state,
    assert_same_weights,
    fit,
    make_trainer,
    round_trip,
)

from lightning_zero.checkpoint.store import storage

if TYPE_CHECKING:
    from s3_server import S3  # the type of the s3 fixture (tests/conftest.py)

pytestmark = pytest.mark.s3

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def round_trips(s3: S3) -> tuple[str, list[dict[str, Any]]]:
    root = s3.fresh_prefix("round-trip")
    return root, run_distributed(round_trip, WORLD_SIZE, root, MODES, s3.storage_options, start_method="forkserver")


@pytest.mark.parametrize("mode", MODES)
def test_load_from_s3_restores_the_state_exactly(round_trips: Any, mode: str) -> None:
    _, results = round_trips
    for rank, result in enumerate(results):
        assert_same_state(result[mode]["loaded"], result["saved"], f"{mode}, rank {rank}")
        for fqn, value in result["saved"]["master"].items():
            assert torch.equal(result[mode]["loaded_params"][fqn], value), f"{mode}, rank {rank}: {fqn}"


@pytest.mark.parametrize("mode", MODES)
def test_resumed_training_from_s3_equals_the_uninterrupted_run(round_trips: Any, mode: str) -> None:
    _, results = round_trips
    for rank, result in enumerate(results):
        for fqn, value in result["uninterrupted"].items():
            assert torch.equal(result[mode]["resumed"][fqn], value), f"{mode}, rank {rank}: {fqn}"


def test_s3_layout_is_a_marker_object_with_versioned_data(round_trips: Any, s3: S3) -> None:
    root, _ = round_trips
    prefix = root.removeprefix(f"s3://{s3.bucket}/")
    keys = s3.keys(root)
    for mode in ("local", "sharded"):
        marker = storage.read_marker(storage.resolve(f"{root}/{mode}.ckpt"))
        assert marker["mode"] == mode and marker["world_size"] == WORLD_SIZE
        data = [k for k in keys if k.startswith(f"{prefix}/_zero_data/{mode}.ckpt/")]
        assert data and all(k.startswith(f"{prefix}/_zero_data/{mode}.ckpt/{marker['data'].rsplit('/', 1)[-1]}/") for k in data)
    assert s3.read(f"{root}/full.ckpt")[:2] == b"PK"
    # No temporary objects left behind (S3 has no rename: nothing is written under a tmp name).
    assert not [k for k in keys if ".tmp-" in k]


# ---- through the Trainer -------------------------------------------------------------------


@pytest.fixture(scope="module")
def first_epoch(s3: S3) -> Any:
    """``s3://.../<mode>`` after a 1-epoch run that saved there (run once per mode)."""
    made: dict[str, str] = {}

    def run(mode: str) -> str:
        if mode not in made:
            prefix = s3.fresh_prefix(f"trainer-{mode}")
            fit(make_trainer(mode, prefix, 1, start_method="forkserver", storage_options=s3.storage_options))
            made[mode] = prefix
        return made[mode]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sharded", "full"])
def test_trainer_resumes_from_an_s3_url(first_epoch: Any, s3: S3, uninterrupted: dict[str, torch.Tensor],
                                        mode: str) -> None:
    prefix = first_epoch(mode)
    assert {f"{prefix}/epoch=0-step=2.ckpt", f"{prefix}/last.ckpt"} <= {f"s3://{s3.bucket}/{k}" for k in s3.keys(prefix)}
    elsewhere = s3.fresh_prefix(f"resumed-{mode}")
    resumed = fit(make_trainer(mode, elsewhere, 2, start_method="forkserver", storage_options=s3.storage_options),
                  ckpt_path=f"{prefix}/last.ckpt", perturb=True)
    assert_same_weights(resumed, uninterrupted, f"{mode}: resumed from {prefix}/last.ckpt")
    assert f"{elsewhere.removeprefix(f's3://{s3.bucket}/')}/last.ckpt" in s3.keys(elsewhere)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sharded", "full"])
def test_trainer_resumes_from_last_on_s3_despite_lightning_18261(first_epoch: Any, s3: S3, uninterrupted: dict[str, torch.Tensor],
                                         mode: str) -> None:
    prefix = first_epoch(mode)
    resumed = fit(make_trainer(mode, prefix, 2, start_method="forkserver", storage_options=s3.storage_options),
                  ckpt_path="last", perturb=True)
    assert_same_weights(resumed, uninterrupted, f"{mode}: resumed from 'last' in {prefix}")


def test_model_checkpoint_version_names_are_unique_on_s3(s3: S3) -> None:
    """ModelCheckpoint's -vN names under async saves on S3, where an object exists only once uploaded
    (tests/lightning/test_lightning_contracts.py holds the same test on local paths, against ddp)."""
    from contract_cases import versioned_names

    result = run_distributed(versioned_names, WORLD_SIZE, s3.fresh_prefix("versions"), "zero", "sharded",
                             start_method="forkserver")[0]
    assert result["names"] == ["test-v1.ckpt", "test-v2.ckpt", "test-v3.ckpt", "test.ckpt"]
    assert sorted(result["steps"].values()) == [1, 2, 3, 4]
