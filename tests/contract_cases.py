"""Lightning's own contracts, run the same way under ``ddp`` and under ZeRO (tests/lightning/test_lightning_contracts.py).

Each function runs on every rank of a gloo group (tests/_dist.py) and returns what the test compares:
the same function with ``strategy="ddp"`` is the reference, as Lightning's own tests hold DDP to it.
"""

from __future__ import annotations

from typing import Any

import torch
from lifecycle_cases import EvalNet, as_torchrun
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging
from lightning.pytorch.strategies import DDPStrategy
from lightning_cases import loader

from lightning_zero import ZeroLowLevelStrategy
from lightning_zero.checkpoint import ZeroCheckpointIO, read_lightning_checkpoint


def make_trainer(world_size: int, strategy: str, root: str, *, mode: str = "sharded", max_steps: int = 4,
                 max_epochs: int | None = None, callbacks: list[Callback] | None = None, stage: int = 2,
                 **zero_options: Any) -> Trainer:
    """``strategy``: "ddp" (the reference) or "zero" (ZeroLowLevelStrategy with ZeroCheckpointIO(mode))."""
    if strategy == "ddp":
        chosen: Any = DDPStrategy(find_unused_parameters=True)
        plugins: list[Any] = []
    else:
        chosen = ZeroLowLevelStrategy(stage=stage, bucket_size_mb=0.0005, **zero_options)  # type: ignore[arg-type]
        plugins = [ZeroCheckpointIO(mode=mode)]  # type: ignore[arg-type]
    callbacks = callbacks or []
    return Trainer(
        accelerator="cpu", devices=world_size, strategy=chosen, plugins=plugins, callbacks=callbacks,
        max_steps=max_steps if max_epochs is None else -1, max_epochs=max_epochs, logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        use_distributed_sampler=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root if "://" not in root else None, num_sanity_val_steps=0,
    )


def _weights(module: LightningModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class WritesWeights(EvalNet):
    """Writes weights into the module where users and callbacks do, three different ways.

    ``on_train_start``: ``p.copy_`` (moves the autograd version); at the start of batch 2:
    ``load_state_dict`` (the same); at the start of batch 3: an in-place clamp; in ``on_train_end``: a
    write through ``.data`` (moves no version), as Lightning's EMA callback writes."""

    def __init__(self, lr: float) -> None:
        super().__init__(optimizer="sgd")
        self.lr = lr

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    @torch.no_grad()
    def on_train_start(self) -> None:
        self.net.hidden.weight.copy_(torch.full_like(self.net.hidden.weight, 0.25))
        self.net.frozen.weight.copy_(torch.full_like(self.net.frozen.weight, -0.5))  # frozen: checkpointed

    @torch.no_grad()
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 2:
            state = self.state_dict()
            state["net.head.bias"] = torch.arange(state["net.head.bias"].numel(), dtype=torch.float32)
            self.load_state_dict(state)
        if batch_idx == 3:
            self.net.embed.bias.clamp_(0.75, 0.75)  # WGAN-style clipping, in place

    @torch.no_grad()
    def on_train_end(self) -> None:
        self.net.scale.data.fill_(2.5)  # after the last step: only the checkpoint after fit shows it


def written_weights(rank: int, world_size: int, root: str, strategy: str, lr: float, mode: str) -> dict[str, Any]:
    """Fit :class:`WritesWeights` for 4 steps, save after fit; the weights and what the save holds."""
    as_torchrun(rank, world_size)
    module = WritesWeights(lr)
    trainer = make_trainer(world_size, strategy, root, mode=mode)
    trainer.fit(module, loader(4, 1, world_size))
    path = f"{root}/{strategy}-{mode}-after-fit.ckpt"
    trainer.save_checkpoint(path)
    torch.distributed.barrier()
    saved = read_lightning_checkpoint(path, optimizer=False)["state_dict"] if rank == 0 else {}
    return {"weights": _weights(module), "saved": saved}


def swa_run(rank: int, world_size: int, root: str, strategy: str, mode: str) -> dict[str, Any]:
    """StochasticWeightAveraging over 4 epochs (averaging from epoch 2): the weights after fit, the
    ModelCheckpoint of the last epoch and the save after fit, as Lightning's SWA tests read them."""
    as_torchrun(rank, world_size)
    module = EvalNet(optimizer="sgd")
    checkpoint = ModelCheckpoint(dirpath=f"{root}/{strategy}-{mode}", filename="{epoch}", save_top_k=-1)
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=1)
    trainer = make_trainer(world_size, strategy, root, mode=mode, max_epochs=4, callbacks=[swa, checkpoint])
    trainer.fit(module, loader(2, 1, world_size))
    after_fit = f"{root}/{strategy}-{mode}/after-fit.ckpt"
    trainer.save_checkpoint(after_fit)
    torch.distributed.barrier()
    result: dict[str, Any] = {"weights": _weights(module)}
    if rank == 0:
        result["after_fit"] = read_lightning_checkpoint(after_fit, optimizer=False)["state_dict"]
        last_epoch = f"{root}/{strategy}-{mode}/epoch=3.ckpt"
        result["last_epoch"] = read_lightning_checkpoint(last_epoch, optimizer=False)["state_dict"]
        restored = EvalNet.load_from_checkpoint(after_fit, map_location="cpu") if mode == "full" else None
        result["load_from_checkpoint"] = _weights(restored) if restored is not None else None
    return result


