"""A DeepSpeed ZeRO-1/2 checkpoint as whole per-parameter state: what ``lightning-zero convert --from deepspeed``
writes and ``trainer.fit(ckpt_path=<DeepSpeed folder>)`` resumes (through :mod:`~lightning_zero.checkpoint.reader`,
which puts :class:`DeepSpeedCheckpoint` into Lightning's format).

[Note: DeepSpeed's partitions] ZeRO-1/2 flattens each param group's trained parameters into one buffer, in
the order ``param_shapes`` lists them (the group's order, or reordered round-robin over the ranks with
``round_robin_gradients``), each followed by its ``param_alignment_paddings`` entry (zero unless
``parameter_alignment``), pads it to a multiple of 2 x world size and gives each data-parallel rank one
equal, contiguous partition, so partitions cut across parameters. A rank's file holds its partition of the
fp32 masters (``single_partition_of_fp32_groups``; ZeRO-1/2's own optimizer strips the trailing padding and
records it in ``group_paddings``, the BF16 optimizer keeps it) and the torch optimizer's state over it
(``base_optimizer_state``: Adam's ``exp_avg``/``exp_avg_sq`` as flat tensors, ``step`` per group). A
parameter's elements are where its offset in the buffer meets a rank's partition; the reader copies them
rank file by rank file into each parameter's whole tensors (:class:`_ParamState`), so at most one rank file
is loaded (memory-mapped) beside the result. The files' ``param_slice_mappings`` (each parameter's piece of
a partition) are not used: DeepSpeed 0.19.8 computes them in the group's order even when the buffer is
reordered round-robin, and so names other parameters' elements there (as do its ``safe_get_full_fp32_param``
and universal checkpoints). The module states file holds the module's ``state_dict`` in its training
dtype (frozen parameters and buffers included), the groups' parameter names and shapes, the data-parallel
world size and the user's client state (Lightning's loops, callbacks and schedulers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_zero.checkpoint.formats import deepspeed_files
from lightning_zero.checkpoint.formats.deepspeed_files import (
    DeepSpeedFolder,
    DynamicLossScaler,
    StaticLossScaler,
    ZeroStage,
)
from lightning_zero.checkpoint.store.storage import CheckpointCorruptError, Location

ADAM_STATE = frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
"""The optimizer state carried over: torch's Adam/AdamW (and DeepSpeed's FusedAdam/CPUAdam, which keep the
same keys); ``max_exp_avg_sq`` with ``amsgrad``. Any other optimizer's state is refused (weights still read)."""
DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "csr_tensor_module_names", "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "ds_config", "ds_version", "checkpoint_parallel_dimensions", "universal_checkpoint_info",
})
"""Entries of the module states file that DeepSpeed writes; the others are the caller's client state."""
LIGHTNING_PREFIX = "_forward_module."
"""Lightning before 2.1 wrapped the module, so DeepSpeed named its parameters under this prefix."""


@dataclass
class DeepSpeedCheckpoint:
    """A DeepSpeed checkpoint's content, whole, keyed by the model's parameter names."""

    state_dict: dict[str, Tensor]
    """The module's ``state_dict`` as DeepSpeed held it (in the training dtype: bf16/fp16 under those modes)."""
    masters: dict[str, Tensor]
    """The exact fp32 masters of trained parameters held in a lower precision (shaped as the parameter)."""
    optimizer_state: dict[str, Any] | None
    """The optimizer's state in ``torch.optim`` form: ``state[i]`` parameter i's ``step`` and moments, i
    counted over the param groups in order; ``param_groups`` the hyper-parameters (None: not read)."""
    client_state: dict[str, Any]
    """The caller's client state: Lightning's loops, callbacks, ``lr_schedulers`` ... under its DeepSpeedStrategy."""
    scaler_state: dict[str, Any] | None
    """fp16's dynamic loss scale as ``torch.amp.GradScaler.state_dict()`` (None without one)."""
    source: dict[str, Any] = field(default_factory=dict)
    """What was read: stage, world size, precision, DeepSpeed's version, tag, gradient clipping."""
    param_dtypes: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    group_names: list[list[str]] = field(default_factory=list)
    """Each param group's parameters by name, in the order ``optimizer_state``'s indices count them."""


