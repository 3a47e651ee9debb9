"""Tiered checkpoints (``ZeroCheckpointIO(local_tier=LocalTier(...), persist_every=N)``) through the Trainer:
every save on the local tier, every N-th and the last one of fit on the durable path, retention per tier,
and ``ckpt_path="last"`` choosing the tier. Multi-node faults are in tests/faults/test_tiered_faults.py."""

from __future__ import annotations

import os
import time

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning_cases import NetModule, loader

from lightning_zero import LocalTier, ZeroCheckpointIO, ZeroLowLevelStrategy
from lightning_zero.checkpoint import read_mode
from lightning_zero.checkpoint.store.storage import MARKER_KEY
from lightning_zero.checkpoint.tiered.replication import ring_peers
from lightning_zero.checkpoint.tiered.tiers import tier_markers

pytestmark = pytest.mark.usefixtures("in_process_trainer_group")


def _trainer(tmp_path, steps: int, persist_every: int = 2, keep: int = 2, devices: int = 1, **checkpoint) -> Trainer:
    io = ZeroCheckpointIO(mode="sharded", local_tier=LocalTier(str(tmp_path / "local" / "node{node_rank}"), keep=keep),
                          persist_every=persist_every)
    callback = ModelCheckpoint(dirpath=tmp_path / "durable", every_n_train_steps=1, save_top_k=-1,
                               **checkpoint)
    return Trainer(accelerator="cpu", devices=devices, max_steps=steps, logger=False, use_distributed_sampler=False,
                   strategy=ZeroLowLevelStrategy(stage=2, bucket_size_mb=0.0005, start_method="popen" if devices == 1 else "forkserver"),
                   plugins=[io], callbacks=[callback], enable_progress_bar=False, enable_model_summary=False)


def _params(module: NetModule) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.net.named_parameters()}


def test_local_tier_options_are_checked():
    with pytest.raises(ValueError, match="only {node_rank} and {local_rank}"):
        LocalTier("/tmp/{host}")
    with pytest.raises(ValueError, match="not a URL"):
        LocalTier("s3://bucket/x")
    with pytest.raises(ValueError, match="keep=0"):
        LocalTier("/tmp/x", keep=0)
    assert LocalTier("/dev/shm/ck/{node_rank}-{local_rank}").root(3, 1) == "/dev/shm/ck/3-1"


def test_replication_ring_sends_to_the_next_nodes_same_local_rank():
    # two nodes of two ranks: (host, dir, node, local rank)
    places = [("a", "/t", 0, 0), ("a", "/t", 0, 1), ("b", "/t", 1, 0), ("b", "/t", 1, 1)]
    assert ring_peers(places, 0, 1) == ([2], [2])
    assert ring_peers(places, 3, 1) == ([1], [1])
    three = [("h", f"/n{n}", n, 0) for n in range(3)]
    assert ring_peers(three, 0, 2) == ([1, 2], [2, 1])


def test_every_save_on_the_local_tier_every_second_and_the_last_on_the_durable_path(tmp_path):
    module = NetModule()
    trainer = _trainer(tmp_path, steps=5)
    trainer.fit(module, loader(5, 1, 1))
    io = trainer.strategy.checkpoint_io
    root = tmp_path / "local" / "node0"
    # keep=2: the two newest of the five local saves; each a `local` checkpoint holding rank 0's file
    kept = [os.path.basename(p) for p, _ in tier_markers(str(root))]
    assert kept == ["epoch=0-step=5.ckpt", "epoch=0-step=4.ckpt"]
    assert read_mode(str(root / kept[0])) == "local"
    # durable: saves 2 and 4 (persist_every=2) and save 5, the last of fit, persisted at teardown
    durable = sorted(p for p in os.listdir(tmp_path / "durable") if p.endswith(".ckpt"))
    assert durable == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=5.ckpt"]
    assert all(read_mode(str(tmp_path / "durable" / p)) == "sharded" for p in durable)
    assert io.last_save_stats is not None
    # Resume "last": both tiers hold step 5, the local tier is taken; bit-exact with the durable one
    resumed = NetModule()
    again = _trainer(tmp_path, steps=5)
    again.fit(resumed, loader(5, 1, 1), ckpt_path="last")
    assert again.strategy.checkpoint_io.last_load.tier == "local"
    for name, value in _params(module).items():
        assert torch.equal(_params(resumed)[name], value)


