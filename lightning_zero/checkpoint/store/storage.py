"""Where checkpoints live: one fsspec-backed storage layer for local paths, shared filesystems and S3.

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

import errno
import io
import json
import os
import pickle
import re
import uuid
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

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
    """A checkpoint path resolved to an fsspec filesystem."""

    fs: fsspec.AbstractFileSystem
    path: str  # without protocol, as the filesystem expects it
    url: str  # as the user gave it, for messages

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    @property
    def parent(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[0] if "/" in self.path.rstrip("/") else ""

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

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


S3_TIMEOUTS: dict[str, Any] = {
    "connect_timeout": 10,
    "read_timeout": 30,
    "retries": {"max_attempts": 3, "mode": "standard"},
}
"""botocore settings every ``s3://`` location gets unless ``storage_options["config_kwargs"]`` sets them.

[Note: bounded S3 failures] botocore's default (legacy retries, 60 s read timeout) multiplied by
s3fs's own retries of timed-out calls let a save to an S3 endpoint that stopped answering hang for
many minutes. "standard" retries back off with jitter on 5xx and throttling (``SlowDown``) and
give up after ``max_attempts``; s3fs makes at most ``S3_CALL_ATTEMPTS`` attempts of a call that
timed out (its default: 5). A dead endpoint then fails a call within about S3_CALL_ATTEMPTS *
max_attempts * read_timeout (3 minutes) in the worst case (frozen), within seconds when the connection
is refused; a failed ``sharded`` save makes about two such calls (DCP deletes its partial file)."""

S3_CALL_ATTEMPTS = 2


def _with_s3_defaults(url: str, options: dict[str, Any]) -> dict[str, Any]:
    if not url.startswith(("s3://", "s3a://")):
        return options
    config = {**S3_TIMEOUTS, **(options.get("config_kwargs") or {})}
    return {**options, "config_kwargs": config}


def resolve(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Location:
    url = os.fspath(url)
    try:
        fs, path = fsspec.core.url_to_fs(url, **_with_s3_defaults(url, dict(storage_options or {})))
    except ImportError as exc:
        raise ValueError(f"No filesystem for {url!r}: {exc}. Install the fsspec backend for this protocol.") from exc
    if isinstance(fs, LocalFileSystem):
        path = os.path.abspath(path)
    elif type(fs).__name__ == "S3FileSystem" and "retries" not in (storage_options or {}):
        fs.retries = S3_CALL_ATTEMPTS  # s3fs reads it per call; see [Note: bounded S3 failures]
    return Location(fs, path, url)


def keeps_partial_writes(loc: Location, errors: list[str]) -> bool:
    """Whether a failed save leaves its partial version in place: when an object store stopped answering
    (every further call would wait out its timeouts and retries too). Nothing points at the version,
    and the next successful save of the name deletes it with the other stale versions."""
    unreachable = ("ConnectTimeout", "ReadTimeout", "EndpointConnectionError", "timed out", "ClientConnectorError",
                   "ServerDisconnected", "Connection reset", "ConnectionClosed", "Cannot connect")
    return not loc.is_local and any(sign in error for error in errors for sign in unreachable)


def storage_error(loc: Location, action: str, exc: BaseException) -> OSError:
    """A clear error for an unreachable bucket, refused access or a full disk; no credentials in it."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, PermissionError) and loc.is_local:
        hint = "permission denied: give this user write access to the directory or point the checkpoint elsewhere"
    elif isinstance(exc, PermissionError) or "AccessDenied" in text or "Forbidden" in text:
        hint = "access was refused: check the credentials/profile in storage_options and the bucket policy"
    elif "NoSuchBucket" in text or "bucket does not exist" in text.lower() or (
        isinstance(exc, FileNotFoundError) and not loc.is_local
    ):
        hint = "the bucket or prefix does not exist: create it or fix the path"
    elif isinstance(exc, OSError) and getattr(exc, "errno", None) == errno.ENOSPC:
        hint = "the disk is full: free space or point the checkpoint elsewhere; the previous checkpoint is intact"
    elif isinstance(exc, OSError) and getattr(exc, "errno", None) == errno.EROFS:
        hint = "the file system is read-only: mount it read-write or point the checkpoint elsewhere"
    else:
        hint = "see the cause below"
    return OSError(f"Could not {action} checkpoint at {loc.url!r}: {hint}. ({text})")


def abort_upload(f: Any) -> None:
    """Give up an object-store file being written: abort its multipart upload, so that its
    ``close()`` neither finishes the upload of a partial file nor retries against a store that
    stopped answering. (A local file has no ``discard``: nothing to do.)"""
    discard = getattr(f, "discard", None)
    if discard is None:
        return
    with suppress(Exception):
        discard()
    with suppress(AttributeError):  # a file whose ``closed`` is read-only
        f.closed = True



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
        loc.fs.makedirs(loc.parent, exist_ok=True)
    if loc.is_local:
        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())

        replace_whole(loc.path, write)
    else:
        # One PUT: an object store shows the old object or the new one, never a mix.
        loc.fs.pipe_file(loc.path, payload)


@contextmanager
def local_directory(loc: Location) -> Iterator[str]:
    """A local directory whose files end up at ``loc``: ``loc`` itself on a local disk, on an object store
    a temporary one whose files are uploaded when the block ends without an error."""
    if loc.is_local:
        yield loc.path
        return
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        yield tmp
        for name in os.listdir(tmp):
            loc.fs.put_file(os.path.join(tmp, name), loc.join(loc.path, name))


def replace_whole(path: str, write: Callable[[str], None]) -> None:
    """(local disks) Create ``path`` whole or not at all: ``write(tmp)`` makes a temporary name beside it
    (``<path>.tmp-<id>``, which readers skip), which then replaces ``path`` in one rename; a failed
    write leaves no temporary behind (least of all on a full disk). Object stores need none of this:
    an upload is complete or absent."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.remove(tmp)
        raise


def read_marker(loc: Location) -> dict[str, Any] | None:
    """The commit marker's fields, or None when ``loc`` is a ``full`` checkpoint file. Raises when absent."""
    try:
        if not loc.fs.exists(loc.path):
            raise CheckpointNotFoundError(_missing_message(loc))
        if loc.fs.isdir(loc.path):
            raise CheckpointNotFoundError(
                f"{loc.url!r} is a directory without a lightning_zero commit marker: it is not a checkpoint"
                " or its save never completed. Pass the path of a checkpoint this package wrote."
            )
        with loc.fs.open(loc.path, "rb") as f:
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
    if not loc.is_local:
        bucket = loc.path.split("/", 1)[0]
        try:
            bucket_exists = loc.fs.exists(bucket)
        except Exception:  # cannot tell: the general message below still holds
            bucket_exists = True
        if not bucket_exists:
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
