"""The three checkpoint modes by name; each mode's writes and reads are in its own module here
(:mod:`.local`, :mod:`.sharded`, :mod:`.full`), and nothing outside a mode's module knows its files."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_zero.checkpoint.store import file_io
from lightning_zero.checkpoint.store.storage import CheckpointCorruptError, Location, version_dir_of
from lightning_zero.checkpoint.store.tuning import DEFAULT_TUNING, CheckpointTuning

Mode = Literal["local", "sharded", "full"]
MODES: tuple[Mode, ...] = ("local", "sharded", "full")


def validate_mode(mode: str) -> Mode:
    if mode not in MODES:
        raise ValueError(f"Checkpoint mode must be one of {MODES}, got {mode!r}.")
    return mode  # type: ignore[return-value]


def validate_marker_mode(loc: Location, marker: dict[str, Any]) -> Mode:
    mode = marker.get("mode")
    if mode not in MODES:
        raise CheckpointCorruptError(f"Commit marker {loc.url!r} names unknown mode {mode!r}; it is damaged.")
    return mode  # type: ignore[return-value]


@dataclass
class OpenedCheckpoint:
    """One checkpoint as one load sees it, built once per load (``opening.open_checkpoint``) and handed
    to every read of that load: its location resolved once, its commit marker read once (None for a
    ``full`` file), and what one read found that a later one reuses."""

    loc: Location
    marker: dict[str, Any] | None
    mode: Mode
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
