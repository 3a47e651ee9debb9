"""Shape-aware optimizers (Muon, Adafactor) stepped exactly on evenly sharded state.

[Note: whole-matrix step] Between steps a shape-aware optimizer's parameters are held like any
other: the fp32 master as this rank's even shard (sharding.py), every state tensor shaped
like the parameter (Muon's momentum, Adafactor's vector variance) as the same even shard, and every
other state value (Adafactor's ``step``, its row and column factors: small) whole and identical on
every rank of the shard group. Checkpoints therefore see the same tree as for AdamW (flat shards
plus replicated small tensors) and reshard to any world size. For the step itself, the reduced
gradient shards and the split state of the parameters that got a gradient are all-gathered over the
shard group (one collective per dtype), and so are the master shards unless the parameters are fp32
(the module then already holds them exactly: gathered after the last step). Every rank runs the
user's optimizer on the full-shape tensors in one ``step()`` together with the elementwise ones,
keeps its own slices and drops the full tensors. Every rank computes the same update (the
"Distributed Muon" of the Moonlight report, arXiv 2502.16982): nothing has to be broadcast
afterwards, the replicated state stays identical without a collective, and no rank learns a state
layout from another.

Why not whole-parameter owners (ZeroRedundancyOptimizer, DeepSpeed's Muon): the owner's state would
exist on one rank only, so the checkpoint tree would differ between ranks (DCP's load checks each
rank's keys against every key saved), resharding would have to reassign owners, and the balance
would depend on parameter sizes again. The cost here, per step: the all-gather (each rank receives
(ws-1)/ws of the full tensors; fp32 Muon: gradient and momentum, 2 x the matrices' bytes; Adafactor's
matrices: the gradient alone, their factors being whole), the update computed on every rank instead
of once, and full-size temporaries of the shape-aware parameters during the step, bounded by stepping
Muon's and Adafactor's parameters a group at a time (``ZeroConfig.whole_step_group_mb``; BENCHMARKS.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.engine import collectives as comm
from lightning_zero.engine.grad_bucket import ShardedParam
from lightning_zero.engine.sharding import EvenShard

MASTERS_FROM_MODULE = True
"""Take fp32 parameters' full masters from the module instead of gathering them (False: always gather;
the tests run both)."""


def is_split_state(key: str, value: Any, param_shape: torch.Size) -> bool:
    """Whether a shape-aware optimizer's state value (in full form) is held as even shards between
    steps: a tensor shaped like the parameter. A 0-dim parameter's state is shaped like the scalar
    ``step``; the key decides there. (The rule of ``full`` checkpoints too: checkpoint/engine_tree.py.)"""
    return isinstance(value, Tensor) and value.shape == param_shape and (len(param_shape) > 0 or key != "step")


class WholeParamStep:
    """Runs the user's shape-aware optimizer on full-shape parameters and state, and puts back the
    slices this rank holds ([Note: whole-matrix step]).

    :meth:`run` is the whole step, on every rank of the shard group alike (collective when
    ``gather``). Parameters come in param-group order; those whose ``has_grad`` is False (the same
    on every rank) take no part. ``max_group_bytes`` bounds the full-size temporaries alive at once:
    an optimizer whose update is per parameter (``per_parameter``) is stepped one group of
    parameters at a time, each group's full tensors freed before the next is gathered."""

    def __init__(self, inner: Optimizer, sharded_params: list[ShardedParam], group: dist.ProcessGroup | None,
                 per_parameter: bool = False, max_group_bytes: int | None = None) -> None:
        self.inner = inner
        # The optimizer's own list, not a copy: parameters it takes on later are stepped whole too.
        self.sharded_params = sharded_params
        self.group = group
        self.per_parameter = per_parameter
        self.max_group_bytes = max_group_bytes
        for sp in self.sharded_params:
            sp.shape_aware = True
        self._active: list[tuple[ShardedParam, nn.Parameter]] = []
        self._hidden: list[tuple[ShardedParam, Tensor]] = []
        self.gathered_bytes = 0
        """Bytes this rank received in the last :meth:`run` (what the benchmarks read)."""
        self.groups_stepped = 0
        """Inner ``step()`` calls of the last :meth:`run`."""

    def run(self, inner_step: Callable[[], Any], gather: bool = True) -> None:
        """``inner_step()`` once per group of parameters, each group's full tensors swapped in.

        ``gather=False`` (creating state before a checkpoint load): no collective; the full tensors
        are zeros, which is all a zero-lr step needs (its state is overwritten by the load)."""
        for sp in self.sharded_params:
            sp.shape_aware = True
        self.gathered_bytes = self.groups_stepped = 0
        stepped = [sp for sp in self.sharded_params if sp.has_grad or not gather]
        for members in self._groups(stepped):
            self._begin(members, gather)
            try:
                inner_step()
            finally:
                self._end(write_masters=gather)
            self.groups_stepped += 1

    def _groups(self, stepped: list[ShardedParam]) -> list[list[ShardedParam]]:
        """All at once, or (``per_parameter``) consecutive groups whose full fp32 gradient, master and
        state (estimated as three copies) stay within ``max_group_bytes``; one parameter at least."""
        if not stepped:
            return []
        if not self.per_parameter or self.max_group_bytes is None:
            return [stepped]
        groups: list[list[ShardedParam]] = [[]]
        filled = 0
        for sp in stepped:
            size = 3 * sp.param.numel() * sp.master.element_size()
            if groups[-1] and filled + size > self.max_group_bytes:
                groups.append([])
                filled = 0
            groups[-1].append(sp)
            filled += size
        return groups

    def _begin(self, members: list[ShardedParam], gather: bool) -> None:
        """Hand the optimizer full-shape parameters with full gradients and state for ``members``;
        every other parameter's gradient is hidden, so this call leaves it alone."""
        chosen = set(map(id, members))
        self._hidden = [(sp, sp.master.grad) for sp in self.sharded_params
                        if id(sp) not in chosen and sp.master.grad is not None]
        for sp, _ in self._hidden:
            sp.master.grad = None
        self._active = [(sp, _full_param(sp)) for sp in members]
        pieces: list[tuple[Tensor, Tensor, EvenShard]] = []  # (this rank's shard, full 1-D target, layout)
        for sp, full in self._active:
            grad = torch.empty_like(full)
            if gather and MASTERS_FROM_MODULE and sp.param.dtype == full.dtype:
                # The module holds exactly the gathered masters (the step finished the gathers and
                # took in writes into the module): no need to gather them again.
                full.data.copy_(sp.param.detach())
            else:
                pieces.append((sp.master.detach(), full.data.view(-1), sp.layout))
            pieces.append((sp.master.grad if sp.master.grad is not None else sp.grad_shard, grad.view(-1), sp.layout))
            full.grad = grad
            state = self.inner.state.pop(sp.master, None)
            if state:
                full_state = {}
                for key, value in state.items():
                    if key in sp.split_state_keys:
                        full_state[key] = torch.empty(sp.param.shape, dtype=value.dtype, device=value.device)
                        pieces.append((value, full_state[key].view(-1), sp.layout))
                    else:
                        full_state[key] = value
                self.inner.state[full] = full_state
        if gather:
            self.gathered_bytes += _all_gather_pieces(pieces, self.group)
        else:
            for _, target, _ in pieces:
                target.zero_()
        swap_params(self.inner, {sp.master: full for sp, full in self._active})

    @torch.no_grad()
    def _end(self, write_masters: bool = True) -> None:
        """Keep this rank's slices of the updated parameters and split state; drop the full tensors."""
        swap_params(self.inner, {full: sp.master for sp, full in self._active})
        for sp, full in self._active:
            if write_masters:
                sp.master.copy_(sp.own_elements(full))
            state = self.inner.state.pop(full, None)
            full.grad = None
            if not state:
                continue
            split = {key for key, value in state.items() if is_split_state(key, value, sp.param.shape)}
            sp.split_state_keys = frozenset(split)
            # A clone: the slice alone stays alive, not the full tensor it was cut from.
            self.inner.state[sp.master] = {key: sp.own_elements(value).clone() if key in split else value
                                           for key, value in state.items()}
        for sp, grad in self._hidden:
            sp.master.grad = grad
        self._active, self._hidden = [], []