@dataclass
class _ParamState:
    """One trained parameter's whole fp32 master and moments, filled from the rank partitions it meets."""

    name: str
    shape: torch.Size
    offset: int
    """Where its first element lies in its group's flat buffer ([Note: DeepSpeed's partitions])."""
    master: Tensor  # 1D, numel
    moments: dict[str, Tensor] = field(default_factory=dict)  # 1D each
    step: Tensor | None = None
    covered: int = 0

    def take(self, start: int, partition: Tensor, moments: dict[str, Tensor], state: dict[str, Any]) -> None:
        """Its elements in a rank's ``partition`` of the group's buffer, which begins at ``start``."""
        low, high = max(self.offset, start), min(self.offset + self.master.numel(), start + partition.numel())
        if low >= high:
            return
        own, there = slice(low - self.offset, high - self.offset), slice(low - start, high - start)
        self.master[own] = partition[there]
        for key, value in moments.items():
            self.moments.setdefault(key, torch.empty_like(self.master))[own] = value[there]
        if "step" in state:  # a copy: a tensor of the rank file would keep the whole memory-mapped file alive
            self.step = torch.as_tensor(state["step"], dtype=torch.float32).clone()
        self.covered += high - low


def read_deepspeed(loc: Location, *, optimizer: bool = True) -> DeepSpeedCheckpoint:
    """The DeepSpeed ZeRO-1/2 checkpoint at ``loc`` (a tag folder or a folder whose ``latest`` names one), read
    rank file by rank file ([Note: DeepSpeed's partitions]). ``optimizer=False``: the masters only (any
    optimizer's checkpoint then reads)."""
    folder = deepspeed_files.open_folder(loc)
    url = folder.tag.url
    states = deepspeed_files.load_file(folder, folder.model_states)
    if not isinstance(states, dict) or not isinstance(states.get("module"), dict):
        raise CheckpointCorruptError(f"{deepspeed_files.MODEL_STATES} of {url!r} holds no module state: it is not a"
                                     " DeepSpeed checkpoint.")
    config = states.get("ds_config") if isinstance(states.get("ds_config"), dict) else {}
    _refuse_layouts(states, config, url)
    world_size = int(states.get("dp_world_size") or 0)
    deepspeed_files.check_rank_files(folder, world_size)
    prefix = _name_prefix(states["module"])
    module = {k.removeprefix(prefix): v for k, v in states["module"].items()}
    flat = [[(name.removeprefix(prefix), torch.Size(shape)) for name, shape in group.items()]
            for group in states["param_shapes"]]
    groups = optimizer_order(states)
    params: dict[str, _ParamState] = {}
    hyper, scaler, clip_grad, stage = _read_rank_files(folder, flat, params, world_size, optimizer)
    for state in params.values():
        if state.covered != state.master.numel():
            raise CheckpointCorruptError(
                f"DeepSpeed checkpoint {url!r}: the rank files hold {state.covered} of the {state.master.numel()}"
                f" elements of {state.name!r}; they belong to another save or are damaged.")
    buffers = {name.removeprefix(prefix) for name in states.get("buffer_names") or ()}
    state_dict: dict[str, Tensor] = {}
    masters: dict[str, Tensor] = {}
    for name, value in module.items():
        if name in params:
            master = params[name].master.reshape(params[name].shape)
            if value.dtype != torch.float32:
                masters[name] = master
            value = master if value.dtype == torch.float32 else value
        state_dict[name] = value
    client = {k: v for k, v in states.items() if k not in DEEPSPEED_KEYS}
    if "lr_schedulers" not in client:  # a DeepSpeed user's scheduler, stepped by the engine
        client["lr_schedulers"] = [states["lr_scheduler"]] if states.get("lr_scheduler") is not None else []
    client.setdefault("global_step", states.get("global_steps", 0))
    precision = "fp16" if (config.get("fp16") or {}).get("enabled") else \
        "bf16" if (config.get("bf16") or config.get("bfloat16") or {}).get("enabled") else "fp32"
    return DeepSpeedCheckpoint(
        state_dict=state_dict, masters=masters,
        optimizer_state=_optimizer_state(params, groups, hyper) if optimizer else None,
        client_state=client, scaler_state=_scaler_state(scaler),
        source={"format": "deepspeed", "stage": stage, "world_size": world_size, "precision": precision,
                "version": states.get("ds_version"), "tag": folder.tag.name, "clip_grad": clip_grad,
                "loss_scale": scaler.fields.get("cur_scale") if isinstance(scaler, StaticLossScaler) else None},
        param_dtypes={name: str(value.dtype).removeprefix("torch.") for name, value in module.items()
                      if name not in buffers},
        aliases={k.removeprefix(prefix): v.removeprefix(prefix) for k, v in (states.get("shared_params") or {}).items()},
        group_names=groups,
    )