class NoOptimizer(EvalNet):
    def configure_optimizers(self) -> None:
        return None


def no_optimizer_fit(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """``configure_optimizers`` returning None: fit runs (Lightning warns), nothing changes."""
    as_torchrun(rank, world_size)
    module = NoOptimizer()
    before = _weights(module)
    trainer = make_trainer(world_size, "zero", root, max_steps=3)
    trainer.fit(module, loader(3, 1, world_size))
    return {"before": before, "after": _weights(module), "global_step": trainer.global_step}


def repeated_fits_groups(rank: int, world_size: int, root: str) -> list[int]:
    """The number of process groups this process knows after each of three fits of one Trainer."""
    from torch.distributed import distributed_c10d as c10d

    as_torchrun(rank, world_size)
    counts = [len(c10d._world.pg_map)]
    module = EvalNet()
    for _ in range(3):
        trainer = make_trainer(world_size, "zero", root, max_steps=2)
        trainer.fit(module, loader(2, 1, world_size))
        counts.append(len(c10d._world.pg_map))
    return counts


def fit_from_a_save_outside_fit(rank: int, world_size: int, root: str, mode: str) -> dict[str, Any]:
    """``validate`` (no fit yet), ``save_checkpoint``, then ``fit(ckpt_path=...)`` of a fresh module on a
    fresh Trainer: the fit starts from the saved weights (Lightning's models/test_restore.py)."""
    as_torchrun(rank, world_size)
    module = EvalNet()
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(-2.0)  # not the weights a fresh EvalNet has
    saved = _weights(module)
    trainer = make_trainer(world_size, "zero", root, mode=mode)
    trainer.validate(module, loader(1, 1, world_size), verbose=False)
    path = f"{root}/after-validate-{mode}.ckpt"
    trainer.save_checkpoint(path)

    class StartWeights(Callback):
        def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
            self.weights = _weights(pl_module)

    start = StartWeights()
    resumed = EvalNet()
    trainer = make_trainer(world_size, "zero", root, mode=mode, max_steps=1, callbacks=[start])
    trainer.fit(resumed, loader(1, 1, world_size), ckpt_path=path)
    return {"saved": saved, "start": start.weights}


def versioned_names(rank: int, world_size: int, root: str, strategy: str, mode: str) -> dict[str, Any]:
    """ModelCheckpoint with one file name, saving every step and keeping all (save_top_k=-1): it must pick
    ``-vN`` names that no other save of the run uses (Lightning's test_ckpt_version_after_rerun_same_trainer).
    The names it kept, and the global step each file holds."""
    as_torchrun(rank, world_size)
    directory = f"{root}/{strategy}-{mode}"
    checkpoint = ModelCheckpoint(dirpath=directory, filename="test", save_top_k=-1, every_n_train_steps=1,
                                 monitor="step", mode="max")
    module = EvalNet()
    module.training_step = _logs_step(module.training_step)  # type: ignore[method-assign]
    trainer = make_trainer(world_size, strategy, root, mode=mode, callbacks=[checkpoint])
    trainer.fit(module, loader(4, 1, world_size))
    torch.distributed.barrier()
    names = sorted(path.rsplit("/", 1)[-1] for path in checkpoint.best_k_models)
    steps = {name: read_lightning_checkpoint(f"{directory}/{name}", optimizer=False)["global_step"] for name in names} \
        if rank == 0 else {}
    return {"names": names, "steps": steps}


def _logs_step(training_step: Any) -> Any:
    def step(batch: Any, batch_idx: int) -> Any:
        loss = training_step(batch, batch_idx)
        training_step.__self__.log("step", float(training_step.__self__.global_step))
        return loss
    return step


def uninterrupted_then_resumed(run: Any, rank: int, saved: str) -> tuple[dict[str, torch.Tensor],
                                                                         dict[str, torch.Tensor], dict[str, Any]]:
    """``run(None)`` (which saves ``saved`` on the way), then ``run(saved)`` in a fresh Trainer; the weights
    of both and, on rank 0, what ``saved`` holds (read whole, weights only)."""
    uninterrupted = run(None)
    torch.distributed.barrier()
    content = read_lightning_checkpoint(saved, optimizer=False) if rank == 0 else {}
    return uninterrupted, run(saved), content


def ema_run(rank: int, world_size: int, root: str, strategy: str, mode: str) -> dict[str, Any]:
    """EMAWeightAveraging (Lightning's weight_averaging tests): 4 steps saving at steps 2 and 4, then a
    fresh Trainer resumed from step 2 to step 4. What the step-2 checkpoint holds, the weights of both
    runs."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    as_torchrun(rank, world_size)
    directory = f"{root}/{strategy}-{mode}-ema"

    def run(ckpt_path: str | None) -> dict[str, torch.Tensor]:
        module = EvalNet()
        checkpoint = ModelCheckpoint(dirpath=directory if ckpt_path is None else f"{directory}-resumed",
                                     filename="{step}", every_n_train_steps=2, save_top_k=-1)
        trainer = make_trainer(world_size, strategy, root, mode=mode, callbacks=[EMAWeightAveraging(decay=0.5),
                                                                                checkpoint])
        trainer.fit(module, loader(4, 1, world_size), ckpt_path=ckpt_path)
        return _weights(module)

    uninterrupted, resumed, saved = uninterrupted_then_resumed(run, rank, f"{directory}/step=2.ckpt")
    return {"uninterrupted": uninterrupted, "resumed": resumed,
            "saved_state_dict": saved.get("state_dict"), "saved_current": saved.get("current_model_state")}


class Adapted(LightningModule):
    """A frozen base (the engine cases' Net, in no optimizer) under a trainable adapter: the LoRA habit of
    dropping the base from every checkpoint in ``on_save_checkpoint`` and loading with
    ``strict_loading = False`` (``drop_base``), or the strategy's ``exclude_frozen_parameters``."""

    def __init__(self, drop_base: bool, extra_head: bool = False) -> None:
        super().__init__()
        from engine_cases import initial_model

        self.net = initial_model()
        self.net.requires_grad_(False)
        torch.manual_seed(7)
        self.adapter = torch.nn.Linear(7, 7)
        self.extra = torch.nn.Linear(7, 7) if extra_head else None  # a head the checkpoint lacks
        self.drop_base = drop_base
        self.strict_loading = not drop_base

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        from lightning_cases import local_slice

        x, y = local_slice(self, batch)
        h = self.net(x)
        out = h + self.adapter(h) + (self.extra(h) if self.extra is not None else 0.0)
        return torch.nn.functional.mse_loss(out, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.01)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.drop_base:
            for key in [k for k in checkpoint["state_dict"] if k.startswith("net.")]:
                del checkpoint["state_dict"][key]


def adapter_run(rank: int, world_size: int, root: str, mode: str, how: str) -> dict[str, Any]:
    """``how``: "hook" (on_save_checkpoint drops the base, strict_loading=False) or "exclude"
    (ZeroLowLevelStrategy(exclude_frozen_parameters=True), strict loading). 2 epochs of 2 steps saving
    at each epoch's end; a fresh module resumed from the first epoch's; the keys saved."""
    as_torchrun(rank, world_size)
    directory = f"{root}/adapter-{mode}-{how}"

    def run(ckpt_path: str | None) -> dict[str, torch.Tensor]:
        module = Adapted(drop_base=how == "hook")
        checkpoint = ModelCheckpoint(dirpath=directory if ckpt_path is None else f"{directory}-resumed",
                                     filename="{epoch}", save_top_k=-1)
        trainer = make_trainer(world_size, "zero", root, mode=mode, max_epochs=2, callbacks=[checkpoint])
        trainer.strategy.exclude_frozen_parameters = how == "exclude"
        trainer.fit(module, loader(2, 1, world_size), ckpt_path=ckpt_path)
        return _weights(module)

    uninterrupted, resumed, saved = uninterrupted_then_resumed(run, rank, f"{directory}/epoch=0.ckpt")
    return {"uninterrupted": uninterrupted, "resumed": resumed, "saved_keys": sorted(saved.get("state_dict", {}))}


def new_head_resume(rank: int, world_size: int, root: str, mode: str, strict: bool) -> dict[str, Any]:
    """Resume a module that has a head the checkpoint lacks: the error with strict loading, the head's
    own weights kept without it."""
    as_torchrun(rank, world_size)
    path = f"{root}/plain-{mode}.ckpt"
    trainer = make_trainer(world_size, "zero", root, mode=mode, max_steps=1)
    trainer.fit(Adapted(drop_base=False), loader(1, 1, world_size))
    trainer.save_checkpoint(path)
    module = Adapted(drop_base=False, extra_head=True)
    module.strict_loading = strict
    extra_before = _weights(module.extra)  # type: ignore[arg-type]
    trainer = make_trainer(world_size, "zero", root, mode=mode, max_steps=2)
    try:
        trainer.fit(module, loader(2, 1, world_size), ckpt_path=path)
    except Exception as exc:  # the strict case: every rank raises
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None, "extra_before": extra_before, "global_step": trainer.global_step}


class GroupNames(Callback):
    """What BaseFinetuning and other callbacks do with the optimizer: map its parameters to names."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        names = {p: n for n, p in pl_module.named_parameters()}
        self.names = [[names[p] for p in group["params"]] for group in trainer.optimizers[0].param_groups]


def optimizer_views(rank: int, world_size: int, root: str, strategy: str) -> dict[str, Any]:
    """Param-group names as callbacks see them, and the weights after 4 steps clipped by value
    (``gradient_clip_algorithm="value"``, a bound small enough to clip)."""
    as_torchrun(rank, world_size)
    probe = GroupNames()
    module = EvalNet(optimizer="sgd")
    trainer = make_trainer(world_size, strategy, root, callbacks=[probe])
    trainer.gradient_clip_val = 0.002
    trainer.gradient_clip_algorithm = "value"
    trainer.fit(module, loader(4, 1, world_size))
    return {"names": probe.names, "weights": _weights(module)}


class Backbone(EvalNet):
    """BackboneFinetuning's contract: a ``backbone`` attribute, the rest trained from the start."""

    def __init__(self, filter_trainable: bool) -> None:
        super().__init__()
        self.backbone = self.net.embed
        self.filter_trainable = filter_trainable

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad or not self.filter_trainable]
        return torch.optim.SGD(params, lr=0.1)


