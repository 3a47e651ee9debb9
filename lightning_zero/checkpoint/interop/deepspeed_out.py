"""Back to DeepSpeed: any checkpoint this package reads, as the ZeRO-1/2 checkpoint folder Lightning's
``DeepSpeedStrategy`` writes, for a DeepSpeed data-parallel world size the caller picks (``lightning-zero convert
--to deepspeed``). ``trainer.fit(ckpt_path=DST)`` under ``DeepSpeedStrategy`` (or ``engine.load_checkpoint(DST)``)
resumes it with its optimizer state.

One CPU process, no process group, no DeepSpeed: the files follow DeepSpeed 0.19.8's layout
(:data:`DEEPSPEED_VERSION`), as :mod:`~lightning_zero.checkpoint.formats.deepspeed_in` reads it ([Note: DeepSpeed's
partitions] there)::

    DST/latest                                               the tag, "checkpoint"
    DST/checkpoint/mp_rank_00_model_states.pt                module, buffer_names, param_shapes, ..., Lightning's state
    DST/checkpoint/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt   rank r's partitions, one file per rank

Each param group's trained parameters are laid out in the group's order as DeepSpeed's ZeRO optimizer lays them
out (no ``round_robin_gradients``, no ``parameter_alignment``), padded to a multiple of 2 x world size, and cut
into one equal partition per rank; a rank file holds its partition of the fp32 masters (its trailing padding
stripped, recorded in ``group_paddings``) and the torch optimizer's state over the whole partition, which is what
DeepSpeed's ``load_checkpoint`` hands the torch optimizer at that world size. The loading run must not set
``round_robin_gradients``: DeepSpeed 0.19.8 would read these partitions in its reordered layout without a check and
train from misplaced masters and moments (``parameter_alignment`` it refuses, naming the layout).

Left out, so that the loading run's own DeepSpeed config decides them (DeepSpeed would otherwise take the file's
over its config): the loss scaler, ``dynamic_loss_scale`` and ``clip_grad``. A file states what it cannot carry:
fp16 (a loss scale's state has no faithful DeepSpeed counterpart), an optimizer state other than Adam/AdamW's,
parameters of one group at different steps.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_zero.checkpoint.formats import deepspeed_files
from lightning_zero.checkpoint.formats.deepspeed_files import FragmentAddress, ZeroStage
from lightning_zero.checkpoint.formats.deepspeed_in import ADAM_STATE
from lightning_zero.checkpoint.interop.named_state import NamedCheckpoint, read_named, refuse_existing
from lightning_zero.checkpoint.reader import META_KEY
from lightning_zero.checkpoint.store import storage

DEEPSPEED_VERSION = "0.19.8"
"""The DeepSpeed version whose files these are (its ``ds_version``; its loader checks it for ZeRO-1)."""
TAG = "checkpoint"
"""The tag folder, as Lightning's ``DeepSpeedStrategy.save_checkpoint`` names it."""
ALIGNMENT = 2
"""DeepSpeed's ``nccl_start_alignment_factor``: a group's flat buffer is padded to this times the world size."""


