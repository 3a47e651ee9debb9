"""The communication slots: full-size bucket buffers borrowed by the reductions and the gathers.

A bucket's packed gradients (:meth:`~lightning_zero.engine.grad_bucket.GradBucket.launch_reduce`) and its
gathered parameters (:meth:`~lightning_zero.engine.grad_bucket.GradBucket.launch_all_gather`) are the only
full-size tensors the engine makes per step; they live in a :class:`BufferPool` of ``MAX_IN_FLIGHT``
slots per device, shared by :class:`~lightning_zero.engine.grad_reducer.GradReducer` and
:class:`~lightning_zero.engine.param_gather.ParamGatherer`.

[Note: buffer pool] A bucket's ``[world_size, row_numel + k]`` buffer lives only from packing
until its reduction is folded into the shard, and a gathered ``[world_size, row_numel]`` buffer
only until it is copied into the parameters. At most ``MAX_IN_FLIGHT`` of either exist at once, so
they are slots of a :class:`BufferPool`: ``MAX_IN_FLIGHT`` flat allocations per device, each grown
to the largest bucket and reused by every bucket of a backward and of the step that follows (one
allocation per slot and step, none per bucket). Reductions and gathers never overlap in time (the
gathers are finished before the first reduction of a backward, the reductions before the step), so
they share the slots. A slot is reused only after the collective that used it was waited for.

[Note: pool between steps] The slots are dropped when a step's gathers end (the last gathered
bucket is in the parameters): between steps, when the forward's activations grow, the engine holds
its model states only, as ZeRO's accounting says, and not ``MAX_IN_FLIGHT`` buckets on top (at 2
ranks that made zero2 hold more than DDP). The next backward takes them again from the allocator,
which has kept the freed blocks: CUDA's caching allocator reuses them with no ``cudaMalloc`` (and
lends them to the forward's activations meanwhile), glibc's malloc serves the same sizes from its
heap once its mmap threshold has risen to them. They are dropped on the training thread once it
has waited for every gather, so on CUDA the current stream is already ordered after the side
stream's last use of them. Between the reductions and the step's gathers they stay: the gathers
follow at once and reuse them.
"""

from __future__ import annotations

import torch
from torch import Tensor

MAX_IN_FLIGHT = 2
"""Full-size bucket buffers (reductions or gathers) alive at once; see [Note: buffer pool]."""


class BufferPool:
    """``slots`` reusable flat buffers per device ([Note: buffer pool])."""

    def __init__(self, slots: int = MAX_IN_FLIGHT) -> None:
        self.slots = slots
        self._storage: dict[tuple[torch.device, int], Tensor] = {}  # 1D uint8
        self._busy: set[tuple[torch.device, int]] = set()
        # The most bytes each slot was asked for: a slot taken again after ``release`` is allocated
        # at that size at once, not grown bucket by bucket (one allocation per slot and step).
        self._high_water: dict[tuple[torch.device, int], int] = {}

    def take(self, slot: int, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A 1D ``dtype`` view of ``numel`` elements of slot ``slot`` (growing it if needed)."""
        key = (device, slot % self.slots)
        assert key not in self._busy, f"buffer slot {key} taken twice: a collective would overwrite it"
        nbytes = numel * dtype.itemsize
        if key not in self._storage or self._storage[key].numel() < nbytes:
            # The smaller allocation is freed before the bigger one is made; slots grow to the
            # largest bucket during the first backward and step.
            self._storage.pop(key, None)
            self._high_water[key] = max(nbytes, self._high_water.get(key, 0))
            self._storage[key] = torch.empty(self._high_water[key], dtype=torch.uint8, device=device)
        self._busy.add(key)
        return self._storage[key][:nbytes].view(dtype)

    def give_back(self, slot: int, device: torch.device) -> None:
        self._busy.discard((device, slot % self.slots))

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds now (what the bounded-memory checks read)."""
        return sum(t.numel() for t in self._storage.values())

    @property
    def high_water_bytes(self) -> int:
        """Bytes the pool holds while a backward or a step's gathers run (0 before the first)."""
        return sum(self._high_water.values())

    def clear(self) -> None:
        """Drop every slot (engine close; callers have waited for their collectives)."""
        self._storage.clear()
        self._busy.clear()
        self._high_water.clear()

    def release(self) -> None:
        """Drop the idle slots between steps ([Note: pool between steps]). A slot still marked in
        use (only after a failed collective) is kept: something may still write into it."""
        for key in [key for key in self._storage if key not in self._busy]:
            del self._storage[key]
