"""The model, data and Trainer runs shared by tests/checkpoint/formats/test_deepspeed_in.py and the fixture generator
(tests/fixtures/deepspeed/make_fixtures.py, the only one that imports DeepSpeed).

DeepSpeed trained :class:`TinyNet` at 2 gloo ranks for ``STEPS_BEFORE`` global batches of ``GLOBAL_BATCH``
samples (each rank its half), saved, and trained ``STEPS_AFTER`` more; a resume under
ZeroLowLevelStrategy at any world size trains the same global batches, each rank its slice.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
GLOBAL_BATCH = 6
"""Samples per step over all ranks: divisible by 1, 2, 3 and 6, so every world size the tests use
averages the same per-sample losses (equal slices)."""
STEPS_BEFORE = 20
STEPS_AFTER = 10
CASES = ("zero1-fp32", "zero2-fp32", "zero1-bf16", "zero2-bf16", "zero2-fp16", "zero2-fp32-rr", "zero1-bf16-fp32accum")
"""Stage and precision of each fixture: ``<case>/raw/`` is a DeepSpeed save folder (``latest``, tag
``global_step20``), ``<case>/lightning.ckpt/`` the folder Lightning's DeepSpeedStrategy writes (tag
``checkpoint``, Lightning's loops/callbacks/schedulers in the client state), ``<case>/expected.pt`` DeepSpeed's
ground truth at the save and after the continuation. ``-rr``: ``round_robin_gradients`` (DeepSpeed's own
per-parameter view is wrong there: see [Note: DeepSpeed's partitions]); ``-fp32accum``: bf16 with fp32
gradient accumulation, which DeepSpeed runs with its BF16_Optimizer at stage 1."""
HP_MAPPING_WRONG = ("zero2-fp32-rr",)
"""Cases whose ``safe_get_full_*`` ground truth names other parameters' elements (DeepSpeed's bug); in fp32 the
module's weights are the exact masters, so the tests compare masters with those instead."""
CLIP = {"raw": 1.0, "lightning": 0.5}
"""The gradient clipping of each layout's DeepSpeed runs: DeepSpeed's default (1.0) for ``raw``, what
``Trainer(gradient_clip_val=0.5)`` makes Lightning's DeepSpeedStrategy configure for ``lightning``. A resume
clips the same way only when told (``Trainer(gradient_clip_val=...)``): DeepSpeed's config is not the Trainer's."""
PRECISION = {"fp32": "32-true", "bf16": "bf16-true", "fp16": "16-mixed"}
"""The Lightning precision that holds what DeepSpeed's does: its bf16 mode keeps the module in bf16 and
fp32 masters in the optimizer, which is ``bf16-true`` under ZeroLowLevelStrategy; its fp16 mode (an fp16
module, fp32 masters, a dynamic loss scale) is closest to ``16-mixed`` (fp32 parameters, fp16 autocast, the
same dynamic scale)."""


class TinyNet(LightningModule):
    """Three small Linear layers (no size divisible by 2 x world size), a frozen bias, a buffer; AdamW
    with two param groups of different lr, weight decay and betas, and a step-wise StepLR."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 6))
        self.head = nn.Linear(6, 3)
        self.head.bias.requires_grad_(False)
        self.register_buffer("offset", torch.linspace(-0.5, 0.5, 3))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.body(x))) + self.offset

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return loss_of(self, x, y)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", loss_of(self, *batch))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(param_groups(self))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": make_scheduler(optimizer), "interval": "step"}}


def loss_of(module: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    dtype = next(module.parameters()).dtype
    return F.mse_loss(module(x.to(dtype)), y.to(dtype))


def param_groups(module: TinyNet) -> list[dict[str, Any]]:
    """Weights and trained biases in two groups, in the module's order (the frozen bias in none)."""
    trained = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    return [
        {"params": [p for name, p in trained if name.endswith("weight")], "lr": 1e-2, "weight_decay": 0.1,
         "betas": (0.9, 0.95)},
        {"params": [p for name, p in trained if name.endswith("bias")], "lr": 5e-3, "weight_decay": 0.0,
         "betas": (0.8, 0.99)},
    ]


def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=8, gamma=0.5)


