"""The S3 clients as stores ([Note: storage seam] in store/backend.py): s3torchconnector chosen by
``storage_options["client"]``, configured as s3fs is (endpoint and region from the options or the environment),
refused clearly without its extra; every byte of a checkpoint through its client; a ``sharded`` checkpoint
resharded 2 -> 3 ranks and a tiered run's durable tier on S3 through either client (the ``s3`` fixture's two
parameters). The other S3 tests (tests/checkpoint/store/test_checkpoint_s3.py, tests/faults/test_s3_*.py) run
through both clients too."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import pytest
import torch
from _dist import run_distributed
from checkpoint_cases import assert_same_state, load_with_options, save_and_gather

from lightning_zero.checkpoint import FlatShard, load, save
from lightning_zero.checkpoint.store import s3torch, storage
from lightning_zero.checkpoint.store.fsspec_store import S3fsStore

if TYPE_CHECKING:
    from s3_server import S3  # the type of the s3 fixture (tests/conftest.py)

CLIENT = {"client": "s3torchconnector"}


@pytest.fixture
def fresh_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    """No s3torchconnector store is reused from an earlier test (they are kept per configuration)."""
    monkeypatch.setattr(s3torch, "_stores", {})


def test_s3fs_is_the_default_and_s3torchconnector_is_chosen_by_name(fresh_clients: None) -> None:
    pytest.importorskip("s3torchconnector")
    assert isinstance(storage.resolve("s3://bucket/run/last.ckpt").store, S3fsStore)
    assert isinstance(storage.resolve("s3://bucket/run/last.ckpt", {"client": "s3fs"}).store, S3fsStore)
    loc = storage.resolve("s3://bucket/run/last.ckpt", {**CLIENT, "endpoint_url": "http://127.0.0.1:9"})
    assert isinstance(loc.store, s3torch.S3TorchConnectorStore)
    assert (loc.path, loc.url) == ("bucket/run/last.ckpt", "s3://bucket/run/last.ckpt")


def test_an_unknown_client_names_the_ones_there_are() -> None:
    with pytest.raises(ValueError, match=r"'boto' is not a client for s3:// paths \('s3fs', 's3torchconnector'\)"):
        storage.resolve("s3://bucket/x", {"client": "boto"})


def test_a_client_choice_leaves_paths_of_other_schemes_to_their_own_store(tmp_path: Any) -> None:
    # A plugin's storage_options serve every path it is handed, local ones (a tier, a copy) included.
    from lightning_zero.checkpoint.store.local import LocalStore

    loc = storage.resolve(str(tmp_path / "last.ckpt"), {**CLIENT, "endpoint_url": "http://127.0.0.1:9"})
    assert isinstance(loc.store, LocalStore) and loc.path == str(tmp_path / "last.ckpt")


def test_without_the_extra_the_error_names_it(fresh_clients: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "s3torchconnector", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r'pip install "lightning-zero\[s3torchconnector\]"'):
        storage.resolve("s3://bucket/x", CLIENT)


def test_endpoint_and_region_come_from_the_options_or_the_environment_as_s3fs_takes_them(
        fresh_clients: None, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("s3torchconnector")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1111")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    monkeypatch.delenv("AWS_REGION", raising=False)
    store = storage.resolve("s3://b/x", CLIENT).store
    assert (store.endpoint, store.region) == ("http://127.0.0.1:1111", "eu-west-1")
    assert store.client.s3client_config.force_path_style  # a local endpoint is addressed by path
    monkeypatch.setenv("AWS_REGION", "eu-central-1")  # AWS_REGION wins over AWS_DEFAULT_REGION
    assert storage.resolve("s3://b/x", CLIENT).store.region == "eu-central-1"
    store = storage.resolve("s3://b/x", {**CLIENT, "endpoint_url": "http://127.0.0.1:2222", "region": "ap-south-1"}).store
    assert (store.endpoint, store.region) == ("http://127.0.0.1:2222", "ap-south-1")
    store = storage.resolve("s3://b/x", {**CLIENT, "client_kwargs": {"endpoint_url": "http://h:3", "region_name": "r"}}).store
    assert (store.endpoint, store.region) == ("http://h:3", "r")
    assert storage.resolve("s3://b/x", CLIENT).store is storage.resolve("s3://b/x", CLIENT).store  # one client each


def test_s3fs_credentials_in_the_options_are_refused_with_the_way_the_client_takes_them(fresh_clients: None) -> None:
    pytest.importorskip("s3torchconnector")
    with pytest.raises(ValueError, match=r"\['key', 'secret'\] are not options of the s3torchconnector client.*profile"):
        storage.resolve("s3://b/x", {**CLIENT, "key": "AKIA", "secret": "s3cr3t"})


# ---- against the local S3 server ------------------------------------------------------------------


def _tree(value: float) -> dict[str, Any]:
    return {"w": FlatShard(torch.full((1000,), value), (1000,), 0, 1), "b": torch.full((3,), value), "meta": {"n": 1}}


@pytest.mark.s3
@pytest.mark.parametrize("mode", ["local", "sharded", "full"])
def test_with_s3torchconnector_chosen_no_byte_goes_through_fsspec(s3: S3, mode: str, one_rank: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if s3.client_name != "s3torchconnector":
        pytest.skip("a property of the s3torchconnector client")
    import fsspec

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("fsspec was asked for a file system while s3torchconnector was chosen")

    monkeypatch.setattr(fsspec, "filesystem", refused)
    monkeypatch.setattr(fsspec.core, "url_to_fs", refused)
    url = s3.fresh_prefix(f"only-crt-{mode}") + "/last.ckpt"
    save(_tree(1.0), url, mode=mode, storage_options=s3.storage_options)
    save(_tree(2.0), url, mode=mode, storage_options=s3.storage_options)  # a second version: the first removed
    target = _tree(0.0)
    load(target, url, storage_options=s3.storage_options)
    assert target["w"].local.eq(2.0).all()
    data = [key for key in s3.keys(url.rsplit("/", 1)[0]) if "/_zero_data/" in key]
    assert len({key.split("/_zero_data/last.ckpt/")[1].split("/")[0] for key in data}) == (mode != "full")


@pytest.mark.s3
def test_a_sharded_checkpoint_on_s3_reshards_from_two_ranks_to_three(s3: S3) -> None:
    root = s3.fresh_prefix("reshard")
    saved = run_distributed(save_and_gather, 2, root, ("sharded",), 3, s3.storage_options,
                            start_method="forkserver")[0]
    loaded = run_distributed(load_with_options, 3, f"{root}/sharded.ckpt", sorted(saved["state"]), s3.storage_options,
                             start_method="forkserver")
    for rank, state in enumerate(loaded):
        assert_same_state(state, saved, f"rank {rank} of 3")


@pytest.mark.s3
@pytest.mark.slow
@pytest.mark.usefixtures("in_process_trainer_group")
def test_a_tiered_run_persists_to_s3_and_resumes_last_from_it(s3: S3, tmp_path: Any) -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_cases import NetModule, loader

    from lightning_zero import LocalTier, ZeroCheckpointIO, ZeroLowLevelStrategy
    from lightning_zero.checkpoint.store import cleanup

    prefix = s3.fresh_prefix("tiered")

    def trainer() -> Trainer:
        io = ZeroCheckpointIO(mode="sharded", local_tier=LocalTier(str(tmp_path / "local" / "node{node_rank}")),
                              persist_every=1, storage_options=s3.storage_options)
        return Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, use_distributed_sampler=False,
                       strategy=ZeroLowLevelStrategy(stage=2, bucket_size_mb=0.0005, start_method="popen"),
                       plugins=[io], callbacks=[ModelCheckpoint(dirpath=prefix, every_n_train_steps=1, save_top_k=-1)],
                       enable_progress_bar=False, enable_model_summary=False)

    module = NetModule()
    trainer().fit(module, loader(3, 1, 1))
    assert {f"{prefix}/epoch=0-step={step}.ckpt" for step in (1, 2, 3)} <= {f"s3://{s3.bucket}/{k}"
                                                                             for k in s3.keys(prefix)}
    # The local tier lost its newest save: the durable one on S3 (step 3) is newer than the local step 2.
    cleanup.remove(storage.resolve(str(tmp_path / "local" / "node0" / "epoch=0-step=3.ckpt")))
    resumed = NetModule()
    again = trainer()
    again.fit(resumed, loader(3, 1, 1), ckpt_path="last")
    load_figures = again.strategy.checkpoint_io.last_load
    assert load_figures.tier == "durable" and "step=3" in load_figures.path
    for (name, value), (_, other) in zip(module.net.named_parameters(), resumed.net.named_parameters()):
        assert torch.equal(value, other), name


def test_the_newest_siblings_of_saves_within_one_second_go_by_the_numbers_in_their_names() -> None:
    # S3's LastModified has whole seconds: three saves in one second are ordered by step, 10 after 9.
    from lightning_zero.checkpoint.store import cleanup

    class Listing:
        def ls(self, path: str, detail: bool = False) -> list[dict[str, Any]]:
            names = ["epoch=0-step=9.ckpt", "epoch=0-step=10.ckpt", "epoch=0-step=2.ckpt", "last.ckpt"]
            return [{"name": f"bucket/run/{name}", "type": "file", "mtime": 100} for name in names]

        def url(self, path: str) -> str:
            return f"s3://{path}"

    loc = storage.Location(Listing(), "bucket/run/last.ckpt", "s3://bucket/run/last.ckpt")  # type: ignore[arg-type]
    assert cleanup.newest_siblings(loc) == ["s3://bucket/run/epoch=0-step=10.ckpt", "s3://bucket/run/epoch=0-step=9.ckpt",
                                            "s3://bucket/run/epoch=0-step=2.ckpt"]