def _refuse_layouts(states: dict[str, Any], config: dict[str, Any], url: str) -> None:
    """A checkpoint whose state cannot be carried over exactly is refused, naming what and why."""
    stage = (config.get("zero_optimization") or {}).get("stage")
    if stage == 3:
        raise ValueError(f"{url!r} is a DeepSpeed ZeRO stage 3 checkpoint (ds_config), whose parameters are"
                         " partitioned in a layout of their own: lightning_zero reads ZeRO-1/2 checkpoints only.")
    if states.get("param_shapes") is None:
        raise ValueError(
            f"{url!r} is a DeepSpeed checkpoint without ZeRO (stage {stage or 0}): its optimizer state is one torch"
            " optimizer's, not partitioned. lightning_zero reads ZeRO-1/2 checkpoints only."
        )
    degrees = states.get("checkpoint_parallel_dimensions") or {}
    model_parallel = int(states.get("mp_world_size") or 1)
    if model_parallel > 1 or any(int(v or 1) > 1 for v in degrees.values()):
        raise ValueError(f"{url!r} was saved with model parallelism (mp_world_size {model_parallel}, {degrees}):"
                         " lightning_zero reads data-parallel ZeRO-1/2 checkpoints only.")
    if not isinstance(states.get("dp_world_size"), int) or states["dp_world_size"] < 1:
        raise CheckpointCorruptError(f"{url!r}: {deepspeed_files.MODEL_STATES} records no data-parallel world size.")


def optimizer_order(states: dict[str, Any]) -> list[list[str]]:
    """Each param group's trained parameters by name, in the order the torch optimizer's indices count them (the
    user's param group): the module states file's ``param_shapes``, which lists the order of the flat buffer,
    unshuffled under ``round_robin_gradients`` ([Note: DeepSpeed's partitions]); an old Lightning wrapper's
    prefix removed."""
    prefix = _name_prefix(states["module"])
    groups = [[name.removeprefix(prefix) for name in group] for group in states["param_shapes"]]
    config = states.get("ds_config") if isinstance(states.get("ds_config"), dict) else {}
    if (config.get("zero_optimization") or {}).get("round_robin_gradients"):
        groups = [_unshuffle(order, int(states["dp_world_size"])) for order in groups]
    return groups


def _name_prefix(module: dict[str, Any]) -> str:
    names = list(module)
    return LIGHTNING_PREFIX if names and all(n.startswith(LIGHTNING_PREFIX) for n in names) else ""


def _unshuffle(order: list[str], world_size: int) -> list[str]:
    """A group's parameter order before DeepSpeed's round-robin reordering (every ``world_size``-th parameter,
    starting at 0, then at 1, ...): the order of the user's param group, which the optimizer's indices follow."""
    count = len(order)
    original: list[str | None] = [None] * count
    it = iter(order)
    for start in range(world_size):
        for index in range(start, count, world_size):
            original[index] = next(it)
    return [name for name in original if name is not None]


def _read_rank_files(folder: DeepSpeedFolder, flat: list[list[tuple[str, torch.Size]]],
                     params: dict[str, _ParamState], world_size: int,
                     optimizer: bool) -> tuple[list[dict[str, Any]], Any, Any, int]:
    """Every rank's partitions into ``params`` (built from rank 0's file, which records the paddings), one rank
    file loaded at a time. Returns rank 0's param groups' hyper-parameters, loss scaler, gradient clipping and
    the ZeRO stage."""
    first = _read_rank_file(folder, 0, flat, params, [], optimizer)
    sizes = first[4]
    for rank in range(1, world_size):
        # Each file's tensors are referenced only inside the call: released before the next file is loaded.
        _read_rank_file(folder, rank, flat, params, sizes, optimizer)
    return first[:4]