def make_batches(steps: int = STEPS_BEFORE + STEPS_AFTER) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {"x": torch.randn(steps, GLOBAL_BATCH, 7, generator=generator),
            "y": torch.randn(steps, GLOBAL_BATCH, 3, generator=generator)}


class RankSlices(Dataset):
    """Global batches ``first`` ... ``first + count - 1``, each as this rank's equal slice."""

    def __init__(self, batches: dict[str, Tensor], first: int, count: int, rank: int, world_size: int) -> None:
        self.batches, self.first, self.count, self.rank, self.world_size = batches, first, count, rank, world_size

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        step = self.first + index
        return (self.batches["x"][step].chunk(self.world_size)[self.rank],
                self.batches["y"][step].chunk(self.world_size)[self.rank])


def loader(batches: dict[str, Tensor], first: int, count: int, rank: int, world_size: int) -> DataLoader:
    return DataLoader(RankSlices(batches, first, count, rank, world_size), batch_size=None, shuffle=False)


class StepsSeen(Callback):
    """The global steps the resumed fit ran (the continuation must run steps 21..30, not restart)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.steps.append(trainer.global_step)


def rank_state(module: TinyNet, engine: Any) -> dict[str, Any]:
    """This rank's pieces of every parameter's fp32 master and moments (with where they lie in the flattened
    parameter), its step, each group's lr and the module's weights; :func:`stitched` puts the ranks' together."""
    out: dict[str, Any] = {"params": {}, "lrs": []}
    for optimizer in engine.optimizers:
        out["lrs"] += [group["lr"] for group in optimizer.param_groups]
        for sp in optimizer.sharded_params:
            entry = optimizer.state[sp.master]
            piece = sp.layout.local_slice(sp.rank)
            out["params"][sp.fqn] = {"slice": (piece.start, piece.stop), "shape": tuple(sp.param.shape),
                                     "step": entry["step"].clone(), "master": sp.master.detach().clone(),
                                     **{k: entry[k].detach().clone() for k in ("exp_avg", "exp_avg_sq")}}
    out["weights"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return out


def stitched(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole state from every rank's :func:`rank_state`."""
    first = per_rank[0]
    params = {}
    for name, record in first["params"].items():
        whole = {}
        for key in ("master", "exp_avg", "exp_avg_sq"):
            flat = torch.empty(torch.Size(record["shape"]).numel())
            for rank_record in (r["params"][name] for r in per_rank):
                start, stop = rank_record["slice"]
                flat[start:stop] = rank_record[key][: stop - start]
            whole[key] = flat.reshape(record["shape"])
        params[name] = {**whole, "step": record["step"]}
    return {"params": params, "lrs": first["lrs"], "weights": first["weights"]}


def resume(rank: int, world_size: int, case: str, layout: str, stage: int, root: str) -> dict[str, Any]:
    """(in a gloo worker) ``trainer.fit(ckpt_path=<DeepSpeed folder>)`` under ZeroLowLevelStrategy from fixture
    ``case``'s ``layout``: this rank's state loaded (before any step) and after the ``STEPS_AFTER`` steps
    (:func:`rank_state`), the steps that ran and the scheduler's state."""
    from lightning_zero import ZeroLowLevelStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size), RANK=str(rank))
    batches = torch.load(FIXTURES / "batches.pt", weights_only=True)
    module = TinyNet()
    strategy = ZeroLowLevelStrategy(stage=stage, bucket_size_mb=0.0001)
    seen, loaded = StepsSeen(), LoadedState(strategy)
    precision = PRECISION[case.split("-")[1]]
    # On CPU the Trainer turns "16-mixed" into bf16-mixed: fp16 autocast and its loss scaler are asked for.
    plugins = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))] if precision == "16-mixed" else []
    # A DeepSpeed user's folder holds no Lightning loop state: that fit counts its steps from 0.
    max_steps = STEPS_AFTER if layout == "raw" else STEPS_BEFORE + STEPS_AFTER
    trainer = Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=max_steps,
                      precision=None if plugins else precision, logger=False, enable_checkpointing=False,  # type: ignore[arg-type]
                      gradient_clip_val=CLIP[layout], plugins=plugins,
                      callbacks=[seen, loaded], use_distributed_sampler=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=root, num_sanity_val_steps=0)
    path = FIXTURES / case / ("raw" if layout == "raw" else "lightning.ckpt")
    trainer.fit(module, loader(batches, STEPS_BEFORE, STEPS_AFTER, rank, world_size), ckpt_path=str(path))
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return {"loaded": loaded.state, "after": rank_state(module, strategy._engine), "steps": seen.steps,
            "loss_scale": loaded.loss_scale, "loss_scale_after": scaler.get_scale() if scaler is not None else None,
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict()}


