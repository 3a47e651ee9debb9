"""One replica group of a fault-tolerant job: run under torchrun (``--nproc-per-node K``) with
``REPLICA_GROUP_ID``, ``TORCHFT_LIGHTHOUSE`` and ``FT_OUT`` set. Each rank appends one JSON line per
optimizer step to ``FT_OUT/g<group>_r<rank>.jsonl``: the trainer's step, the fault-tolerance report and
a digest of this rank's master shards and optimizer state (the same group rank holds the same shard in
every group, so equal digests mean bit-identical state).

``FT_DIE_IN_ALLREDUCE_AT=N``: at trainer step N this group dies inside the cross-group all-reduce (its
first rank SIGKILLs the group's agent, its workers and itself right after launching its first bucket's hop).
``FT_CKPT_DIR``: a sharded checkpoint every 5 steps (and ``last``) there, which one group writes.

``FT_HEAL_SLEEP=S``: a heal this group receives sleeps S seconds before it loads the state (after writing
``FT_OUT/healing_g<group>_r<rank>``: the time); ``FT_SERVE_SLEEP=S``: a heal this group serves sleeps S seconds
before it hands its state to torchft (after writing ``FT_OUT/serving_g<group>_r<rank>``). A heal takes ~0.1 s;
these give a test the time to kill a group in the middle of one.

``FT_PHASES=1``: each rank also writes ``FT_OUT/phases_g<group>_r<rank>.json``, the mean seconds per step (past
``FT_PHASES_WARMUP`` steps, 10 by default) of the step and of the cross-group phases inside it (bench/fault_tolerance.py's
breakdown).

``FT_HYBRID=1`` runs the same model and data as one job without fault tolerance, hybrid-sharded over
groups of K ranks (``FT_GROUPS`` x K processes, ``shard_group_size=K``): the reference a fault-tolerant
run with no failure must match. ``FT_STEP_SLEEP`` slows each step so a test can kill a group mid-run."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_zero import FaultTolerance, ZeroLowLevelStrategy

STEPS = int(os.environ.get("FT_STEPS", "30"))
BATCH = 4


class Numbers(Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        g = torch.Generator().manual_seed(index)
        x = torch.randn(8, generator=g)
        return x, x.sum(0, keepdim=True).tanh(), index


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        width = int(os.environ.get("FT_WIDTH", "0"))  # FT_WIDTH: a model with compute (the step-time benchmark)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)) if not width else nn.Sequential(
            nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        delay = float(os.environ.get("FT_STEP_SLEEP", "0"))
        if delay:
            time.sleep(delay)
        x, y, _ = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.last_loss = float(loss.detach())
        self.log("step", float(self.trainer.global_step))
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def engine_digest(engine) -> str:  # noqa: ANN001
    h = hashlib.sha256()
    for sp in engine.sharded_params.values():
        h.update(sp.master.detach().numpy().tobytes())
        for key, value in sorted(engine.optimizers[0].state.get(sp.master, {}).items()):
            h.update(key.encode())
            h.update(value.detach().reshape(-1).numpy().tobytes())
    return h.hexdigest()[:16]


class Report(L.Callback):
    def __init__(self, out: Path, group: int, group_size: int) -> None:
        self.out, self.group, self.group_size = out, group, group_size

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Model, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        line = report_line(trainer.strategy, trainer.global_step, pl_module.last_loss,
                           trainer.optimizers[0].param_groups[0]["lr"], trainer.strategy.engine)
        ft = trainer.strategy._replica_groups  # the step's place across the groups (None: it contributed nothing)
        place = ft.groups.data_quorum.place if ft is not None else None
        line.update(epoch=trainer.current_epoch, samples=batch[2].tolist(), place=place)
        path = self.out / f"g{self.group}_r{trainer.global_rank % self.group_size}.jsonl"
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def report_line(strategy, step: int, loss: float, lr: float, engine) -> dict:  # noqa: ANN001
    ft = strategy.fault_tolerance
    line = {"t": time.time(), "pid": os.getpid(), "global_step": step, "lr": lr, "loss": loss,
            "digest": engine_digest(engine)}
    if ft is not None:
        line.update(committed=ft.committed, participants=ft.participants, heals=ft.heals,
                    last_heal_s=ft.last_heal_s, last_stall_s=ft.last_stall_s)
    return line


def fabric_main(out: Path, group: int, world: int, rank: int) -> None:
    """The same job as a Fabric loop, written as a user writes it: the loader through ``fabric.setup_dataloaders``
    (its sampler, with fault tolerance, the epoch's order across the groups by committed steps), the loop stopped by
    the job's committed steps. Each step reports what the Trainer's job reports: its samples, epoch and place."""
    from lightning_zero.fabric import ZeroLowLevelStrategy as FabricZero

    ft = FaultTolerance(replica_group_id=group, timeout_s=float(os.environ.get("FT_TIMEOUT", "3")))
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=FabricZero(stage=2, fault_tolerance=ft))
    fabric.launch()
    torch.manual_seed(0)
    module = Model()
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    loader = fabric.setup_dataloaders(DataLoader(Numbers(), batch_size=BATCH, shuffle=True))
    engine = fabric.strategy.engine_of(model)
    while ft.steps < STEPS:  # the job's committed steps, carried by a heal
        for x, y, index in loader:  # the rest of the epoch the sampler is in, as a heal carries it
            if os.environ.get("FT_STEP_SLEEP"):
                time.sleep(float(os.environ["FT_STEP_SLEEP"]))
            loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            line = report_line(fabric.strategy, ft.steps, float(loss.detach()), optimizer.param_groups[0]["lr"], engine)
            place = fabric.strategy._replica_groups.data_quorum.place  # None: this step contributed nothing
            line.update(epoch=loader.sampler.epoch, samples=index.tolist(), place=place)
            with open(out / f"g{group}_r{rank}.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
            if ft.steps >= STEPS:
                break
    fabric.strategy.teardown()


def die_inside_the_cross_group_all_reduce(at_step: int, groups: int, trainer_of: list) -> None:  # noqa: ANN001
    """Patch ReplicaGroups.all_reduce: in the first step past ``at_step`` that follows a step all ``groups`` took part
    in, rank 0 launches its first bucket's hop, then kills its whole group (its agent, its workers, itself)."""
    import signal

    from lightning_zero.engine.fault_tolerance import ReplicaGroups

    original = ReplicaGroups.all_reduce

    def all_reduce(self, tensor):  # noqa: ANN001, ANN202
        work = original(self, tensor)
        trainer = trainer_of[0]
        ft = trainer.strategy.fault_tolerance
        if (trainer.global_step >= at_step and ft.committed and ft.participants == groups
                and trainer.global_rank == 0):
            agent = os.getppid()
            for entry in os.listdir("/proc"):
                if entry.isdigit() and int(entry) != os.getpid():
                    try:
                        stat = Path(f"/proc/{entry}/stat").read_text()
                    except OSError:
                        continue
                    if int(stat.rsplit(")", 1)[1].split()[1]) == agent:
                        os.kill(int(entry), signal.SIGKILL)
            os.kill(agent, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return work

    ReplicaGroups.all_reduce = all_reduce


def slow_heals(out: Path, group: int, rank: int) -> None:
    """``FT_HEAL_SLEEP`` / ``FT_SERVE_SLEEP`` (module docstring): patch ReplicaGroups.register_state so that the
    engine's state is loaded (healer) or handed out (source) only after a marker file and a sleep."""
    from lightning_zero.engine.fault_tolerance import ReplicaGroups

    heal_sleep = float(os.environ.get("FT_HEAL_SLEEP", "0"))
    serve_sleep = float(os.environ.get("FT_SERVE_SLEEP", "0"))
    original = ReplicaGroups.register_state

    def register_state(self, key, save, load):  # noqa: ANN001, ANN202
        if key != "engine":
            return original(self, key, save, load)

        def slow_save():  # noqa: ANN202
            if serve_sleep:
                (out / f"serving_g{group}_r{rank}").write_text(str(time.time()))
                time.sleep(serve_sleep)
            return save()

        def slow_load(state):  # noqa: ANN001, ANN202
            if heal_sleep:
                (out / f"healing_g{group}_r{rank}").write_text(str(time.time()))
                time.sleep(heal_sleep)
            load(state)

        return original(self, key, slow_save, slow_load)

    ReplicaGroups.register_state = register_state


class Phases(L.Callback):
    """Where a step's time goes: wall-clock seconds in each timed phase, summed over the steps past ``warmup`` (a
    step runs from one ``on_train_batch_start`` to the next, so the loop's own work between steps counts)."""

    def __init__(self, path: Path, warmup: int) -> None:
        self.path, self.warmup = path, warmup
        self.totals: dict[str, float] = {}
        self.steps = 0
        self.counting = False
        self.step_started: float | None = None

    def timed(self, owner: type, name: str, phase: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if self.counting:
                    self.totals[phase] = self.totals.get(phase, 0.0) + time.perf_counter() - started

        setattr(owner, name, wrapper)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Model, batch, batch_idx) -> None:  # noqa: ANN001
        now = time.perf_counter()
        if self.counting and self.step_started is not None:
            self.totals["step"] = self.totals.get("step", 0.0) + now - self.step_started
            self.steps += 1
        self.counting = trainer.global_step >= self.warmup
        self.step_started = now

    def on_train_end(self, trainer: L.Trainer, pl_module: Model) -> None:
        steps = max(self.steps, 1)
        self.path.write_text(json.dumps({"steps": self.steps, **{k: v / steps for k, v in self.totals.items()}}))


def time_phases(phases: Phases, hybrid: bool) -> None:
    """Time the engine's backward and optimizer step, and with fault tolerance the cross-group phases:
    ``quorum`` (the first reduction waiting for the quorum and launching what it launches), ``hop_wait`` (waiting
    for the buckets' cross-group sums), ``commit`` (the decision: should_commit's round trip inside it)."""
    from lightning_zero.engine.grad_reducer import GradReducer
    from lightning_zero.engine.optimizer import ZeroOptimizer

    phases.timed(GradReducer, "finish_backward", "finish_backward")
    phases.timed(ZeroOptimizer, "step", "optimizer_step")
    if hybrid:
        return
    from torchft.manager import Manager

    from lightning_zero import fault_tolerance

    phases.timed(fault_tolerance.ReplicaGroups, "before_reduction", "quorum")
    phases.timed(fault_tolerance._CrossGroupSum, "wait", "hop_wait")
    phases.timed(fault_tolerance.ReplicaGroups, "commit", "commit")
    phases.timed(Manager, "should_commit", "should_commit")


def main() -> None:
    torch.set_num_threads(1)
    out = Path(os.environ["FT_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    hybrid = os.environ.get("FT_HYBRID") == "1"
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    groups = int(os.environ.get("FT_GROUPS", "2"))
    if os.environ.get("FT_HEAL_SLEEP") or os.environ.get("FT_SERVE_SLEEP"):
        slow_heals(out, group, rank)
    if os.environ.get("FT_FABRIC") == "1":
        fabric_main(out, group, world, rank)
        return
    if hybrid:
        k = world // groups
        strategy = ZeroLowLevelStrategy(stage=2, shard_group_size=k)
    else:
        k = world
        ft = FaultTolerance(replica_group_id=group, timeout_s=float(os.environ.get("FT_TIMEOUT", "3")),
                            quorum_timeout_s=float(os.environ.get("FT_QUORUM_TIMEOUT", "60")))
        strategy = ZeroLowLevelStrategy(stage=2, fault_tolerance=ft)
    torch.manual_seed(0)
    model = Model()
    # Lightning's own sampler (shuffled), which the strategy replaces: one ElasticDistributedSampler over the
    # hybrid job's ranks, or across the groups by committed steps (ReplicaGroupSampler) with fault tolerance.
    loader = DataLoader(Numbers(), batch_size=BATCH, shuffle=True)
    callbacks: list = [Report(out, group if not hybrid else rank // k, k)]
    plugins = []
    if os.environ.get("FT_CKPT_DIR"):
        from lightning.pytorch.callbacks import ModelCheckpoint

        from lightning_zero import ZeroCheckpointIO

        callbacks.append(ModelCheckpoint(dirpath=os.environ["FT_CKPT_DIR"], every_n_train_steps=5, save_last=True,
                                         save_top_k=1, monitor="step", mode="max"))
        plugins.append(ZeroCheckpointIO(mode="sharded"))
    if os.environ.get("FT_PHASES") == "1":
        phases = Phases(out / f"phases_g{group if not hybrid else rank // k}_r{rank % k}.json",
                        int(os.environ.get("FT_PHASES_WARMUP", "10")))
        time_phases(phases, hybrid)
        callbacks.append(phases)
    trainer = L.Trainer(accelerator="cpu", devices=world, plugins=plugins,
                        strategy=strategy, max_steps=STEPS, logger=False, enable_checkpointing=bool(plugins),
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    if os.environ.get("FT_DIE_IN_ALLREDUCE_AT"):
        die_inside_the_cross_group_all_reduce(int(os.environ["FT_DIE_IN_ALLREDUCE_AT"]), groups, [trainer])
    trainer.fit(model, loader)


if __name__ == "__main__":
    main()
