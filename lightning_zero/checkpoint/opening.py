"""Opening a checkpoint for one load: the location resolved, the commit marker read and, for a
``sharded`` checkpoint loaded by several ranks, ``.metadata`` read once for all of them.

[Note: shared metadata] A ``sharded`` checkpoint's ``.metadata`` lists every item of every rank: ~110 MB
at 1024 ranks (bench/scale.py). Were every rank to read it, a resume would read it 1024 times from the
shared file system or bucket. When a team of ranks loads, its coordinator reads the commit marker and
``.metadata`` and broadcasts them over the coordination group; every rank unpickles the metadata once
(restricted, as the file would be) and its DCP readers use it for the rest of the load, so the other
ranks never read either file. The broadcast comes first, where every rank is, before anything that may
fail on one rank only: a failed read there (no marker, no ``.metadata``, an unreachable bucket) is
raised on every rank, with a note naming the rank that read (``team.from_coordinator``). A save still
in flight is finalized first: its background collectives run over the same group. The other files
(objects file, rank files, data) are read by each rank.
"""

from __future__ import annotations

from typing import Any

from lightning_zero.checkpoint.dcp import integrity as dcp_integrity
from lightning_zero.checkpoint.formats import deepspeed_files
from lightning_zero.checkpoint.modes import OpenedCheckpoint, marker_mode
from lightning_zero.checkpoint.runtime.scheduler import checkpointer
from lightning_zero.checkpoint.runtime.team import Team, from_coordinator
from lightning_zero.checkpoint.store import storage
from lightning_zero.checkpoint.store.storage import Location
from lightning_zero.checkpoint.store.tuning import DEFAULT_TUNING, CheckpointTuning


def open_checkpoint(checkpoint: str | Location, storage_options: dict[str, Any] | None = None, *,
                    team: Team | None = None, tuning: CheckpointTuning = DEFAULT_TUNING) -> OpenedCheckpoint:
    """The checkpoint at ``checkpoint`` opened for one load, on this rank alone, or (collective) for
    every rank of ``team``, whose coordinator alone reads the marker and ``.metadata``."""
    loc = checkpoint if isinstance(checkpoint, Location) else storage.resolve(checkpoint, storage_options)
    if team is None or team.world_size == 1:
        return _open_here(loc, tuning)
    checkpointer().finalize(blocking=True)  # its background collectives use the same group

    def read() -> tuple[dict[str, Any] | None, bytes | None, bool]:
        opened = _open_here(loc, tuning)
        metadata = opened.mode.shared_metadata(opened)
        return opened.marker, metadata, opened.deepspeed

    marker, metadata, deepspeed = from_coordinator(read, team, "this checkpoint's commit marker and .metadata")
    opened = OpenedCheckpoint(loc, marker, marker_mode(loc, marker), tuning=tuning, deepspeed=deepspeed)
    if metadata is not None:
        # Unpickled here, once, on every rank (the same bytes fail the same way everywhere).
        opened.metadata = dcp_integrity.unpickle_metadata(metadata, loc.url, opened.tuning.pause_gc)
    return opened


def _open_here(loc: Location, tuning: CheckpointTuning) -> OpenedCheckpoint:
    try:
        marker = storage.read_marker(loc)
    except storage.CheckpointNotFoundError:
        # A folder of DeepSpeed's is read whole, as a full file is; looked for only where no marker is.
        if deepspeed_files.tag_folder(loc) is not None:
            return OpenedCheckpoint(loc, None, marker_mode(loc, None), tuning=tuning, deepspeed=True)
        raise
    return OpenedCheckpoint(loc, marker, marker_mode(loc, marker), tuning=tuning)