def finetuning_run(rank: int, world_size: int, root: str, filter_trainable: bool, stage: int) -> dict[str, Any]:
    """Lightning's BaseFinetuning: the backbone frozen before training, unfrozen at epoch 1 with
    ``unfreeze_and_add_param_group`` (lr 0.05). ``filter_trainable``: configure_optimizers leaves the frozen
    backbone out, so the callback adds it (``add_param_group``); otherwise the optimizer holds it from the
    start and unfreezing only turns requires_grad on. The weights after 2 epochs of 2 steps."""
    from lightning.pytorch.callbacks import BaseFinetuning

    class Unfreeze(BaseFinetuning):
        def freeze_before_training(self, pl_module: LightningModule) -> None:
            self.freeze(pl_module.backbone)

        def finetune_function(self, pl_module: LightningModule, epoch: int, optimizer: Any) -> None:
            if epoch == 1:
                self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=0.05)

    as_torchrun(rank, world_size)
    module = Backbone(filter_trainable)
    trainer = make_trainer(world_size, "zero", root, max_epochs=2, callbacks=[Unfreeze()], stage=stage)
    trainer.fit(module, loader(2, 1, world_size))
    return _weights(module)


def finetuning_reference(world_size: int, filter_trainable: bool) -> dict[str, torch.Tensor]:
    """:func:`finetuning_run` in one plain PyTorch process on the same global batches."""
    import torch.nn.functional as F
    from engine_cases import global_batch

    module = Backbone(filter_trainable)
    module.backbone.requires_grad_(False)
    optimizer = module.configure_optimizers()
    for epoch in range(2):
        if epoch == 1:
            module.backbone.requires_grad_(True)
            if filter_trainable:
                optimizer.add_param_group({"params": list(module.backbone.parameters()), "lr": 0.05})
        for step in range(2):
            x, y = global_batch(step, 0, world_size)
            loss = sum(F.mse_loss(module.net(xs), ys) for xs, ys in zip(x.chunk(world_size), y.chunk(world_size)))
            optimizer.zero_grad()
            (loss / world_size).backward()
            optimizer.step()
    return _weights(module)


