"""Lightning modules for strategy tests: the engine cases' Net inside a LightningModule."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from engine_cases import Net, global_batch, initial_model, make_optimizer
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, Dataset


class GlobalBatches(Dataset):
    """Item i is the i-th global batch; each rank slices its part in the step.

    Use with ``Trainer(use_distributed_sampler=False)`` so every rank walks the same items.
    """

    def __init__(self, steps: int, accumulate: int, world_size: int) -> None:
        self.items = [global_batch(step, micro, world_size) for step in range(steps) for micro in range(accumulate)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.items[index]


def loader(steps: int, accumulate: int, world_size: int) -> DataLoader:
    return DataLoader(GlobalBatches(steps, accumulate, world_size), batch_size=None, shuffle=False)


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
