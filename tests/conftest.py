"""Shared test setup: fork-server preload, the fixtures every directory shares (a one-rank in-process gloo group,
saves finalized, moto S3, the uninterrupted run), a hypothesis profile, the e2e tier (tests/README.md)."""

from __future__ import annotations

import os

# One OpenMP/MKL thread in this process, set before torch loads its OpenMP runtime: a Trainer run
# in-process (devices=1) would otherwise start GNU OpenMP's thread pool (MKL's vectorized sqrt in
# Adam), and a process forked from here later (plain DDP with start_method="fork") then hangs in its
# first parallel kernel: libgomp is not fork-safe. Workers use one thread each anyway (tests/_dist.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from _dist import FORKSERVER_PRELOAD, free_port  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Before any fork server starts: run_distributed(..., start_method="forkserver") then forks ranks
# from a process that has imported torch and lightning_zero once.
mp.set_forkserver_preload(FORKSERVER_PRELOAD)

# The S3 tests' moto endpoint, exported now so that workers forked from the fork server (which
# keeps the environment it started with) reach it; tests/s3_server.py starts moto on this port.
_s3_port = os.environ.setdefault("LIGHTNING_ZERO_TEST_S3_PORT", str(free_port()))
os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                  AWS_ENDPOINT_URL=f"http://127.0.0.1:{_s3_port}")

settings.register_profile("lightning_zero", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("lightning_zero")

TESTS = Path(__file__).resolve().parent
E2E_MODULES = frozenset({
    "lightning/test_cli",  # the lightning-zero command
    "lightning/test_configs",  # every config in configs/ through the command
    "examples/test_demo",  # examples/demo.py (make demo)
    "examples/test_examples",  # examples/hf_gpt2.py, examples/lora_gpt2.py
    "examples/test_fabric_example",  # examples/fabric_gpt.py, killed after its first save and run again
    "examples/test_torchrun_loop",  # examples/torchrun_loop.py under torchrun, SIGKILLed and resumed
    "lightning/test_multinode",  # two "nodes", each a script with its own ranks
    "bench/test_bench_engine",  # bench/engine.py
    "bench/test_bench_scale",  # bench/scale.py
    "bench/test_bench_write_loop",  # bench/write_loop.py
    "bench/test_gpu_check",  # bench/gpu_check.py
    "faults/test_peer_loss_trainer",  # one script per node, one of them killed or stopped
    "faults/test_killed_job",  # a training script SIGKILLed mid-save
    "faults/test_clean_exit",  # fit and resume scripts must exit cleanly
    "faults/test_endurance",  # 200 saves: minutes, not a fresh interpreter
    "engine/test_ddp_style_ending",  # functional-API programs that destroy their group or exit mid-gather
    "test_docs_site",  # make docs, then headless Chromium on the built site
})
"""Test modules (paths under tests/, without .py) in the ``e2e`` tier: their tests start fresh
interpreters (a command, an example or bench script, torchrun) or run for minutes. Every test in them
is marked ``e2e`` here, so ``make test-fast`` (``-m "not e2e and not slow"``) leaves them out and the
modules need no marks of their own; ``make test`` runs them. A few tests in these modules run in this
process (the command's argument parsing, the bench modules' helpers): they go with their module.
Modules where one test among many in-process ones starts the command (checkpoint/interop/test_convert,
checkpoint/test_old_checkpoints, faults/test_hostile_files) stay out; those tests are marked ``slow``."""

_missing = sorted(name for name in E2E_MODULES if not (TESTS / f"{name}.py").is_file())
assert not _missing, f"E2E_MODULES names modules that do not exist (renamed?): {_missing}"


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by -m
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.path.with_suffix("")
        if module.is_relative_to(TESTS) and module.relative_to(TESTS).as_posix() in E2E_MODULES:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture
def single_rank_group() -> Iterator[None]:
    """A world of one gloo rank in this process, destroyed afterwards so later tests start clean."""
    assert not dist.is_initialized(), "a previous test leaked a process group"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def saves_finalized() -> Iterator[None]:
    """Every save the test queued in this process finalized after it, so none runs into the next test (one
    that failed raises here)."""
    from lightning_zero.checkpoint import maybe_finalize_async_calls

    yield
    maybe_finalize_async_calls(blocking=True)


@pytest.fixture
def one_rank(single_rank_group: None, saves_finalized: None) -> None:
    """A world of one gloo rank (DCP's sharded saves need a group), every save of the test finalized after
    it, while the group is still there."""


@pytest.fixture(scope="module", params=["s3fs", "s3torchconnector"])
def s3(request: pytest.FixtureRequest) -> Iterator[Any]:
    """moto on 127.0.0.1 with one bucket (tests/s3_server.py), AWS_* (endpoint included) set for the module's
    runs, reached through each S3 client in turn (``s3.storage_options`` chooses it); moto is imported by the
    modules that ask for it only."""
    from s3_server import moto_s3

    if request.param == "s3torchconnector":
        pytest.importorskip("s3torchconnector", reason='the s3torchconnector extra is not installed')
    with moto_s3(client=request.param) as server:
        yield server


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Rank 0's weights after the 2-epoch (4-step) run of tests/checkpoint_cases.py's Trainer without a
    break, which every resume of that run's checkpoints must end with; fitted once per session, for the
    first test that asks. Read it, never change it: the tests share it."""
    from checkpoint_cases import fit, make_trainer

    saved = dict(os.environ)  # the launcher exports MASTER_PORT; outside any test's _environment_unchanged here
    try:
        return fit(make_trainer("sharded", tmp_path_factory.mktemp("uninterrupted"), 2, checkpointing=False))
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _environment_unchanged() -> Iterator[None]:
    """Every test leaves ``os.environ`` as it found it. A Trainer run in this process (devices=1)
    exports MASTER_ADDR/MASTER_PORT; a later console-command test inherited them, and its rank 0 then
    waited for a rendezvous on a port the torn-down group of this process still held."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def in_process_trainer_group() -> Iterator[None]:
    """For Trainers run in this process (one device, no launcher): their process group is destroyed
    afterwards, so later tests start clean (``single_rank_group`` checks that none leaked)."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _checkpoint_state_reset() -> Iterator[None]:
    """Every test starts from a fresh process-wide checkpoint state and leaves none behind
    ([Note: process-wide checkpoint state]: the worker thread, the coordination group, DCP's plan caches).
    Autouse and first in, so its teardown runs after the test's own fixtures (a process group the test
    made is gone by then, and the reset only forgets its coordination group)."""
    from lightning_zero.checkpoint.runtime import process

    process.reset()
    yield
    process.reset()