def _full_param(sp: ShardedParam) -> nn.Parameter:
    return nn.Parameter(torch.empty(sp.param.shape, dtype=sp.master.dtype, device=sp.master.device))


def swap_params(inner: Optimizer, replace: dict[Tensor, Tensor]) -> None:
    """Replace tensors in the optimizer's param-group lists, in place (every holder of a list sees it)."""
    for group in inner.param_groups:  # in place: whoever holds a group's list sees the same one
        group["params"][:] = [replace.get(p, p) for p in group["params"]]


def _all_gather_pieces(pieces: list[tuple[Tensor, Tensor, EvenShard]], group: dist.ProcessGroup | None) -> int:
    """All-gather every shard into its full target: one collective per dtype, shards padded to their
    chunk and packed in order (the bucket layout's rows). Returns the bytes received."""
    world_size = dist.get_world_size(group)
    received = 0
    by_dtype: dict[torch.dtype, list[tuple[Tensor, Tensor, EvenShard]]] = {}
    for piece in pieces:
        by_dtype.setdefault(piece[0].dtype, []).append(piece)
    for dtype, members in by_dtype.items():
        row_numel = sum(layout.chunk for _, _, layout in members)
        device = members[0][1].device
        gather_input = torch.zeros(row_numel, dtype=dtype, device=device)  # 1D, padding stays zero
        offset = 0
        for shard, _, layout in members:
            gather_input[offset: offset + shard.numel()].copy_(shard)
            offset += layout.chunk
        gathered = torch.empty(world_size * row_numel, dtype=dtype, device=device)  # 1D
        comm.wait(comm.all_gather(gathered, gather_input, group, async_op=False))
        rows = gathered.view(world_size, row_numel)
        offset = 0
        for _, target, layout in members:
            comm.copy_rows_to_flat(target, rows[:, offset: offset + layout.chunk], layout)
            offset += layout.chunk
        received += (world_size - 1) * row_numel * gathered.element_size()
    return received
