"""Nested checkpoint state: the sharded leaf type and the tree walks every mode shares."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_zero.engine.sharding import EvenShard


@dataclass
class FlatShard:
    """This rank's piece of a tensor that is flattened and split evenly over the ranks.

    ``local`` holds elements ``[layout.start(rank), layout.end(rank))`` of the flattened tensor:
    exactly the local part of a 1-D DTensor with ``Shard(0)`` placement, so ``sharded`` mode
    saves it as one, and any other world size can read it back.

    Hybrid sharding ([Note: hybrid layout] in engine/sharding.py): ``rank`` and ``world_size`` are the
    position in and the size of the shard group, and ``replicas`` shard groups hold the same
    split; this rank is in shard group ``replica_rank``. As a DTensor that is the 2-D mesh
    ``(replicas, world_size)`` with placements ``[Replicate(), Shard(0)]``.
    """

    local: Tensor  # 1D
    shape: tuple[int, ...]  # the full tensor's shape
    rank: int  # in the shard group
    world_size: int  # the shard group's size
    replicas: int = 1
    replica_rank: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def layout(self) -> EvenShard:
        return EvenShard(self.numel, self.world_size)

    def load_from_full(self, full: Tensor) -> None:
        """Fill ``local`` from the whole tensor (any world size wrote it)."""
        if full.numel() != self.numel:
            raise ValueError(f"expected {self.numel} elements {self.shape}, checkpoint has {tuple(full.shape)}")
        self.local.copy_(full.reshape(-1)[self.layout.local_slice(self.rank)])


Leaf = Any
Path = tuple[str, ...]


class StableDict(dict):  # type: ignore[type-arg]
    """A subtree its maker hands out again, the same object, only while every leaf under it is the same object
    (and is not to be changed by whoever receives it): a save's walks may keep what they found in it.

    [Note: stable subtrees] A save of a model of many small parameters built the optimizer's state as a new tree
    of thousands of leaves, and the ``local`` pack plan walked it, on the training thread at every save (a third
    of that thread's part of a save: BENCHMARKS.md, "What is the same from save to save is kept"). The leaves are
    the same tensors from save to save (the optimizer updates its state in place), so the engine's tree keeps
    each optimizer's state as one of these while its values are the same tensors at the same addresses and shapes,
    or immutable scalars (``engine_tree.zero_state_dict`` checks them; a value that is a container, which could
    change inside, makes a new tree each save), and the pack plan replays what it found in one (``packed.plan``).
    Anything that would change such a subtree builds a new one instead. The engine drops what it keeps when it
    loads state, rebuilds or closes, so that no replaced tensor is kept alive."""

    __slots__ = ()


def walk(tree: Any, path: Path = ()) -> Iterator[tuple[Path, Leaf]]:
    """Leaves in a deterministic order (dict insertion order), the same on every rank. Built as a list
    by plain recursion and then yielded: a recursive generator resumes every level above a leaf for
    each leaf, which a save's tree of thousands of leaves pays while holding the GIL."""
    out: list[tuple[Path, Leaf]] = []
    _walk_into(tree, path, out)
    return iter(out)


def _walk_into(tree: Any, path: Path, out: list[tuple[Path, Leaf]]) -> None:
    if isinstance(tree, dict):
        for key, value in tree.items():
            _walk_into(value, (*path, str(key)), out)
    elif isinstance(tree, (list, tuple)) and not _is_plain_sequence(tree):
        for index, value in enumerate(tree):
            _walk_into(value, (*path, str(index)), out)
    else:
        out.append((path, tree))


def map_leaves(tree: Any, fn: Callable[[Leaf], Any]) -> Any:
    if isinstance(tree, dict):
        return {key: map_leaves(value, fn) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)) and not _is_plain_sequence(tree):
        mapped = [map_leaves(value, fn) for value in tree]
        return mapped if isinstance(tree, list) else tuple(mapped)
    return fn(tree)


