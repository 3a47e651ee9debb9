"""The interface every checkpoint mode implements (:class:`CheckpointMode`), what one save hands its
``write`` (:class:`SaveTarget`) and one checkpoint as one load sees it (:class:`OpenedCheckpoint`).

[Note: modes as objects] A mode is one object (torch DCP's planners are the model): the verbs (``saver``,
``loader``, ``opening``, ``reader``) and the front ends ask it what to do and never compare mode names, so that
adding a mode is a module of ``modes/`` and one row of the registry in ``modes/__init__.py``
(tests/test_code_layout.py holds both). The names users pass (``mode="sharded"``) and the ``mode`` field of a
commit marker are the objects' :attr:`CheckpointMode.name`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_zero.checkpoint.formats.tree import (
    FlatShard,
    check_same_keys,
    is_tensor_leaf,
    refuse_other_shape,
    tensor_leaves,
    walk,
)
from lightning_zero.checkpoint.runtime.team import Team
from lightning_zero.checkpoint.store import file_io
from lightning_zero.checkpoint.store.storage import Location, version_dir_of
from lightning_zero.checkpoint.store.tuning import DEFAULT_TUNING, CheckpointTuning


@dataclass(frozen=True)
class SaveTarget:
    """Where and how one save writes, the same on every rank of ``team`` (agreed in the save's first exchange)."""

    loc: Location
    version_dir: str
    """The fresh version directory the coordinator named ("" where the mode does not
    :attr:`~CheckpointMode.commits_with_marker`)."""
    team: Team
    save_id: str
    signatures: list[Any]
    """Every rank's :meth:`CheckpointMode.plan_signature`, in rank order."""
    tuning: CheckpointTuning = DEFAULT_TUNING
    header: bool = True
    """False: a plain file, the state exactly, without the integrity header ([Note: model-only saves])."""


class CheckpointMode(ABC):
    """How one checkpoint mode writes, commits and reads; one instance per mode, registered by :attr:`name`.

    Call order of a save (``saver``; every rank makes each call, on the save's worker thread unless marked):

    1. (training thread) :meth:`check_save`: refuse what this mode cannot save, before anything is queued.
    2. :meth:`to_stage`, then staging (:attr:`stages_flat`: into a few flat buffers).
    3. :meth:`write_directory` (the preflight's directory) and :meth:`plan_signature`, exchanged before any data
       is written; (coordinator) a fresh version directory where :attr:`commits_with_marker`.
    4. :meth:`write`: this rank's files (and whatever collectives the mode needs, on ``target.team``).
    5. (coordinator) the commit marker, where :attr:`commits_with_marker`; then :meth:`bytes_written` for the
       save's figures.

    Call order of a load (``opening``, ``loader``, ``lightning/resume.py``; every rank unless marked):

    1. (a team's coordinator) :meth:`shared_metadata`, broadcast to every rank ([Note: shared metadata]).
    2. (a resume, before its targets exist) :meth:`saved_tensor_keys` and :meth:`saved_objects`.
    3. :meth:`prepare_load`: read and check without touching the state; the ranks agree; then the callable it
       returns fills the state (collectively over the team where the mode reads collectively).

    (one process, no process group) :meth:`read_whole`: the saved tree with whole tensors (``reader``, ``convert``).

    The front ends branch on the attributes below (which tree a save builds, how a resume reads), never on names.
    """

    name: str
    """The name users pass (``ZeroCheckpointIO(mode=...)``) and the commit marker records."""
    commits_with_marker: bool = True
    """Written into a fresh version directory that a commit marker, written last by the coordinator, names;
    False: one file whose rename commits it (no version directory, no marker). (The saver.)"""
    gathers_to_rank0: bool = False
    """Every rank's shards are gathered over the whole world to rank 0, which alone writes: no process group of
    its own, and nothing of each rank's own shards kept, so a local tier cannot start from it. (The plugin.)"""
    lightning_format: bool = False
    """The checkpoint is Lightning's own dict (``state_dict``, ``optimizer_states`` per parameter, the module's own
    parameters), written and read whole; False: the engine's tree of flat shards (lightning/lightning_tree.py).
    (The trees a save builds, the resume, the readers.)"""
    stages_flat: bool = False
    """Staged into one flat buffer per dtype, which the rank file packs ([Note: packed rank files]). (The saver.)"""
    plans_layout: bool = False
    """A rank file of many small CPU tensors has its layout planned on the training thread when the save is
    queued, and staging fills the plan ([Note: pack plans] in formats/packed.py). (The saver.)"""

    def __repr__(self) -> str:
        return f"<checkpoint mode {self.name!r}>"

    # ---- save ---------------------------------------------------------------------------------

    def check_save(self, team: Team, plain: bool) -> None:
        """(every rank, training thread) Refuse a save this mode cannot make: ``plain`` (one file, the state
        exactly) is a one-file mode's."""
        if plain:
            raise ValueError(f"plain=True writes one file: it takes mode='full', got {self.name!r}.")

    def to_stage(self, state: Any, rank: int) -> Any:
        """What rank ``rank`` stages of ``state``: all of it unless a mode writes less there."""
        return state

    def write_directory(self, loc: Location, rank: int) -> str | None:
        """The directory rank ``rank`` writes into, probed before any data is written (None: it writes nothing)."""
        return loc.data_root()

    def plan_signature(self, state: Any) -> Any:
        """What this rank's tree looks like to a cached write plan ([Note: cached save plans]); None: no plan."""
        return None

    @abstractmethod
    def write(self, state: Any, target: SaveTarget) -> int | None:
        """(every rank) This rank's part of the checkpoint; the bytes its write plan gave it (None: unplanned)."""

    @abstractmethod
    def bytes_written(self, state: Any, rank: int) -> int:
        """Tensor bytes rank ``rank`` wrote of the staged ``state`` (``SaveStats.bytes_written``)."""

    # ---- load ---------------------------------------------------------------------------------

    def shared_metadata(self, opened: OpenedCheckpoint) -> bytes | None:
        """(a team's coordinator) What it reads once for every rank of a load; None: nothing."""
        return None

    @abstractmethod
    def saved_tensor_keys(self, opened: OpenedCheckpoint) -> set[str]:
        """Paths of the tensors the checkpoint holds, read before the load's targets exist."""

    @abstractmethod
    def saved_objects(self, opened: OpenedCheckpoint) -> dict[str, Any]:
        """The saved tree's non-tensor content (param groups, the trainer's state), read before the load."""

    @abstractmethod
    def prepare_load(self, state_dict: dict[str, Any], opened: OpenedCheckpoint, team: Team,
                     strict: bool = True) -> Callable[[], dict[str, Any]]:
        """Read and check without touching ``state_dict``; returns what completes the load."""

    @abstractmethod
    def read_whole(self, opened: OpenedCheckpoint, optimizer: bool) -> dict[str, Any]:
        """(one process) The saved tree with every tensor whole (``optimizer=False``: the model only)."""


@dataclass
class OpenedCheckpoint:
    """One checkpoint as one load sees it, built once per load (``opening.open_checkpoint``) and handed
    to every read of that load: its location resolved once, its commit marker read once (None for a
    ``full`` file), and what one read found that a later one reuses."""

    loc: Location
    marker: dict[str, Any] | None
    mode: CheckpointMode
    metadata: Any = None
    """``sharded``: the DCP ``Metadata`` the team's coordinator read for every rank ([Note: shared
    metadata] in opening.py); None: each DCP reader reads ``.metadata`` itself."""
    tuning: CheckpointTuning = DEFAULT_TUNING
    """Reader threads and the collector pause of this load's reads."""
    read_ahead: dict[str, Any] = field(default_factory=dict)
    """``local``: rank files already read and verified (the key check reads the file the load uses)."""
    deepspeed: bool = False
    """A DeepSpeed ZeRO-1/2 checkpoint folder (mode ``full``): read whole, into Lightning's format, by
    :mod:`~lightning_zero.checkpoint.formats.deepspeed_in` (``reader.read_full_content``)."""
    _version_dir_checked: bool = False

    @property
    def url(self) -> str:
        return self.loc.url

    @property
    def version_dir(self) -> str:
        assert self.marker is not None, "a full checkpoint has no version directory"
        return version_dir_of(self.loc, self.marker)

    def existing_version_dir(self) -> str:
        """The version directory, checked to exist (once per load)."""
        assert self.marker is not None
        if not self._version_dir_checked:
            file_io.existing_version_dir(self.loc, self.marker)
            self._version_dir_checked = True
        return self.version_dir


# ---- what the modes' loads and figures share ------------------------------------------------


def tensor_bytes(state: Any, whole_shards: bool, replicated: bool) -> int:
    """Tensor bytes of ``state``: each flat shard's own elements (``whole_shards``: the whole tensor's, gathered),
    and the replicated tensors if ``replicated`` (this rank writes its copy of them)."""
    total = 0
    for _, leaf in tensor_leaves(state):
        if isinstance(leaf, FlatShard):
            total += leaf.local.element_size() * (leaf.numel if whole_shards else leaf.local.numel())
        elif replicated:
            total += leaf.numel() * leaf.element_size()
    return total


def check_into(target: Any, source: Any, url: str, file: str, strict: bool = True) -> None:
    """Same tensor keys and the same shapes (a flat shard of another shape has the same element count)."""
    check_same_keys(
        {"/".join(p) for p, leaf in walk(target) if is_tensor_leaf(leaf)},
        {"/".join(p) for p, leaf in walk(source) if is_tensor_leaf(leaf)},
        url,
        strict,
    )
    found = {"/".join(p): leaf for p, leaf in walk(source)}
    for path, leaf in walk(target):
        if not is_tensor_leaf(leaf):
            continue
        key = "/".join(path)
        value = found[key]
        saved_shape = tuple(value.shape)
        if isinstance(leaf, FlatShard) and isinstance(value, FlatShard):
            ok = value.shape == leaf.shape and value.local.numel() == leaf.local.numel()
        else:
            ok = saved_shape == tuple(leaf.shape)
        if not ok:
            refuse_other_shape(key, saved_shape, tuple(leaf.shape), url, file)


def copy_into(target: Any, source: Any, url: str) -> dict[str, Any]:
    found = {"/".join(p): leaf for p, leaf in walk(source)}
    with torch.no_grad():
        for path, leaf in walk(target):
            if not is_tensor_leaf(leaf):
                continue
            value = found["/".join(path)]
            if isinstance(leaf, FlatShard):
                if isinstance(value, FlatShard):
                    leaf.local.copy_(value.local)
                else:
                    leaf.load_from_full(value)
            else:
                leaf.copy_(value)
    return source