class GradNorms(Callback):
    """Lightning's documented gradient-norm logging in ``on_before_optimizer_step``: its ``grad_norm``
    under ddp, the strategy's under ZeRO (Lightning's reads ``param.grad``, which ZeRO does not keep)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []
        self.lightning: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        from lightning.pytorch.utilities import grad_norm

        self.lightning.append(grad_norm(pl_module, norm_type=2))
        ours = getattr(trainer.strategy, "grad_norm", None)
        self.steps.append(ours(2) if ours is not None else self.lightning[-1])


def gradient_norms(rank: int, world_size: int, root: str, strategy: str, stage: int,
                   full_gradients: bool = False) -> dict[str, Any]:
    as_torchrun(rank, world_size)
    probe = GradNorms()
    options = {"full_gradients": True} if full_gradients else {}
    trainer = make_trainer(world_size, strategy, root, max_steps=3, callbacks=[probe], stage=stage, **options)
    module = EvalNet()
    trainer.fit(module, loader(3, 1, world_size))
    return {"norms": [{k: float(v) for k, v in step.items()} for step in probe.steps],
            "lightning": [{k: float(v) for k, v in step.items()} for step in probe.lightning],
            "weights": _weights(module)}


class SWAWithLambda(EvalNet):
    """Lightning's test_swa_resume_training_from_checkpoint_custom_scheduler: a LambdaLR of the module's own."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 0.9 ** e)}