def snapshot(tree: Any, fenced: Callable[[Tensor], bool] | None = None) -> Any:
    """``tree`` with every tensor inside dicts, lists and tuples replaced by a detached copy, and every
    container on the way to one copied as its own type (an ``AttributeDict`` stays one); other leaves
    as they are. For state a save holds that the optimizer's staging fence does not protect: a
    callback's averaged weights change in place after the save was queued ([Note: staging on GPUs]).
    ``fenced(tensor)`` true: the tensor is one the fence protects (a parameter), kept as it is."""
    if isinstance(tree, Tensor):
        return tree if fenced is not None and fenced(tree) else tree.detach().clone()
    if isinstance(tree, dict):
        copied = copy.copy(tree)
        for key, value in tree.items():
            copied[key] = snapshot(value, fenced)
        return copied
    if isinstance(tree, list):
        return [snapshot(value, fenced) for value in tree]
    if isinstance(tree, tuple):
        items = [snapshot(value, fenced) for value in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    return tree


def map_with_path(tree: Any, fn: Callable[[str, Leaf], Any], path: Path = (),
                  is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """:func:`map_leaves` with each leaf's ``/``-joined path (its key in DCP and in checkpoint files).
    ``is_leaf`` marks containers to hand to ``fn`` whole."""
    if is_leaf is not None and is_leaf(tree):
        return fn("/".join(path), tree)
    if isinstance(tree, dict):
        return {key: map_with_path(value, fn, (*path, str(key)), is_leaf) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)) and not _is_plain_sequence(tree):
        mapped = [map_with_path(value, fn, (*path, str(i)), is_leaf) for i, value in enumerate(tree)]
        return mapped if isinstance(tree, list) else tuple(mapped)
    return fn("/".join(path), tree)


def _is_plain_sequence(seq: list | tuple) -> bool:
    """A list of numbers/strings (betas, param names) is one leaf, not a subtree."""
    return all(isinstance(v, (int, float, str, bool, type(None))) for v in seq)


def is_tensor_leaf(leaf: Leaf) -> bool:
    return isinstance(leaf, (Tensor, FlatShard))


def tensor_paths(tree: Any) -> set[str]:
    return {"/".join(path) for path, leaf in walk(tree) if is_tensor_leaf(leaf)}


def refuse_other_shape(key: str, saved: tuple[int, ...], own: tuple[int, ...], url: str,
                       file: str | None = None) -> None:
    """The error for a tensor saved with another shape than the model's (a flat shard of another shape
    may have the same element count and would load silently)."""
    where = f" ({file!r})" if file else ""
    raise ValueError(
        f"Checkpoint {url!r}{where} holds {key!r} with shape {saved}, this model has {own}: it was saved from"
        " another model. Load it into the model it was saved from."
    )


def check_same_keys(expected: set[str], found: set[str], url: str, strict: bool = True) -> None:
    """``strict=False``: keys found beyond the expected ones are allowed (every expected one must be there)."""
    missing, unexpected = sorted(expected - found), sorted(found - expected) if strict else []
    if missing or unexpected:
        raise KeyError(
            f"Checkpoint {url!r} does not match this model/optimizer: missing keys {missing[:20]}"
            f"{' ...' if len(missing) > 20 else ''}, unexpected keys {unexpected[:20]}"
            f"{' ...' if len(unexpected) > 20 else ''}. It was probably saved from another model; load it into"
            " the model it was saved from (a LightningModule with `strict_loading = False` keeps its own values of"
            " weights the checkpoint lacks and ignores the ones it has in excess)."
        )


def shard_group_size_of(state: Any, world_size: int) -> int:
    """The shard group size the flat shards of ``state`` were split over (the world without any)."""
    return next((leaf.world_size for _, leaf in walk(state) if isinstance(leaf, FlatShard)), world_size)


def tensor_leaves(tree: Any) -> Iterator[tuple[str, Tensor | FlatShard]]:
    for path, leaf in walk(tree):
        if is_tensor_leaf(leaf):
            yield "/".join(path), leaf