class LoadedState(Callback):
    """The engine's state when training starts, after the resume loaded it."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.state: dict[str, Any] = {}
        self.loss_scale: float | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.state = rank_state(pl_module, self.strategy._engine)  # type: ignore[arg-type]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.loss_scale = scaler.get_scale() if scaler is not None else None


# ---- crafting DeepSpeed files (refusal tests) ------------------------------------------------------


class _FragmentAddress:
    def __init__(self, numel: int, start: int) -> None:
        self.numel, self.start = numel, start


class _LossScaler:
    def __init__(self, fields: dict[str, Any]) -> None:
        self.__dict__.update(fields)


class _DynamicLossScaler(_LossScaler):
    pass


class _ZeroStageEnum(int):
    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return (_ZeroStageEnum, (int(self),))  # as an Enum member pickles: the class called with its value


_FAKES = {  # DeepSpeed's module and class names -> classes here that pickle under those names
    ("deepspeed.utils.tensor_fragment", "fragment_address"): _FragmentAddress,
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): _LossScaler,
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): _DynamicLossScaler,
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): _ZeroStageEnum,
}


def _as_deepspeed(value: Any) -> Any:
    """What the reader's stand-ins hold, as objects that pickle under DeepSpeed's names."""
    from lightning_zero.checkpoint.formats import deepspeed_files as files

    if isinstance(value, files.FragmentAddress):
        return _FragmentAddress(value.numel, value.start)
    if isinstance(value, files.DynamicLossScaler):
        return _DynamicLossScaler(value.fields)
    if isinstance(value, files.StaticLossScaler):
        return _LossScaler(value.fields)
    if isinstance(value, files.ZeroStage):
        return _ZeroStageEnum(int(value))
    if isinstance(value, dict):
        return type(value)((k, _as_deepspeed(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_as_deepspeed(v) for v in value)
    return value


def rewrite_deepspeed_file(path: Path, edit: Any) -> None:
    """Read one of DeepSpeed's files (restricted, as the reader does), apply ``edit(content)`` and write it back
    in DeepSpeed's own pickle (its classes under its names), as a modified DeepSpeed would have saved it."""
    import sys
    import types

    from lightning_zero.checkpoint.formats.deepspeed_files import STAND_INS

    with torch.serialization.safe_globals(STAND_INS):
        content = torch.load(path, map_location="cpu", weights_only=True)
    content = edit(_as_deepspeed(content))
    modules: dict[str, types.ModuleType] = {}
    for (module_name, class_name), cls in _FAKES.items():
        cls.__module__, cls.__qualname__ = module_name, class_name
        parts = module_name.split(".")
        for depth in range(1, len(parts) + 1):  # pickle imports the packages above it too
            name = ".".join(parts[:depth])
            modules.setdefault(name, types.ModuleType(name))
        setattr(modules[module_name], class_name, cls)
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        torch.save(content, path)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