class _Metrics(Logger):
    """Keeps what rank 0 logs."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict]] = []

    name = "kept"
    version = 0

    def log_metrics(self, metrics, step=None) -> None:  # noqa: ANN001
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs) -> None:  # noqa: ANN001
        pass


def test_a_resume_keeps_and_logs_its_timeline_once_the_first_step_after_it_is_done(tmp_path):
    _trainer(tmp_path, steps=3, persist_every=2).fit(NetModule(), loader(5, 1, 1))
    before_resume = time.time()
    again = _trainer(tmp_path, steps=5, persist_every=2)
    kept = _Metrics()
    again.loggers = [kept]
    again.fit(NetModule(), loader(5, 1, 1), ckpt_path="last")
    load = again.strategy.checkpoint_io.last_load
    assert load.tier == "local" and load.step == 3
    # This process was running at the save it resumed from: no restart in between; its start came before.
    assert load.restart_s == 0.0 and load.startup_s > 0 and load.restarts is None
    assert 0 < load.first_step_s < time.time() - before_resume
    assert load.failure_to_step_s == pytest.approx(load.restart_s + load.startup_s + load.seconds + load.first_step_s)
    recovery = [(step, m) for step, m in kept.logged if "checkpoint/recovery/tier" in m]
    assert len(recovery) == 1, kept.logged  # once, at the first step after the resume
    step, metrics = recovery[0]
    assert step == 4 and metrics["checkpoint/recovery/step"] == 3.0
    assert metrics["checkpoint/recovery/first_step_ms"] == pytest.approx(load.first_step_s * 1e3)
    assert metrics["checkpoint/recovery/failure_to_step_ms"] == pytest.approx(load.failure_to_step_s * 1e3)


def test_save_stats_give_time_to_local_commit_and_to_durable(tmp_path):
    trainer = _trainer(tmp_path, steps=2, persist_every=2)
    trainer.fit(NetModule(), loader(2, 1, 1))
    stats = trainer.strategy.checkpoint_io.last_save_stats
    assert stats.tier == "durable" and stats.durable_error is None
    assert 0 < stats.local_committed_after_s <= stats.replicated_after_s <= stats.durable_after_s
    metrics = stats.as_metrics()
    assert {"checkpoint/local_committed_after_ms", "checkpoint/durable_after_ms"} <= set(metrics)


def test_durable_tier_newer_than_local_is_taken(tmp_path):
    trainer = _trainer(tmp_path, steps=3, persist_every=1)
    module = NetModule()
    trainer.fit(module, loader(3, 1, 1))
    # The local tier lost its newest save (step 3): the durable step-3 checkpoint is newer than local step 2.
    from lightning_zero.checkpoint.store import cleanup, storage

    cleanup.remove(storage.resolve(str(tmp_path / "local" / "node0" / "epoch=0-step=3.ckpt")))
    resumed = NetModule()
    again = _trainer(tmp_path, steps=3, persist_every=1)
    again.fit(resumed, loader(3, 1, 1), ckpt_path="last")
    load = again.strategy.checkpoint_io.last_load
    assert load.tier == "durable" and "step=3" in load.path
    for name, value in _params(module).items():
        assert torch.equal(_params(resumed)[name], value)


class _DurableListing(Callback):
    """The durable directory at the end of training, before teardown persists the newest save."""

    def __init__(self, directory) -> None:
        self.directory, self.seen = directory, []

    def on_train_end(self, trainer, pl_module) -> None:
        trainer.strategy.checkpoint_io.finalize()
        self.seen = sorted(p for p in os.listdir(self.directory) if p.endswith(".ckpt"))


def test_durable_removals_wait_for_a_newer_durable_checkpoint(tmp_path):
    # save_top_k=1 by step: ModelCheckpoint asks to remove each previous file right away; the durable tier
    # keeps the newest persisted one (step 2) until a newer one commits there (step 3, at the end of fit).
    trainer = _trainer(tmp_path, steps=3, persist_every=2, monitor="step", mode="max")
    trainer.checkpoint_callback.save_top_k = 1
    listing = _DurableListing(tmp_path / "durable")
    trainer.callbacks.insert(0, listing)
    trainer.fit(NetModule(), loader(3, 1, 1))
    assert listing.seen == ["epoch=0-step=2.ckpt"]
    durable = sorted(p for p in os.listdir(tmp_path / "durable") if p.endswith(".ckpt"))
    assert durable == ["epoch=0-step=3.ckpt"]


@pytest.mark.slow
def test_resume_at_another_world_size_reshards_the_local_tier(tmp_path):
    module = NetModule()
    _trainer(tmp_path, steps=2, persist_every=5, devices=2).fit(module, loader(2, 1, 2))
    # Two ranks saved; the local tier holds step 2 at world size 2, the durable tier step 2 (end of fit): the
    # local one is as new, so one rank reads it resharded 2 -> 1 (tests/faults/test_elastic_recovery.py holds
    # the exactness against the durable reshard; here, its figures as the Trainer keeps them).
    resumed = NetModule()
    again = _trainer(tmp_path, steps=3, persist_every=5)
    again.fit(resumed, loader(3, 1, 1), ckpt_path="last")
    load = again.strategy.checkpoint_io.last_load
    assert load.tier == "local" and load.step == 2 and load.resharded_from == 2 and load.steps_lost == 0
    assert "resharded from 2 to 1 ranks" in load.reason
    metrics = load.as_metrics()
    assert metrics["checkpoint/recovery/tier"] == 0.0 and metrics["checkpoint/recovery/resharded_from"] == 2.0
    assert again.global_step == 3


def test_marker_of_a_local_tier_checkpoint_names_its_ranks_and_step(tmp_path):
    _trainer(tmp_path, steps=1, persist_every=1).fit(NetModule(), loader(1, 1, 1))
    content = torch.load(tmp_path / "local" / "node0" / "epoch=0-step=1.ckpt", weights_only=True)
    tier = content[MARKER_KEY]["tier"]
    assert tier["ranks"] == [0] and tier["step"] == 1 and tier["replicated"]


def test_persist_every_counts_checkpointed_steps_with_save_last(tmp_path):
    # save_last=True saves twice a step (the step's file and last.ckpt): both count as one, and both persist
    # together, so the durable last.ckpt is always the newest durable step.
    trainer = _trainer(tmp_path, steps=4, persist_every=2, save_last=True)
    trainer.fit(NetModule(), loader(4, 1, 1))
    durable = sorted(p for p in os.listdir(tmp_path / "durable") if p.endswith(".ckpt"))
    assert durable == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    assert torch.load(tmp_path / "durable" / "last.ckpt", weights_only=True)["global_step"] == 4  # the marker
    local = [os.path.basename(p) for p, _ in tier_markers(str(tmp_path / "local" / "node0"))]
    assert "last.ckpt" in local  # every save is on the local tier


def test_a_slow_worker_across_persistence_and_teardown_loses_nothing_and_persists_nothing_twice(tmp_path,
                                                                                                 monkeypatch):
    # Every durable write held back: saves 2 and 4 persist while training goes on, and save 5, local only, is
    # still on the worker when fit ends; the end of fit must wait for it and persist it, once.
    from lightning_zero.checkpoint import saver

    written: list[str] = []
    original = saver._SaveJob.write

    def slow_write(job):
        time.sleep(0.3)
        written.append(os.path.basename(job.loc.url.rstrip("/")))
        return original(job)

    monkeypatch.setattr(saver._SaveJob, "write", slow_write)
    original_run_tier = saver._SaveJob._run_tier

    def slow_tier(job, *args):
        time.sleep(0.2)  # the local phases too: the last save is in flight at teardown
        return original_run_tier(job, *args)

    monkeypatch.setattr(saver._SaveJob, "_run_tier", slow_tier)
    trainer = _trainer(tmp_path, steps=5, persist_every=2, keep=2)
    trainer.fit(NetModule(), loader(5, 1, 1))
    durable = [f"epoch=0-step={s}.ckpt" for s in (2, 4, 5)]
    assert sorted(written) == sorted(durable) and len(written) == len(set(written))  # each once
    assert sorted(p for p in os.listdir(tmp_path / "durable") if p.endswith(".ckpt")) == durable
    for name in durable:
        assert torch.load(tmp_path / "durable" / name, weights_only=True)["global_step"] == int(name[-6])
    local = sorted(os.path.basename(p) for p, _ in tier_markers(str(tmp_path / "local" / "node0")))
    assert local == ["epoch=0-step=4.ckpt", "epoch=0-step=5.ckpt"]  # keep=2


def test_a_local_tier_checkpoint_that_fails_to_load_is_recorded_as_the_durable_one_loaded_instead(tmp_path):
    # Step 3 is on both tiers (the last save of fit is persisted); its local rank file is damaged after the
    # choice is made, so the load fails, the durable step 3 loads, and last_load says so.
    _trainer(tmp_path, steps=3, persist_every=2).fit(NetModule(), loader(5, 1, 1))
    root = tmp_path / "local" / "node0"
    rank_files = [p for p in (root / "_zero_data" / "epoch=0-step=3.ckpt").rglob("*") if p.is_file()
                  and p.stat().st_size > 1000]
    assert rank_files
    for path in rank_files:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    again = _trainer(tmp_path, steps=5, persist_every=2)
    kept = _Metrics()
    again.loggers = [kept]
    with pytest.warns(UserWarning, match="resuming from the durable tier"):
        again.fit(NetModule(), loader(5, 1, 1), ckpt_path="last")
    load = again.strategy.checkpoint_io.last_load
    assert load.tier == "durable" and load.path.startswith(str(tmp_path / "durable")) and load.step == 3, load
    assert "was loaded instead" in load.reason
    # The timeline closes at the first step after the step actually resumed (3), once.
    recovery = [(step, m) for step, m in kept.logged if "checkpoint/recovery/tier" in m]
    assert [(step, m["checkpoint/recovery/tier"]) for step, m in recovery] == [(4, 1.0)]


def test_a_checkpoint_loaded_in_place_of_the_chosen_one_counts_its_steps_lost_from_itself():
    from lightning_zero.checkpoint.lightning.resume import as_loaded
    from lightning_zero.checkpoint.tiered.recovery import TierChoice

    chosen = TierChoice("/tier/step=8.ckpt", "local", "/durable/step=5.ckpt", "local tier: newest", step=8,
                        resharded_from=4, steps_lost=1)
    assert as_loaded(chosen, chosen.path, {"global_step": 8}) is chosen
    fell_back = as_loaded(chosen, "/durable/step=5.ckpt", {"global_step": 5})
    assert (fell_back.tier, fell_back.path, fell_back.step, fell_back.steps_lost, fell_back.resharded_from) == (
        "durable", "/durable/step=5.ckpt", 5, 4, None)
    unknown = as_loaded(chosen, "/durable/other.ckpt", {})
    assert unknown.step is None and unknown.steps_lost == 1


def test_the_collector_is_paused_for_the_durable_phase_of_a_tiered_save_only(tmp_path, monkeypatch):
    # [Note: the collector and a save's objects] in checkpoint/saver.py: the local tier keeps its staged copy between
    # saves and its replication may wait long on peers, so only the durable write runs with the collector paused.
    import gc

    from lightning_zero.checkpoint.saver import _SaveJob
    from lightning_zero.checkpoint.tiered.tiers import TierSave

    seen: list[tuple[str, bool]] = []
    run_local, write = TierSave.run_local, _SaveJob.write
    monkeypatch.setattr(TierSave, "run_local", lambda self, *a: (seen.append(("local", gc.isenabled())),
                                                                 run_local(self, *a))[1])
    monkeypatch.setattr(_SaveJob, "write", lambda self: (seen.append(("durable", gc.isenabled())), write(self))[1])
    _trainer(tmp_path, steps=2, persist_every=2).fit(NetModule(), loader(2, 1, 1))
    assert ("local", True) in seen and ("durable", False) in seen and ("durable", True) not in seen
    assert gc.isenabled()
