"""Workers for tests/engine/test_compile.py: a tiny MLP LightningModule fitted through ``trainer.fit(torch.compile(module))``
under ``ddp``, ``zero1`` and ``zero2``, counting the graphs the compiler hands its backend in each process."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lifecycle_cases import as_torchrun
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from lightning_cases import loader, local_slice
from torch import nn

from lightning_zero import ZeroLowLevelStrategy

GRAPHS: list[int] = []
"""One entry per graph the backend compiled in this process (its node count)."""


def counting_backend(name: str) -> Any:
    """A ``torch.compile`` backend that counts the graphs it is given, then compiles them with ``name``."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(name)

    def backend(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        GRAPHS.append(len(graph.graph.nodes))
        return inner(graph, example_inputs)

    return backend


class MLP(LightningModule):
    """Two layers, AdamW; ``checkpointing`` runs the second layer under ``torch.utils.checkpoint`` with
    ``use_reentrant`` set to it (None: no activation checkpointing). Not the first: the reentrant variant
    gives no gradient to a segment whose inputs do not require one (the batch)."""

    def __init__(self, checkpointing: bool | None = None, compile_step: bool = False) -> None:
        super().__init__()
        self.compile_step = compile_step
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(7, 33), nn.Linear(33, 7)])  # 33: splits unevenly over 2 ranks
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            if self.checkpointing is None or index == 0:
                x = layer(x)
            else:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=self.checkpointing)
            if index == 0:
                x = torch.tanh(x)
        return x

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = local_slice(self, batch)
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
        if self.compile_step:  # as docs/training.md's "Compiling" tells a Lightning user
            optimizer.step = torch.compile(optimizer.step, backend=counting_backend("eager"))  # type: ignore[method-assign]
        return optimizer


class GraphCount(Callback):
    """The number of graphs compiled so far, after every training step."""

    def __init__(self) -> None:
        self.after_step: list[int] = []

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.after_step.append(len(GRAPHS))


def strategy(name: str) -> Any:
    if name == "ddp":
        return DDPStrategy()
    return ZeroLowLevelStrategy(stage=1 if name == "zero1" else 2, bucket_size_mb=0.0005)  # several buckets


def fit(rank: int, world_size: int, strategy_name: str, root: str, steps: int, backend: str | None = "eager",
        checkpointing: bool | None = None, save: bool = False, ckpt_path: str | None = None,
        compile_step: bool = False) -> dict[str, Any]:
    """``trainer.fit(torch.compile(MLP(checkpointing)))`` to ``steps``, 2 steps an epoch (a resume at an
    epoch's end sees the batches the uninterrupted run saw); backend None: not compiled. ``save``: a
    checkpoint at every epoch's end. The graphs compiled after each step and the weights afterwards."""
    as_torchrun(rank, world_size)
    GRAPHS.clear()
    torch._dynamo.reset()
    module = MLP(checkpointing, compile_step)
    count = GraphCount()
    callbacks: list[Callback] = [count]
    if save:
        callbacks.append(ModelCheckpoint(dirpath=f"{root}/ckpts", save_top_k=-1))
    trainer = Trainer(
        accelerator="cpu", devices=world_size, max_epochs=steps // 2, strategy=strategy(strategy_name),
        callbacks=callbacks, logger=False, enable_checkpointing=save,
        use_distributed_sampler=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, num_sanity_val_steps=0,
    )
    model: Any = module if backend is None else torch.compile(module, backend=counting_backend(backend))
    trainer.fit(model, loader(2, 1, world_size), ckpt_path=ckpt_path)
    return {"graphs_after_step": count.after_step,
            "params": {n: p.detach().clone() for n, p in module.named_parameters()}}


