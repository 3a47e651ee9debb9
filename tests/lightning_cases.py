"""Lightning modules for strategy tests: the engine cases' Net inside a LightningModule."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from engine_cases import Net, global_batch, initial_model, make_optimizer
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, Dataset


class GlobalBatches(Dataset):
    """Item i is the i-th global batch; each rank slices its part in the step.

    Use with ``Trainer(use_distributed_sampler=False)`` so every rank walks the same items.
    """

    def __init__(self, steps: int, accumulate: int, world_size: int, same_batch: bool = False) -> None:
        self.items = [global_batch(0 if same_batch else step, 0 if same_batch else micro, world_size)
                      for step in range(steps) for micro in range(accumulate)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.items[index]


def loader(steps: int, accumulate: int, world_size: int, same_batch: bool = False) -> DataLoader:
    """``same_batch``: every item is global batch 0, so the loss must go down."""
    return DataLoader(GlobalBatches(steps, accumulate, world_size, same_batch), batch_size=None, shuffle=False)


def local_slice(module: LightningModule, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    ws, rank = module.trainer.world_size, module.global_rank
    x, y = batch
    return x.chunk(ws)[rank], y.chunk(ws)[rank]


class NetModule(LightningModule):
    def __init__(self, optimizer: str = "adamw", scheduler: bool = False) -> None:
        super().__init__()
        self.net: Net = initial_model()
        self.optimizer_name = optimizer
        self.use_scheduler = scheduler
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = local_slice(self, batch)
        loss = F.mse_loss(self.net(x.to(self.dtype)), y.to(self.dtype))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        opt = make_optimizer(self.optimizer_name, self.net)
        if not self.use_scheduler:
            return opt
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class TwoOptimizerModule(LightningModule):
    """Manual optimization: the body and the head step with their own optimizers."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net: Net = initial_model()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        body_opt, head_opt = self.optimizers()
        x, y = local_slice(self, batch)
        loss = F.mse_loss(self.net(x), y)
        body_opt.zero_grad()
        head_opt.zero_grad()
        self.manual_backward(loss)
        body_opt.step()
        head_opt.step()

    def configure_optimizers(self):  # noqa: ANN201
        head = [self.net.head.weight, self.net.head.bias, self.net.scale]
        body = [p for p in self.net.parameters() if all(p is not h for h in head)]
        return torch.optim.SGD(body, lr=0.1, momentum=0.9), torch.optim.Adam(head, lr=0.01)


def two_optimizer_reference(steps: int, world_size: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch running :class:`TwoOptimizerModule`'s manual loop on the global batch."""
    module = TwoOptimizerModule()
    body_opt, head_opt = module.configure_optimizers()
    for step in range(steps):
        x, y = global_batch(step, 0, world_size)
        loss = sum(F.mse_loss(module.net(xs), ys) for xs, ys in zip(x.chunk(world_size), y.chunk(world_size), strict=True))
        body_opt.zero_grad()
        head_opt.zero_grad()
        (loss / world_size).backward()
        body_opt.step()
        head_opt.step()
    return {n: p.detach().clone() for n, p in module.net.named_parameters()}


class ZeroProbe(Callback):
    """Looks inside the workers at the end of training and reports through ``callback_metrics``.

    Lightning sends rank 0's ``callback_metrics`` back to the main process after a spawned fit
    (as tensors and plain values); every entry here is gathered over all ranks first.
    """

    @torch.no_grad()
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy: Any = trainer.strategy
        engine = strategy.engine
        ws = trainer.world_size
        flat = torch.cat([p.detach().float().reshape(-1) for p in pl_module.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(ws)]
        dist.all_gather(gathered, flat)
        shard_numels = [torch.zeros((), dtype=torch.long) for _ in range(ws)]
        dist.all_gather(shard_numels, torch.tensor(strategy.optimizer_shard_numel))
        losses = torch.tensor(getattr(pl_module, "losses", []), dtype=torch.float32)
        all_losses = [torch.empty_like(losses) for _ in range(ws)]
        dist.all_gather(all_losses, losses)
        masters_match = all(
            torch.equal(sp.master.detach().to(sp.param.dtype),
                        sp.param.detach().reshape(-1)[sp.layout.start(sp.rank):sp.layout.end(sp.rank)])
            for sp in engine.sharded_params.values()
        )
        state_dtypes = {str(v.dtype) for opt in engine.optimizers for state in opt.state.values()
                        for v in state.values() if torch.is_tensor(v) and v.dim() > 0}
        trainer.callback_metrics.update({
            "probe/rank_param_spread": max((g - gathered[0]).abs().max() for g in gathered),
            "probe/shard_numels": torch.stack(shard_numels),
            "probe/losses": torch.stack(all_losses),
            "probe/masters_match": torch.tensor(masters_match),
            "probe/stage": torch.tensor(strategy.stage),
            "probe/param_dtypes": sorted({str(p.dtype) for p in pl_module.parameters()}),
            "probe/master_dtypes": sorted({str(sp.master.dtype) for sp in engine.sharded_params.values()}),
            "probe/state_dtypes": sorted(state_dtypes),
        })
