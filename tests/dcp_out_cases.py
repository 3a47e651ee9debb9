"""The runs tests/checkpoint/interop/test_dcp_out.py compares (each in gloo workers): ZeroLowLevelStrategy stage 2 trains
:class:`~deepspeed_cases.TinyNet` for ``STEPS_BEFORE`` global batches at 2 ranks and saves; from that checkpoint
it continues ``STEPS_AFTER`` more (:func:`continue_ours`), and FSDP2 (``fully_shard`` on gloo CPU processes)
loads the checkpoint converted ``--to dcp`` with ``set_state_dict`` and trains the same batches
(:func:`fsdp2_continue`). Both average equal per-rank slices of every global batch."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from deepspeed_cases import (
    TinyNet,
    loader,
    loss_of,
    make_batches,
    make_scheduler,
    param_groups,
    rank_state,
)
from lightning.pytorch import Trainer
from torch import Tensor

STEPS_BEFORE = 6
STEPS_AFTER = 5
"""The continuation crosses the StepLR's step 8, so the scheduler's state carried over is seen to act."""


def batches() -> dict[str, Tensor]:
    return make_batches(STEPS_BEFORE + STEPS_AFTER)


def _trainer(world_size: int, root: str, max_steps: int, callbacks: list[Any]) -> tuple[Trainer, Any]:
    from lightning_zero import ZeroCheckpointIO, ZeroLowLevelStrategy

    strategy = ZeroLowLevelStrategy(stage=2, bucket_size_mb=0.0001)
    trainer = Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=max_steps, logger=False,
                      enable_checkpointing=False, plugins=[ZeroCheckpointIO(mode="sharded", async_save=False)],
                      callbacks=callbacks, use_distributed_sampler=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=root, num_sanity_val_steps=0)
    return trainer, strategy


def _environment(rank: int, world_size: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size), RANK=str(rank))


def train_ours(rank: int, world_size: int, root: str) -> None:
    """(gloo worker) ``trainer.fit`` for ``STEPS_BEFORE`` steps, then ``trainer.save_checkpoint(<root>/ours.ckpt)``
    (``sharded``)."""
    _environment(rank, world_size)
    trainer, _ = _trainer(world_size, root, STEPS_BEFORE, [])
    trainer.fit(TinyNet(), loader(batches(), 0, STEPS_BEFORE, rank, world_size))
    trainer.save_checkpoint(str(Path(root) / "ours.ckpt"))



def continue_training(module: torch.nn.Module, optimizer: Any, scheduler: Any, rank: int, world_size: int) -> None:
    """The ``STEPS_AFTER`` steps both continuations take: the same global batches, this rank's slice of each."""
    data = batches()
    for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        x, y = data["x"][step].chunk(world_size)[rank], data["y"][step].chunk(world_size)[rank]
        loss_of(module, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

def continue_ours(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """(gloo worker) Our continuation from ``<root>/ours.ckpt``: the engine resumed with ``load_zero_state_dict``
    (the scheduler from the Lightning state it returns) trains the ``STEPS_AFTER`` batches in :func:`fsdp2_continue`'s
    loop; this rank's state (:func:`~deepspeed_cases.rank_state`) as loaded and after.

    The engine, not a resumed ``trainer.fit``: Lightning resumes a save made when ``max_steps`` ended as the middle
    of that epoch, and with a loader that keeps no position it trains the new loader's first batch as the epoch's
    last and then again as the next epoch's first, so it would not train the batches FSDP2 trains."""
    from lightning_zero import ZeroConfig, ZeroEngine
    from lightning_zero.checkpoint import load_zero_state_dict

    module = TinyNet()
    engine = ZeroEngine(module, [torch.optim.AdamW(param_groups(module))], ZeroConfig(stage=2, bucket_size_mb=0.0001))
    optimizer = engine.optimizers[0]
    scheduler = make_scheduler(optimizer)
    rest = load_zero_state_dict(engine, module, str(Path(root) / "ours.ckpt"))
    scheduler.load_state_dict(rest["lr_schedulers"][0])
    loaded = rank_state(module, engine)
    continue_training(module, optimizer, scheduler, rank, world_size)
    after = rank_state(module, engine)
    engine.close()
    return {"loaded": loaded, "after": after}


def fsdp2_continue(rank: int, world_size: int, dcp_dir: str) -> dict[str, Any] | None:
    """(gloo worker) FSDP2 loads the converted folder as FSDP2 programs do (``get_state_dict``'s layout, ``dcp.load``,
    ``set_state_dict``), the scheduler from ``lightning_state.pt``, and trains ``STEPS_AFTER`` steps; rank 0 returns
    the whole state as loaded and after (:func:`_whole_state`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    module = TinyNet()
    for layer in (module.body[0], module.body[2], module.head):
        fully_shard(layer)
    fully_shard(module)
    optimizer = torch.optim.AdamW(param_groups(module))
    scheduler = make_scheduler(optimizer)
    state = {"model": get_model_state_dict(module), "optimizer": get_optimizer_state_dict(module, optimizer)}
    dcp.load(state, checkpoint_id=dcp_dir)
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    lightning_state = torch.load(Path(dcp_dir) / "lightning_state.pt", weights_only=True)
    scheduler.load_state_dict(lightning_state["lr_schedulers"][0])
    loaded = _whole_state(module, optimizer)
    continue_training(module, optimizer, scheduler, rank, world_size)
    after = _whole_state(module, optimizer)
    return {"loaded": loaded, "after": after, "global_step": lightning_state["global_step"]} if rank == 0 else None


def _whole(value: Any) -> Any:
    # A copy: at one rank full_tensor() is the local tensor itself, which the next steps update in place.
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()


def _whole_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Every parameter and buffer whole, each trained parameter's moments and step, the groups' lrs (collective)."""
    names = {param: name for name, param in module.named_parameters()}
    weights = {name: _whole(value.detach()) for name, value in module.state_dict().items()}
    params = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            entry = optimizer.state[param]
            params[names[param]] = {"master": _whole(param.detach()), "step": entry["step"].clone(),
                                    **{k: _whole(entry[k]) for k in ("exp_avg", "exp_avg_sq")}}
    return {"weights": weights, "params": params, "lrs": [group["lr"] for group in optimizer.param_groups]}