def swa_resume(rank: int, world_size: int, root: str, strategy: str, mode: str) -> dict[str, Any]:
    """StochasticWeightAveraging from epoch 1 over 4 epochs with a LambdaLR; the run resumed from the
    epoch-2 checkpoint (after SWA took the scheduler over) ends with the uninterrupted run's weights."""
    as_torchrun(rank, world_size)
    directory = f"{root}/{strategy}-{mode}-swa-resume"

    def run(ckpt_path: str | None) -> dict[str, torch.Tensor]:
        checkpoint = ModelCheckpoint(dirpath=directory if ckpt_path is None else f"{directory}-resumed",
                                     filename="{epoch}", save_top_k=-1)
        swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1, annealing_epochs=1)
        trainer = make_trainer(world_size, strategy, root, mode=mode, max_epochs=4, callbacks=[swa, checkpoint])
        module = SWAWithLambda()
        trainer.fit(module, loader(2, 1, world_size), ckpt_path=ckpt_path)
        return _weights(module)

    uninterrupted, resumed, _ = uninterrupted_then_resumed(run, rank, f"{directory}/epoch=2.ckpt")
    return {"uninterrupted": uninterrupted, "resumed": resumed}


def threads_after_fit(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """The package's threads after a fit that saved asynchronously (none may be left), and whether a save
    after fit still works (it makes what it needs again)."""
    import threading

    as_torchrun(rank, world_size)
    checkpoint = ModelCheckpoint(dirpath=f"{root}/threads", every_n_train_steps=1, save_top_k=-1)
    trainer = make_trainer(world_size, "zero", root, max_steps=2, callbacks=[checkpoint])
    trainer.fit(EvalNet(), loader(2, 1, world_size))
    left = sorted(t.name for t in threading.enumerate() if t.name.startswith("lightning_zero"))
    trainer.save_checkpoint(f"{root}/after-fit.ckpt")
    left_by_save = sorted(t.name for t in threading.enumerate() if t.name.startswith("lightning_zero"))
    torch.distributed.barrier()
    saved = read_lightning_checkpoint(f"{root}/after-fit.ckpt", optimizer=False)["global_step"] if rank == 0 else 2
    return {"threads": left, "threads_after_save": left_by_save, "saved_step": saved}


class Migrating(EvalNet):
    """A module whose layers were renamed since the checkpoint (``net`` is now ``body``), migrating old
    checkpoints in ``on_load_checkpoint`` as Lightning documents; ``edit`` says what else the hook does."""

    def __init__(self, edit: str = "rename") -> None:
        super().__init__()
        self.body = self.net
        del self.net
        self.edit = edit
        self.strict_loading = edit != "drop"

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        from lightning_cases import local_slice

        x, y = local_slice(self, batch)
        return torch.nn.functional.mse_loss(self.body(x), y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        from engine_cases import make_optimizer

        return make_optimizer(self.optimizer_name, self.body)  # the groups EvalNet's checkpoint has

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state_dict = checkpoint["state_dict"]
        for key in [k for k in state_dict if k.startswith("net.")]:
            state_dict["body." + key.removeprefix("net.")] = state_dict.pop(key)
        if self.edit == "drop":
            del state_dict["body.head.bias"]
        if self.edit == "compute":
            state_dict["body.head.bias"] = state_dict["body.head.bias"] * 0.0


class StartWeights(Callback):
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.weights = _weights(pl_module)


def migrate_on_load(rank: int, world_size: int, root: str, mode: str, edit: str) -> dict[str, Any]:
    """Fit EvalNet 2 steps and save; then fit and validate a :class:`Migrating` module from that checkpoint.
    The saved weights, the migrated module's weights at the start of its fit and after validate, or the
    error every rank raised."""
    as_torchrun(rank, world_size)
    path = f"{root}/old-{mode}.ckpt"
    trainer = make_trainer(world_size, "zero", root, mode=mode, max_steps=2)
    old = EvalNet()
    trainer.fit(old, loader(2, 1, world_size))
    trainer.save_checkpoint(path)
    saved = {"body." + k.removeprefix("net."): v for k, v in _weights(old).items()}
    start = StartWeights()
    migrated = Migrating(edit)
    own = _weights(migrated)
    trainer = make_trainer(world_size, "zero", root, mode=mode, max_steps=3, callbacks=[start])
    try:
        trainer.fit(migrated, loader(3, 1, world_size), ckpt_path=path)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    evaluated = Migrating(edit)
    trainer = make_trainer(world_size, "zero", root, mode=mode)
    trainer.validate(evaluated, loader(1, 1, world_size), ckpt_path=path, verbose=False)
    return {"error": None, "saved": saved, "own": own, "start": start.weights, "validated": _weights(evaluated)}


def adapter_epochs(rank: int, world_size: int, root: str, mode: str, epochs: int, ckpt_path: str | None) -> Any:
    """:class:`Adapted` (the base dropped from checkpoints in its hook) fit to ``epochs`` epochs of 2 steps at
    this world size, saving every epoch under ``root``; the weights afterwards."""
    as_torchrun(rank, world_size)
    checkpoint = ModelCheckpoint(dirpath=f"{root}/adapter-epochs", filename="{epoch}", save_top_k=-1)
    module = Adapted(drop_base=True)
    trainer = make_trainer(world_size, "zero", root, mode=mode, max_epochs=epochs, callbacks=[checkpoint])
    trainer.fit(module, loader(2, 1, world_size), ckpt_path=ckpt_path)
    return _weights(module)


def adapter_reference(world_sizes: list[int]) -> dict[str, torch.Tensor]:
    """:class:`Adapted` in one PyTorch process: epoch ``i`` on the global batches of ``world_sizes[i]``."""
    import torch.nn.functional as F
    from engine_cases import global_batch

    module = Adapted(drop_base=True)
    optimizer = module.configure_optimizers()
    for world_size in world_sizes:
        for step in range(2):
            x, y = global_batch(step, 0, world_size)
            losses = []
            for xs, ys in zip(x.chunk(world_size), y.chunk(world_size), strict=True):
                h = module.net(xs)
                losses.append(F.mse_loss(h + module.adapter(h), ys))
            optimizer.zero_grad()
            (sum(losses) / world_size).backward()
            optimizer.step()
    return _weights(module)


def marker_reads(rank: int, world_size: int, root: str, mode: str) -> dict[str, Any]:
    """A fit that saves in ``mode``, then a fit resumed from that checkpoint and a validate from it, each
    in a fresh Trainer, counting this rank's reads of the commit marker in each (issue 17: a load reads
    the marker once per rank at most; the team's coordinator reads it for every rank)."""
    from lightning_zero.checkpoint.store import storage

    as_torchrun(rank, world_size)
    trainer = make_trainer(world_size, "zero", root, mode=mode, max_steps=2)
    trainer.fit(EvalNet(), loader(2, 1, world_size))
    path = f"{root}/{mode}.ckpt"
    trainer.save_checkpoint(path)
    reads: list[str] = []
    original = storage.read_marker

    def counted(loc: Any) -> Any:
        reads.append(loc.url)
        return original(loc)

    storage.read_marker = counted  # type: ignore[assignment]
    counts: dict[str, int] = {}
    try:
        resumed = make_trainer(world_size, "zero", root, mode=mode, max_steps=3)
        reads.clear()
        resumed.fit(EvalNet(), loader(3, 1, world_size), ckpt_path=path)
        counts["resume"] = sum(url.endswith(f"{mode}.ckpt") for url in reads)
        validating = make_trainer(world_size, "zero", root, mode=mode)
        reads.clear()
        validating.validate(EvalNet(), loader(1, 1, world_size), ckpt_path=path, verbose=False)
        counts["validate"] = sum(url.endswith(f"{mode}.ckpt") for url in reads)
        counts["resumed_step"] = resumed.global_step
    finally:
        storage.read_marker = original  # type: ignore[assignment]
    return counts


class LayerByLayer(LightningModule):
    """A stack whose optimizer starts with its first layer only (BaseFinetuning's use: the others are
    added, one per epoch, by :class:`UnfreezeOnePerEpoch`)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(4)], torch.nn.Linear(6, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.layer[0].parameters(), lr=0.05)

    def train_dataloader(self) -> Any:
        generator = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(16, 6, generator=generator), torch.randn(16, 2, generator=generator))
        return torch.utils.data.DataLoader(data, batch_size=4)


def unfreeze_one_per_epoch() -> Callback:
    from lightning.pytorch.callbacks import BaseFinetuning

    class UnfreezeOnePerEpoch(BaseFinetuning):
        """callbacks/test_finetuning_callback.py's OnEpochLayerFinetuning: layer ``epoch + 1`` joins the
        optimizer as a new param group at each epoch's start."""

        def freeze_before_training(self, pl_module: LightningModule) -> None:
            self.freeze(pl_module.layer[1:])  # DDP needs a trainable parameter: the first layer trains throughout

        def finetune_function(self, pl_module: LightningModule, epoch: int, optimizer: Any) -> None:
            self.unfreeze_and_add_param_group(pl_module.layer[epoch + 1], optimizer, lr=0.02 * (epoch + 1))

    return UnfreezeOnePerEpoch()


def finetuning_resume(rank: int, world_size: int, root: str, strategy: str, mode: str, stage: int) -> dict[str, Any]:
    """callbacks/test_finetuning_callback.py::test_base_finetuning_internal_optimizer_metadata: 3 epochs
    adding a group per epoch (saving each epoch), then a fresh Trainer resumed from epoch 1's checkpoint to
    epoch 3. The weights the resume starts from, what the optimizer holds then, the final weights."""
    as_torchrun(rank, world_size)
    directory = f"{root}/{strategy}-{mode}-{stage}"

    def run(ckpt_path: str | None) -> tuple[LightningModule, dict[str, Any]]:
        checkpoint = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)
        seen: dict[str, Any] = {}

        class Observe(Callback):
            def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
                optimizer = trainer.optimizers[0]
                names = {p: n for n, p in pl_module.named_parameters()}
                seen["start"] = _weights(pl_module)
                seen["groups"] = [[names[p] for p in g["params"]] for g in optimizer.param_groups]
                seen["lrs"] = [g["lr"] for g in optimizer.param_groups]
                state = optimizer.state_dict()["state"]
                seen["steps"] = sorted(float(entry["step"]) for entry in state.values())

        trainer = make_trainer(world_size, strategy, root, mode=mode, max_epochs=3, stage=stage,
                               callbacks=[unfreeze_one_per_epoch(), checkpoint, Observe()])
        module = LayerByLayer()
        trainer.fit(module, ckpt_path=ckpt_path)
        return module, seen

    uninterrupted, _ = run(None)
    torch.distributed.barrier()
    saved = read_lightning_checkpoint(f"{directory}/epoch=1.ckpt", optimizer=False)["state_dict"] if rank == 0 else {}
    if mode == "full":  # its groups are numbered only: refused, naming the cause
        try:
            run(f"{directory}/epoch=1.ckpt")
        except ValueError as exc:
            return {"error": str(exc)}
        return {"error": None}
    resumed, seen = run(f"{directory}/epoch=1.ckpt")
    return {"uninterrupted": _weights(uninterrupted), "resumed": _weights(resumed), "saved": saved, **seen}
