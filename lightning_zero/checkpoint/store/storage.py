"""Where checkpoints live: locations (a path and the store that serves it), the commit marker and its format,
version directories and the errors a user reads. What differs between stores is the store's ([Note: storage seam]
in backend.py).

[Note: checkpoint layout] A checkpoint at ``<parent>/<name>`` is

* ``full`` mode: one ordinary ``torch.save`` file at ``<parent>/<name>``;
* ``local`` / ``sharded`` mode: a small *commit marker* (see [Note: marker format]) at ``<parent>/<name>`` and the data in
  ``<parent>/_zero_data/<name>/<version>/``.

The marker is written last, by one coordinator, once every rank's files are complete, and it
names the version directory it commits. Writing a checkpoint under a name that exists (Lightning's
``last.ckpt``) writes a fresh version directory, then replaces the marker, then deletes the
old version: at every moment the name points at a complete checkpoint. The marker replacement
is atomic: ``os.replace`` on local disks, a single PUT on S3 (which has no rename). Because the
checkpoint path is a file, Lightning's own ``ckpt_path="last"`` lookup, which asks the
filesystem for a modification time, works on S3 too (Lightning #18261 fails on directories).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import uuid
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from lightning_zero.checkpoint.store.backend import Failure, Store
from lightning_zero.checkpoint.store.local import replace_whole
from lightning_zero.checkpoint.store.registry import resolve_store

__all__ = ["replace_whole"]

MARKER_FORMAT = "lightning_zero"
MARKER_VERSION = 2
DATA_DIR = "_zero_data"


class CheckpointNotFoundError(FileNotFoundError):
    """The path holds no (complete) checkpoint."""


class CheckpointCorruptError(RuntimeError):
    """The checkpoint is committed but its data is missing or damaged."""


RESUME_ELSEWHERE = "Resume from another checkpoint."
"""The advice that ends a :class:`CheckpointCorruptError` read by a user; a recovery that goes on to another
checkpoint by itself leaves it out of what it reports (``tier_recovery``)."""


@dataclass(frozen=True)
class Location:
    """A checkpoint path resolved to the store that serves it ([Note: storage seam] in backend.py)."""

    store: Store
    path: str  # without protocol, as the store expects it
    url: str  # as the user gave it, for messages

    @property
    def fs(self) -> Any:
        """An fsspec file system over the same store, for code outside the package (``Store.fs``)."""
        return self.store.fs

    @property
    def parent(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[0] if "/" in self.path.rstrip("/") else ""

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def at(self, path: str, url: str | None = None) -> Location:
        """Another path of the same store."""
        return Location(self.store, path, url if url is not None else self.store.url(path))

    def data_root(self) -> str:
        """Directory holding every version of this checkpoint's data."""
        return join_paths(self.parent, DATA_DIR, self.name)

    def new_version_dir(self) -> str:
        return join_paths(self.data_root(), uuid.uuid4().hex[:12])

    def join(self, *parts: str) -> str:
        return join_paths(*parts)


def join_paths(*parts: str) -> str:
    """Parts of a path or URL joined by one slash each."""
    return "/".join(p.rstrip("/") for p in parts if p)