def _read_rank_file(folder: DeepSpeedFolder, rank: int, flat: list[list[tuple[str, torch.Size]]],
                    params: dict[str, _ParamState], sizes: list[int],
                    optimizer: bool) -> tuple[list[dict[str, Any]], Any, Any, int, list[int]]:
    url = folder.tag.url
    name = folder.rank_files[rank].rsplit("/", 1)[-1]
    content = deepspeed_files.load_file(folder, folder.rank_files[rank])
    zero = content.get("optimizer_state_dict") if isinstance(content, dict) else None
    if not isinstance(zero, dict) or not isinstance(zero.get("single_partition_of_fp32_groups"), list):
        raise CheckpointCorruptError(f"{name} of DeepSpeed checkpoint {url!r} holds no ZeRO optimizer state.")
    stage = _stage(zero, content, url, name)
    world_size = len(folder.rank_files)
    counts = zero.get("partition_count") or [world_size] * len(flat)
    if any(int(c) != world_size for c in counts):
        raise ValueError(f"{name} of {url!r}: param groups partitioned over {counts} ranks (expert or sequence"
                         f" parallelism), not the {world_size} data-parallel ranks; not read.")
    partitions = zero["single_partition_of_fp32_groups"]
    paddings = list(zero.get("group_paddings") or [0] * len(flat))
    if len(partitions) != len(flat) or len(paddings) != len(flat):
        raise CheckpointCorruptError(f"{name} of {url!r} has {len(partitions)} param groups, the module states"
                                     f" {len(flat)}: the files are of different saves.")
    # ZeRO-1/2's optimizer (it records its stage) saves partitions without their trailing padding.
    own_sizes = [p.numel() + (int(pad) if "zero_stage" in zero else 0) for p, pad in zip(partitions, paddings)]
    if rank == 0:
        sizes = own_sizes
        _place(flat, params, zero.get("param_alignment_paddings"), sizes, world_size, url)
    elif own_sizes != sizes:
        raise CheckpointCorruptError(f"{name} of {url!r} holds partitions of {own_sizes} elements, rank 0's file"
                                     f" {sizes}: the files are of different saves.")
    if optimizer:
        group_states, hyper = _base_state(zero.get("base_optimizer_state"), len(flat), url, name)
    else:
        group_states, hyper = [{} for _ in flat], []
    for group, partition, size, state in zip(flat, partitions, sizes, group_states):
        moments = {k: v for k, v in state.items() if k != "step" and isinstance(v, Tensor)}
        for key, value in moments.items():
            if value.numel() < partition.numel():
                raise CheckpointCorruptError(f"{name} of {url!r}: {key} holds {value.numel()} elements, the"
                                             f" partition {partition.numel()}.")
        for param_name, _ in group:
            params[param_name].take(rank * size, partition, moments, state)
    return hyper, zero.get("loss_scaler"), zero.get("clip_grad"), stage, sizes


def _place(flat: list[list[tuple[str, torch.Size]]], params: dict[str, _ParamState], alignment: Any,
           sizes: list[int], world_size: int, url: str) -> None:
    """Each parameter's offset in its group's flat buffer ([Note: DeepSpeed's partitions])."""
    for index, group in enumerate(flat):
        pads = list(alignment[index]) if alignment is not None else [0] * len(group)
        if len(pads) != len(group):
            raise CheckpointCorruptError(f"DeepSpeed checkpoint {url!r}: param group {index} lists {len(group)}"
                                         f" parameters but {len(pads)} paddings.")
        offset = 0
        for (name, shape), pad in zip(group, pads):
            params[name] = _ParamState(name, shape, offset, torch.empty(shape.numel(), dtype=torch.float32))
            offset += shape.numel() + int(pad)
        if offset > sizes[index] * world_size:
            raise CheckpointCorruptError(f"DeepSpeed checkpoint {url!r}: param group {index} holds {offset}"
                                         f" elements, more than its {world_size} partitions of {sizes[index]}.")