def loop(rank: int, world_size: int, engine_name: str, steps: int, compile_model: bool,
         compile_step: bool) -> dict[str, Any]:
    """A plain loop under DDP (``engine_name="ddp"``) or a stage-2 ``ZeroEngine``: the model compiled
    (``torch.compile(model)``, as a user of either does) and/or the AdamW step compiled (``optimizer.step =
    torch.compile(optimizer.step)``; the engine steps its master shards through it). The graphs compiled
    after each step and the weights afterwards."""
    from torch.nn.parallel import DistributedDataParallel

    from lightning_zero import ZeroConfig, ZeroEngine

    GRAPHS.clear()
    torch._dynamo.reset()
    module = MLP()
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.1)
    if compile_step:
        optimizer.step = torch.compile(optimizer.step, backend=counting_backend("eager"))  # type: ignore[method-assign]
    if engine_name == "ddp":
        model: Any = DistributedDataParallel(module)
        stepper: Any = optimizer
    else:
        model = module
        stepper = ZeroEngine(module, [optimizer], ZeroConfig(stage=2, bucket_size_mb=0.0005)).optimizers[0]
    if compile_model:
        model = torch.compile(model, backend=counting_backend("eager"))
    after_step, pending_after_step = [], []
    for step in range(steps):
        x, y = loader(steps, 1, world_size).dataset[step]
        F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
        stepper.step()
        pending_after_step.append(engine_name != "ddp" and stepper._gatherer.pending)
        stepper.zero_grad()
        after_step.append(len(GRAPHS))
    return {"graphs_after_step": after_step, "pending_after_step": pending_after_step,
            "params": {n: p.detach().clone() for n, p in module.named_parameters()}}


def compile_zero_optimizer_step(rank: int, world_size: int) -> str:
    """``torch.compile(zero_optimizer.step)``: the error it raises."""
    from lightning_zero import ZeroConfig, ZeroEngine

    module = MLP()
    engine = ZeroEngine(module, [torch.optim.AdamW(module.parameters())], ZeroConfig(stage=2))
    step = torch.compile(engine.optimizers[0].step, backend="eager")
    module(torch.ones(2, 7)).sum().backward()
    try:
        step()
    except Exception as error:  # what the user sees
        return str(error)
    finally:
        engine.close()
    return "no error"


def two_engines_in_turn(rank: int, world_size: int, compiled: bool, steps: int) -> dict[str, Any]:
    """One module, compiled once (or not), trained by an engine for ``steps``, then by a second engine
    built on it (as the next ``fit`` builds one) for ``steps`` more: the second runs the graph compiled
    for the first without a new trace."""
    from lightning_zero import ZeroConfig, ZeroEngine

    GRAPHS.clear()
    torch._dynamo.reset()
    module = MLP()
    model: Any = torch.compile(module, backend=counting_backend("eager")) if compiled else module
    after_step, pending_after_step = [], []
    for _turn in range(2):
        optimizer = torch.optim.AdamW(module.parameters(), lr=0.01)
        engine = ZeroEngine(module, [optimizer], ZeroConfig(stage=2, bucket_size_mb=0.0005))
        stepper = engine.optimizers[0]
        for step in range(steps):
            x, y = loader(steps, 1, world_size).dataset[step]
            F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
            stepper.step()
            pending_after_step.append(engine.gatherer.pending)
            stepper.zero_grad()
            after_step.append(len(GRAPHS))
        engine.close()
    return {"graphs_after_step": after_step, "pending_after_step": pending_after_step,
            "params": {n: p.detach().clone() for n, p in module.named_parameters()}}


def fabric_loop(rank: int, world_size: int, strategy_name: str, steps: int) -> dict[str, Any]:
    """``fabric.setup(torch.compile(module), optimizer)`` under Fabric's ``ddp`` or ``zero2``: the graphs
    compiled after each step and the weights afterwards."""
    from fabric_cases import make_fabric
    from lightning.fabric.strategies import DDPStrategy as FabricDDP

    from lightning_zero.fabric import ZeroLowLevelStrategy as FabricZero

    GRAPHS.clear()
    torch._dynamo.reset()
    module = MLP()
    strategy: Any = FabricDDP() if strategy_name == "ddp" else FabricZero(stage=2, bucket_size_mb=0.0005)
    fabric = make_fabric(rank, world_size, strategy)
    model, optimizer = fabric.setup(torch.compile(module, backend=counting_backend("eager")),
                                    torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.1))
    after_step = []
    for step in range(steps):
        x, y = loader(steps, 1, world_size).dataset[step]
        fabric.backward(F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]))
        optimizer.step()
        optimizer.zero_grad()
        after_step.append(len(GRAPHS))
    if strategy_name != "ddp":
        fabric.strategy.teardown()
    return {"graphs_after_step": after_step, "params": {n: p.detach().clone() for n, p in module.named_parameters()}}
