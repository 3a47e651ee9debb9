"""The checkpoint modes, registered once by name: each is one :class:`~.base.CheckpointMode` object, in its own
module with its writes and reads (:mod:`.local`, :mod:`.sharded`, :mod:`.full`). Nothing outside ``modes/``
compares mode names: it asks the mode object ([Note: modes as objects] in base.py). (The local tier writes and
reads ``local`` rank files with :mod:`.local`'s functions, and a plain CheckpointIO's file is gathered with
:mod:`.full`'s: they use one format, whatever the mode.) Adding a mode is a module here and one row of
:data:`MODES`."""

from __future__ import annotations

from typing import Any, Literal

from lightning_zero.checkpoint.modes.base import CheckpointMode, OpenedCheckpoint, SaveTarget
from lightning_zero.checkpoint.modes.full import FullMode
from lightning_zero.checkpoint.modes.local import LocalMode
from lightning_zero.checkpoint.modes.sharded import ShardedMode
from lightning_zero.checkpoint.store.storage import CheckpointCorruptError, Location

Mode = Literal["local", "sharded", "full"]
"""The names users pass as ``mode=``."""

MODES: dict[str, CheckpointMode] = {mode.name: mode for mode in (LocalMode(), ShardedMode(), FullMode())}
"""The registry: a mode's name -> its object."""

__all__ = ["MODES", "CheckpointMode", "Mode", "OpenedCheckpoint", "SaveTarget", "marker_mode", "mode_named"]


def mode_named(name: str) -> CheckpointMode:
    """The mode users call ``name``; a ``ValueError`` naming the allowed names otherwise."""
    mode = MODES.get(name) if isinstance(name, str) else None
    if mode is None:
        raise ValueError(f"Checkpoint mode must be one of {tuple(MODES)}, got {name!r}.")
    return mode


def marker_mode(loc: Location, marker: dict[str, Any] | None) -> CheckpointMode:
    """The mode of the checkpoint at ``loc`` by its commit marker: the one a marker names; without a marker, one
    file (this package's ``full`` file, Lightning's own, a DeepSpeed folder read whole)."""
    if marker is None:
        return MODES["full"]
    name = marker.get("mode")
    mode = MODES.get(name) if isinstance(name, str) else None
    if mode is None:
        raise CheckpointCorruptError(f"Commit marker {loc.url!r} names unknown mode {name!r}; it is damaged.")
    return mode
