"""The three checkpoint modes by name; each mode's writes and reads are in its own module here
(:mod:`.local`, :mod:`.sharded`, :mod:`.full`), and nothing outside a mode's module knows its files."""

from __future__ import annotations

from typing import Any, Literal

from lightning_zero.checkpoint.storage import CheckpointCorruptError, Location

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
