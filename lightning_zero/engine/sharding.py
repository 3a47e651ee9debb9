"""Even-split layout arithmetic: which elements of each parameter a rank owns.

Pure arithmetic, no ``torch.distributed``: the engine, the checkpoint code and the tests all
call these functions instead of retyping the padding formula.

Every parameter is flattened, padded to ``chunk * world_size`` elements and viewed as
``[world_size, chunk]``; rank ``r`` owns row ``r``. ``chunk = ceil(numel / world_size)``, the
same chunking as ``torch.chunk`` and DTensor's ``Shard(0)``, so an unpadded shard is exactly the
local part of a 1-D DTensor of the flattened parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class EvenShard:
    """The even split of one flattened parameter of ``numel`` elements over ``world_size`` ranks."""

    numel: int
    """Real elements of the parameter."""
    world_size: int
    """Number of ranks sharing it."""

    def __post_init__(self) -> None:
        if self.numel < 0:
            raise ValueError(f"numel must be >= 0, got {self.numel}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")

    @property
    def chunk(self) -> int:
        """Elements in one rank's row, padding included."""
        return -(-self.numel // self.world_size)

    @property
    def padded_numel(self) -> int:
        return self.chunk * self.world_size

    def start(self, rank: int) -> int:
        """First flat index (into the unpadded parameter) that ``rank`` owns."""
        self._check_rank(rank)
        return min(rank * self.chunk, self.numel)

    def end(self, rank: int) -> int:
        """One past the last flat index that ``rank`` owns."""
        self._check_rank(rank)
        return min((rank + 1) * self.chunk, self.numel)

    def local_slice(self, rank: int) -> slice:
        """The elements of the flattened (unpadded) tensor that ``rank`` owns, as a slice."""
        return slice(self.start(rank), self.end(rank))

    def shard_numel(self, rank: int) -> int:
        """Real (unpadded) elements ``rank`` owns; 0 only for trailing ranks of tiny parameters."""
        return self.end(rank) - self.start(rank)

    @property
    def full_rows(self) -> int:
        """Rows made only of real elements."""
        return self.numel // self.chunk if self.chunk else 0

    @property
    def tail(self) -> int:
        """Real elements in the row after the full ones (0 when the split is exact)."""
        return self.numel - self.full_rows * self.chunk

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")


def assign_buckets(numels: Sequence[int], world_size: int, capacity_numel: int) -> list[list[int]]:
    """Split parameters (given in launch order) into consecutive buckets.

    A bucket closes once its padded size reaches ``capacity_numel`` elements, so a parameter
    larger than the capacity gets a bucket of its own. Returns lists of indices into ``numels``.
    Membership and order depend only on the arguments, so every rank computes the same buckets.
    """
    if capacity_numel < 1:
        raise ValueError(f"bucket capacity must be >= 1 element, got {capacity_numel}")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, numel in enumerate(numels):
        current.append(index)
        filled += EvenShard(numel, world_size).padded_numel
        if filled >= capacity_numel:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_shard_group_size(shard_group_size: object, world_size: int | None = None) -> None:
    """Reject a ``shard_group_size`` below 1 (or not an int), and one that does not divide ``world_size``.

    Pure, so every rank raises the same error before any collective ([Note: hybrid layout])."""
    choices = f" Valid choices at world size {world_size}: {divisors(world_size)} (or None: the whole world)." \
        if world_size is not None else ""
    if not isinstance(shard_group_size, int) or isinstance(shard_group_size, bool) or shard_group_size < 1:
        raise ValueError(f"shard_group_size must be an int >= 1 or None (shard over the whole world), got"
                         f" {shard_group_size!r}.{choices}")
    if world_size is not None and world_size % shard_group_size:
        raise ValueError(f"shard_group_size={shard_group_size} does not divide the world size {world_size}: every"
                         f" shard group must have the same number of ranks.{choices}")


@dataclass(frozen=True)
class HybridLayout:
    """Which ranks shard together and which hold the same shard.

    [Note: hybrid layout] With ``shard_group_size`` N, rank ``r`` (of the data-parallel group)
    is rank ``r % N`` of shard group ``r // N`` (consecutive ranks: one node when N is the
    number of GPUs per node) and rank ``r // N`` of replica group ``r % N`` (the ranks, one per
    shard group, that hold the same shard). ``N == world_size`` is the flat engine: one shard
    group, replica groups of one rank.
    """

    world_size: int
    shard_group_size: int

    def __post_init__(self) -> None:
        check_shard_group_size(self.shard_group_size, self.world_size)

    @property
    def num_replicas(self) -> int:
        """Shard groups, i.e. copies of every shard (the size of a replica group)."""
        return self.world_size // self.shard_group_size

    @property
    def is_flat(self) -> bool:
        return self.shard_group_size == self.world_size

    def shard_rank(self, rank: int) -> int:
        """``rank``'s position in its shard group: which row of every parameter it owns."""
        return rank % self.shard_group_size

    def replica_rank(self, rank: int) -> int:
        """``rank``'s position in its replica group: the index of its shard group."""
        return rank // self.shard_group_size

    def shard_groups(self) -> list[list[int]]:
        """Every shard group's ranks (consecutive), in the order all ranks create them."""
        n = self.shard_group_size
        return [list(range(k * n, (k + 1) * n)) for k in range(self.num_replicas)]

    def replica_groups(self) -> list[list[int]]:
        """Every replica group's ranks (strided by N), in the order all ranks create them."""
        n = self.shard_group_size
        return [list(range(j, self.world_size, n)) for j in range(n)]