def resolve(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Location:
    """The location of checkpoint path ``url``, served by the store its scheme and ``storage_options["client"]``
    choose (:mod:`~lightning_zero.checkpoint.store.registry`)."""
    return Location(*resolve_store(url, storage_options))


def keeps_partial_writes(loc: Location, errors: list[str]) -> bool:
    """Whether a failed save leaves its partial version in place: when the store stopped answering
    (every further call would wait out its timeouts and retries too). Nothing points at the version,
    and the next successful save of the name deletes it with the other stale versions."""
    return any(loc.store.classify_text(error) is Failure.TRANSIENT for error in errors)


def storage_error(loc: Location, action: str, exc: BaseException) -> OSError:
    """A clear error for an unreachable bucket, refused access or a full disk; no credentials in it."""
    text = f"{type(exc).__name__}: {exc}"
    return OSError(f"Could not {action} checkpoint at {loc.url!r}: {loc.store.hint(loc.store.classify(exc))}. ({text})")


MARKER_KEY = "lightning_zero"
"""The key of a marker's own fields inside the marker file."""

_MARKER_NOTE = (
    "This file is the commit marker of a sharded lightning_zero checkpoint; its tensors are in {data}."
    " `import lightning_zero` makes LightningModule.load_from_checkpoint read it; `lightning-zero convert"
    " SRC DST` turns it into one ordinary Lightning file."
)


def write_marker(loc: Location, marker: dict[str, Any], lightning_fields: dict[str, Any] | None = None) -> None:
    """(coordinator) Commit: atomically make ``loc`` point at a complete checkpoint.

    [Note: marker format] The marker is a tiny ``torch.save`` file holding no tensor, not JSON, so
    that everything that opens a Lightning checkpoint path with ``torch.load(weights_only=True)``
    reads it: LightningCLI's ``--ckpt_path`` (which reads ``hyper_parameters`` before anything
    runs), a user's ``torch.load(path)``, Lightning's ``load_from_checkpoint`` (made to follow the
    marker by ``import lightning_zero``). ``lightning_fields`` are Lightning's small top-level
    keys (hyper-parameters, versions, epoch, step), copied so those readers find them.
    """
    fields = {"format": MARKER_FORMAT, "version": MARKER_VERSION, **marker}
    content = {**(lightning_fields or {}), MARKER_KEY: fields, "note": _MARKER_NOTE.format(data=marker.get("data"))}
    buffer = io.BytesIO()
    torch.save(content, buffer)
    payload = buffer.getvalue()
    if loc.parent:
        loc.store.makedirs(loc.parent)
    loc.store.publish(loc.path, payload)


@contextmanager
def local_directory(loc: Location) -> Iterator[str]:
    """A local directory whose files end up at ``loc`` (``loc`` itself on a local disk; on an object store a
    temporary one whose files are uploaded when the block ends without an error)."""
    with loc.store.local_directory(loc.path) as directory:
        yield directory


def read_marker(loc: Location) -> dict[str, Any] | None:
    """The commit marker's fields, or None when ``loc`` is a ``full`` checkpoint file. Raises when absent."""
    try:
        if not loc.store.exists(loc.path):
            raise CheckpointNotFoundError(_missing_message(loc))
        if loc.store.isdir(loc.path):
            raise CheckpointNotFoundError(
                f"{loc.url!r} is a directory without a lightning_zero commit marker: it is not a checkpoint"
                " or its save never completed. Pass the path of a checkpoint this package wrote."
            )
        with loc.store.open_read(loc.path) as f:
            head = f.read(4)
            if head[:1] == b"{":
                body, kind = head + f.read(), "json"
            elif head == b"PK\x03\x04":
                f.seek(0)
                if _zip_holds_tensors(f):
                    return None  # a torch.save file with tensors: full mode
                f.seek(0)
                body, kind = f.read(), "zip"
            else:
                raise CheckpointCorruptError(
                    f"{loc.url!r} is neither a lightning_zero commit marker nor a torch.save file: it is damaged or"
                    " not a checkpoint."
                )
    except (CheckpointNotFoundError, CheckpointCorruptError):
        raise
    except Exception as exc:
        raise storage_error(loc, "read", exc) from exc
    return _parse_marker(loc, body, kind)


def _zip_holds_tensors(f: Any) -> bool:
    """Whether a torch.save zip has tensor records; reads only its central directory (a ranged read on S3)."""
    try:
        names = zipfile.ZipFile(f).namelist()
    except zipfile.BadZipFile:
        return True  # let the full-file reader report the damage with its own message
    return any("/data/" in name for name in names)


def refused_global(exc: BaseException) -> str:
    """The name of the global a ``weights_only`` load refused (from torch's message)."""
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    return found.group(1) if found else "an object that is not a tensor, container or plain value"


def refused_pickle(url: str, what: str, exc: BaseException) -> str:
    """The message for a file whose pickle names a global that ``weights_only`` loading refuses.

    torch's own message suggests ``weights_only=False``; for a file of unknown origin that is the one
    thing not to do, so it is replaced, keeping only the refused name."""
    name = refused_global(exc)
    # A commit marker never holds an object, whoever wrote it: it is always read weights-only.
    way_out = "" if "marker" in what else (
        " Only if you wrote it yourself and trust it, load it with weights_only=False"
        " (trainer.fit/validate/test/predict(..., weights_only=False), fabric.load(..., weights_only=False),"
        " lightning-zero convert --no-weights-only).")
    return (f"{url!r} is not a valid checkpoint: its {what} holds {name}, which a weights_only load does not"
            f" unpickle (a crafted file could run code), so it was not unpickled.{way_out}")


def _parse_marker(loc: Location, body: bytes, kind: str) -> dict[str, Any]:
    try:
        if kind == "json":  # markers of version 1
            content: Any = {MARKER_KEY: json.loads(body)}
        else:
            content = torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointCorruptError(refused_pickle(loc.url, "commit marker", exc)) from None
    except Exception as exc:
        raise CheckpointCorruptError(
            f"Commit marker {loc.url!r} is damaged ({type(exc).__name__}: {exc}); use another checkpoint."
        ) from exc
    marker = content.get(MARKER_KEY) if isinstance(content, dict) else None
    if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT:
        label = "a JSON file" if kind == "json" else "a torch.save file without tensors"
        raise CheckpointNotFoundError(f"{loc.url!r} is {label}, not a lightning_zero checkpoint.")
    missing = [key for key in ("mode", "data") if key not in marker]
    if missing:
        raise CheckpointCorruptError(
            f"Commit marker {loc.url!r} lacks {missing}: it is damaged. Resume from another checkpoint."
        )
    return marker


def _missing_message(loc: Location) -> str:
    bucket = loc.store.missing_root(loc.path)
    if bucket is not None:
        return (
            f"No checkpoint at {loc.url!r}: the bucket {bucket!r} does not exist (or these credentials cannot"
            " see it). Fix the path or the storage_options."
        )
    return (
        f"No checkpoint at {loc.url!r}. If a save was in progress it did not commit (a checkpoint counts only"
        " once its commit marker is written); resume from an earlier checkpoint."
    )


def version_dir_of(loc: Location, marker: dict[str, Any]) -> str:
    """The data version directory the commit marker of ``loc`` names."""
    data = str(marker["data"])
    if "/" in data:  # relative to the marker's folder
        return loc.join(loc.parent, data)
    return loc.join(loc.data_root(), data)  # markers of version 1
