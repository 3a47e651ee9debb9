"""The knobs of the checkpoint I/O, one frozen value handed to every save and load.

``ZeroCheckpointIO(tuning=...)`` and the functional ``async_save``/``save``/``load`` take one; the
benchmarks pass their variants instead of changing module state, so two Trainers in one process never
see each other's settings. Each default is explained where it is used; measurements are in
BENCHMARKS.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointTuning:
    write_threads: int = 2
    """Writer threads, each with its own file, per rank of a ``sharded`` save ([Note: parallel writes]
    in dcp/adapter.py)."""
    max_read_threads: int = 4
    """Reader threads per rank of a ``sharded`` load at most; fewer when the node's ranks share few CPUs
    (``dcp_adapter.read_threads``)."""
    writeback_bytes: int = 32 * 2**20
    """Local files: start writing back dirty pages every this many bytes instead of at the final fsync
    ([Note: early writeback] in writeback.py)."""
    drop_behind: bool = True
    """Local files: drop written pages from the page cache once they are on disk ([Note: drop behind])."""
    fsync: bool = True
    """Local files: each data file of a save is fsynced (written back early on the way, [Note: early writeback])
    before the commit marker names it, so a committed checkpoint survives a power loss or a kernel crash as well as
    a killed process. ``False`` leaves the files to the page cache, as ``torch.save`` (Lightning's
    ``TorchCheckpointIO``) does: a killed process still loses nothing that was committed and the marker is still
    written after the files are whole, but a power loss can leave the newest checkpoint torn (its CRC32s then
    reject it at load) after the older one was removed. What it saves is the disk's time in the save (BENCHMARKS.md,
    "What a save costs the loop": the synchronous rows)."""
    pause_gc: bool = True
    """Pause Python's cyclic collector for each save, from its staging copy to its commit (a tiered save's durable
    phase; [Note: the collector and a save's objects] in saver.py), while DCP plans a load and while ``.metadata``
    is unpickled ([Note: no collections while planning] in dcp/adapter.py)."""

    def __post_init__(self) -> None:
        for name in ("write_threads", "max_read_threads", "writeback_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"CheckpointTuning.{name} must be at least 1, got {getattr(self, name)}.")


DEFAULT_TUNING = CheckpointTuning()