@dataclass(frozen=True)
class GroupLayout:
    """One param group's flat buffer at a world size: its parameters' places and the equal partitions."""

    names: list[str]
    numels: list[int]
    world_size: int

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def partition_numel(self) -> int:
        alignment = ALIGNMENT * self.world_size
        return -(-self.numel // alignment) * alignment // self.world_size

    def padding(self, rank: int) -> int:
        """The partition's elements past the group's last parameter (DeepSpeed's ``groups_padding``)."""
        start, size = rank * self.partition_numel, self.partition_numel
        return size - max(0, min(size, self.numel - start))

    def pieces(self, rank: int) -> list[tuple[str, slice, slice]]:
        """(name, the parameter's flat elements, where they go in rank's partition) for each parameter it meets."""
        low, high = rank * self.partition_numel, (rank + 1) * self.partition_numel
        out, offset = [], 0
        for name, numel in zip(self.names, self.numels):
            start, stop = max(offset, low), min(offset + numel, high)
            if start < stop:
                out.append((name, slice(start - offset, stop - offset), slice(start - low, stop - low)))
            offset += numel
        return out


def to_deepspeed(src: str, dst: str, *, world_size: int | None = None, stage: int | None = None,
                 storage_options: dict[str, Any] | None = None, dst_storage_options: dict[str, Any] | None = None,
                 weights_only: bool = True) -> str:
    """Write checkpoint ``src`` (``full``, ``sharded``, ``local``, a DeepSpeed ZeRO-1/2 folder) as the folder
    Lightning's ``DeepSpeedStrategy`` resumes at DeepSpeed data-parallel ``world_size`` (None: the one that saved
    ``src``, where it records it) and ZeRO ``stage`` 1 or 2 (None: the source's DeepSpeed stage, else 2); returns
    ``dst``, which must not exist or be an empty directory."""
    if stage not in (None, 1, 2):
        raise ValueError(f"to_deepspeed(stage=...) must be 1 or 2 (ZeRO-3 partitions the parameters themselves, in a"
                         f" layout lightning_zero does not write), got {stage!r}.")
    if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"to_deepspeed(world_size=...) must be a positive number of ranks, got {world_size!r}.")
    out = storage.resolve(dst, dst_storage_options if dst_storage_options is not None else storage_options)
    refuse_existing(out, dst, "convert --to deepspeed writes a new folder (DeepSpeed loads every rank file of the"
                    " tag, and one left from another save would be loaded with ours).")
    named = read_named(src, storage_options, optimizer=True, weights_only=weights_only)
    world_size = world_size or named.world_size
    if world_size is None:
        raise ValueError(f"{src!r} records no data-parallel world size: pass the one DeepSpeed will resume at"
                         " (--world-size N, to_deepspeed(world_size=N)).")
    source = named.meta.get("source") or {}
    stage = stage or (int(source["stage"]) if source.get("format") == "deepspeed" else 2)
    groups, precision = _check(named, src)
    layouts = [GroupLayout(names, [named.model[n].numel() for n in names], world_size) for names in groups]
    config = _config(stage, precision)
    with storage.local_directory(out) as directory:
        tag = os.path.join(directory, TAG)
        os.makedirs(tag, exist_ok=True)
        prefix = "bf16_" if precision == "bf16" else ""
        for rank in range(world_size):  # one rank's partitions in memory at a time, beside the source
            deepspeed_files.save_file(
                _rank_file(named, layouts, rank, stage, config),
                os.path.join(tag, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
        deepspeed_files.save_file(_model_states(named, layouts, world_size, stage, config),
                                  os.path.join(tag, deepspeed_files.MODEL_STATES))
        with open(os.path.join(directory, deepspeed_files.LATEST), "w") as f:  # last: DeepSpeed loads the tag it names
            f.write(TAG)
    return out.url


def _check(named: NamedCheckpoint, src: str) -> tuple[list[list[str]], str]:
    """The param groups' trained parameters (by name, in order) and the precision, or a refusal naming why."""
    optimizer = named.optimizer
    if optimizer is None:
        raise ValueError(f"{src!r} holds no optimizer state: DeepSpeed's load_checkpoint under DeepSpeedStrategy loads"
                         " the optimizer's partitions of every rank, so there is nothing to resume it from.")
    for key, value in named.rest.items():
        if isinstance(value, dict) and "_growth_tracker" in value:
            raise ValueError(
                f"{src!r} trained with fp16 loss scaling ({key}: scale {value.get('scale')}): DeepSpeed's dynamic loss"
                " scaler has no faithful counterpart of that state (it backs off after 'hysteresis' overflows, torch's"
                " GradScaler after one) and DeepSpeed fp16 keeps an fp16 module that this run did not have, so"
                " lightning_zero does not write an fp16 DeepSpeed checkpoint. Resume it under ZeroLowLevelStrategy.")
    dtypes = named.param_dtypes()
    groups = [[name for name in group["params"] if named.model[name].numel() > 0] for group in
              optimizer["param_groups"]]
    trained = {dtypes.get(name) or str(named.model[name].dtype).removeprefix("torch.") for g in groups for name in g}
    if trained - {"float32", "bfloat16"} or len(trained) > 1:
        raise ValueError(f"{src!r} trained parameters in {sorted(trained)}: DeepSpeed ZeRO-1/2 trains one dtype, fp32"
                         " or bf16 (fp16 needs a loss scaler whose state cannot be carried over).")
    for group in optimizer["param_groups"]:
        steps = set()
        for name in group["params"]:
            state = optimizer["state"].get(name)
            unknown = sorted(set(state or {}) - ADAM_STATE)
            if unknown or (state is not None and not {"exp_avg", "exp_avg_sq"} <= set(state)):
                raise ValueError(f"{src!r}: {name!r}'s optimizer state holds {sorted(state or {})}, not Adam/AdamW's"
                                 " (step, exp_avg, exp_avg_sq), the only optimizer state written for DeepSpeed.")
            steps.add(None if state is None else float(state["step"]))
        if len(steps) > 1:
            raise ValueError(f"{src!r}: the parameters of param group {group['params']} were stepped {sorted(steps, key=str)}"
                             " times (a parameter that got no gradient is not stepped); DeepSpeed steps a group's"
                             " flat partition as one tensor with one step count, so the group cannot be carried over.")
    return groups, "bf16" if trained == {"bfloat16"} else "fp32"


def _config(stage: int, precision: str) -> dict[str, Any]:
    """The ``ds_config`` recorded in the files: what describes their layout (the loading run's config governs)."""
    config: dict[str, Any] = {"zero_optimization": {"stage": stage}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _rank_file(named: NamedCheckpoint, layouts: list[GroupLayout], rank: int, stage: int,
               config: dict[str, Any]) -> dict[str, Any]:
    """Rank ``rank``'s ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``, as DeepSpeed's ZeRO optimizer's
    ``state_dict()`` holds it (key for key, minus the loss scaler and clipping: module docstring)."""
    optimizer = named.optimizer
    assert optimizer is not None
    partitions, base_state, mappings = [], {}, []
    for index, layout in enumerate(layouts):
        pieces = layout.pieces(rank)
        size = layout.partition_numel
        partitions.append(_partition(lambda name: named.model[name], pieces, size)[: size - layout.padding(rank)])
        states = [optimizer["state"][name] for name in layout.names if name in optimizer["state"]]
        if states:
            entry: dict[str, Any] = {"step": states[0]["step"].detach().clone().float()}
            for key in (k for k in states[0] if k != "step"):
                entry[key] = _partition(lambda name, key=key: optimizer["state"][name][key], pieces, size)
            base_state[index] = entry
        mappings.append(OrderedDict((name, FragmentAddress(there.stop - there.start, there.start))
                                    for name, _, there in pieces))
    groups = [{k: v for k, v in group.items() if k not in ("params", "param_names")} | {"params": [index]}
              for index, group in enumerate(optimizer["param_groups"])]
    zero = {
        "overflow": False,
        "base_optimizer_state": {"state": base_state, "param_groups": groups},
        "single_partition_of_fp32_groups": partitions,
        "zero_stage": ZeroStage(stage),
        "group_paddings": [layout.padding(rank) for layout in layouts],
        "param_alignment_paddings": [[0] * len(layout.names) for layout in layouts],
        "partition_count": [layout.world_size for layout in layouts],
        "ds_version": DEEPSPEED_VERSION,
        "param_slice_mappings": mappings,
    }
    return {"optimizer_state_dict": zero, "ds_config": config, "ds_version": DEEPSPEED_VERSION}


def _partition(tensor_of: Any, pieces: list[tuple[str, slice, slice]], size: int) -> Tensor:
    """One rank's fp32 partition of a group's flat buffer (padding zero, as DeepSpeed's stays)."""
    partition = torch.zeros(size, dtype=torch.float32)
    for name, own, there in pieces:
        partition[there] = tensor_of(name).detach().reshape(-1)[own].float()
    return partition


def _model_states(named: NamedCheckpoint, layouts: list[GroupLayout], world_size: int, stage: int,
                  config: dict[str, Any]) -> dict[str, Any]:
    """``mp_rank_00_model_states.pt`` as DeepSpeed's engine writes it, with Lightning's state as its client state
    (what ``DeepSpeedStrategy.save_checkpoint`` hands it: the checkpoint minus ``state_dict`` and
    ``optimizer_states``)."""
    meta = named.meta
    dtypes = named.param_dtypes()
    aliases: dict[str, str] = dict(meta.get("aliases") or {})
    trained = {name for layout in layouts for name in layout.names}
    params = set(dtypes) | trained
    module = OrderedDict()
    for name, value in named.model.items():  # parameters in their training dtype, as DeepSpeed's module holds them
        dtype = dtypes.get(aliases.get(name, name))
        module[name] = value.to(getattr(torch, dtype)) if dtype and str(value.dtype) != f"torch.{dtype}" else value
    untrained = [name for name in module if name not in trained and name not in aliases]
    if dtypes:
        frozen, buffers = [n for n in untrained if n in params], [n for n in untrained if n not in params]
    else:
        # A file that names no parameters (a plain Lightning file) cannot tell a frozen parameter from a buffer.
        # DeepSpeed's ZeRO-2 load copies each frozen parameter from frozen_param_fragments by name (a KeyError where
        # one is missing) and looks no buffer up there: every floating tensor goes there, and among the buffers.
        frozen, buffers = [n for n in untrained if module[n].is_floating_point()], untrained
    client = {k: v for k, v in named.rest.items() if k != META_KEY}
    return {
        "module": module,
        "buffer_names": buffers,
        "optimizer": None,
        "param_shapes": [OrderedDict((name, named.model[name].shape) for name in layout.names) for layout in layouts],
        # ZeRO-2 saves the frozen parameters beside the module too (ZeRO-1 does not).
        "frozen_param_shapes": OrderedDict((n, module[n].shape) for n in frozen) if stage == 2 else None,
        "shared_params": aliases,
        "frozen_param_fragments": OrderedDict((n, module[n]) for n in frozen) if stage == 2 else None,
        "lr_scheduler": None,  # Lightning's schedulers are in its client state (lr_schedulers)
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": int(named.rest.get("global_step") or 0),
        "dp_world_size": world_size,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": config,
        "ds_version": DEEPSPEED_VERSION,
        **client,
    }