def _stage(zero: dict[str, Any], content: dict[str, Any], url: str, name: str) -> int:
    stage = zero.get("zero_stage")
    if stage is None:  # DeepSpeed's BF16_Optimizer (ZeRO-1, bf16, fp32 gradient accumulation) records none
        stage = ((content.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 1)
    if not isinstance(stage, (int, ZeroStage)) or int(stage) not in (1, 2):
        raise ValueError(f"{name} of {url!r} is of ZeRO stage {stage}: lightning_zero reads stages 1 and 2 only.")
    return int(stage)


def _base_state(base: Any, count: int, url: str, name: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each group's optimizer state over its flat partition and its hyper-parameters, checked to be Adam's."""
    if isinstance(base, list):
        raise ValueError(
            f"{name} of {url!r} was saved with zero_optimization.elastic_checkpoint, whose files do not record the"
            " param groups' hyper-parameters (lr, betas, weight decay): load it in DeepSpeed and save it again"
            " without that option, or read its weights only."
        )
    if not isinstance(base, dict) or not isinstance(base.get("param_groups"), list):
        raise CheckpointCorruptError(f"{name} of {url!r} holds no base optimizer state.")
    groups = base["param_groups"]
    if len(groups) != count:
        raise CheckpointCorruptError(f"{name} of {url!r}: {len(groups)} optimizer param groups, {count} in the model.")
    states = []
    for index, group in enumerate(groups):
        state = dict(base.get("state", {}).get(group["params"][0], {}))
        unknown = sorted(set(state) - ADAM_STATE)
        if unknown or "betas" not in group or (state and not {"exp_avg", "exp_avg_sq"} <= set(state)):
            raise ValueError(
                f"{name} of {url!r}: param group {index}'s optimizer state holds {sorted(state)}, with the"
                f" hyper-parameters {sorted(k for k in group if k != 'params')}: not Adam/AdamW's (step, exp_avg,"
                " exp_avg_sq), the only optimizer state lightning_zero carries over from DeepSpeed. Its weights"
                " still read: lightning-zero convert --from deepspeed --no-optimizer, or validate/test from it."
            )
        if "step" not in state and "step" in group:  # DeepSpeed's FusedAdam counts steps in the group
            state["step"] = group["step"]
        states.append(state)
    return states, [{k: v for k, v in group.items() if k not in ("params", "step")} for group in groups]


def _optimizer_state(params: dict[str, _ParamState], groups: list[list[str]],
                     hyper: list[dict[str, Any]]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    param_groups = []
    index = 0
    for names, group in zip(groups, hyper):
        ids = []
        for name in names:
            param = params[name]
            if param.moments:
                # A step tensor of its own per parameter: torch's Adam counts it up in place.
                step = param.step if param.step is not None else torch.tensor(0.0)
                state[index] = {"step": step.clone(),
                                **{k: v.reshape(param.shape) for k, v in param.moments.items()}}
            ids.append(index)
            index += 1
        param_groups.append({**group, "params": ids})
    return {"state": state, "param_groups": param_groups}


def _scaler_state(scaler: Any) -> dict[str, Any] | None:
    """fp16's dynamic loss scale as ``torch.amp.GradScaler.state_dict()``: the scale, and the count towards the
    next growth such that it grows after the same number of clean steps as DeepSpeed's would (DeepSpeed grows
    when ``cur_iter - last_overflow_iter - 1`` is a positive multiple of ``scale_window``). DeepSpeed's
    hysteresis (overflows tolerated before a back-off) and minimum scale have no GradScaler counterpart."""
    if not isinstance(scaler, DynamicLossScaler):
        return None  # a static scale (1.0 outside fp16) has no dynamic scaler state to carry
    fields = scaler.fields
    window = int(fields["scale_window"])
    stable = int(fields["cur_iter"]) - int(fields["last_overflow_iter"]) - 1  # of the next update
    next_growth = window if stable <= 0 else -(-stable // window) * window
    factor = float(fields.get("scale_factor", 2.0))
    return {"scale": float(fields["cur_scale"]), "growth_factor": factor, "backoff_factor": 1.0 / factor,
            "growth_interval": window, "_growth_tracker": window - (next_growth - stable + 1)}
