"""Object stores through fsspec: :class:`FsspecStore` (any fsspec protocol that is not a local disk) and
:class:`S3fsStore` (``s3://`` through s3fs, the default S3 client), with bounded timeouts and retries
([Note: bounded S3 failures]) and S3's errors classified."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress
from typing import IO, Any

import fsspec

from lightning_zero.checkpoint.store.backend import Failure, Store
from lightning_zero.checkpoint.store.tuning import CheckpointTuning

UNREACHABLE = ("ConnectTimeout", "ReadTimeout", "EndpointConnectionError", "timed out", "ClientConnectorError",
               "ServerDisconnected", "Connection reset", "ConnectionClosed", "Cannot connect")
"""Signs, in an error's text, that the store stopped answering (botocore's, aiohttp's and the system's)."""

_REFUSED = ("AccessDenied", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch")
_NO_BUCKET = ("NoSuchBucket", "bucket does not exist")


class FsspecStore(Store):
    """A store reached through an fsspec file system (``gs://``, ``az://``, ``memory://``, ...): paths start with
    the bucket; a whole object is one PUT, so the marker needs no rename."""

    name = "fsspec"

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self._fs = fs

    @classmethod
    def open(cls, url: str, options: dict[str, Any]) -> tuple[Store, str]:
        try:
            fs, path = fsspec.core.url_to_fs(url, **options)
        except ImportError as exc:
            raise ValueError(f"No filesystem for {url!r}: {exc}. Install the fsspec backend for this protocol.") from exc
        return cls(fs), path

    def url(self, path: str) -> str:
        return self._fs.unstrip_protocol(path)

    @property
    def fs(self) -> Any:
        return self._fs

    def exists(self, path: str) -> bool:
        return self._fs.exists(path)

    def isdir(self, path: str) -> bool:
        return self._fs.isdir(path)

    def ls(self, path: str, detail: bool = False) -> list[Any]:
        return self._fs.ls(path, detail=detail)

    def rm(self, path: str, recursive: bool = False) -> None:
        self._fs.rm(path, recursive=recursive)

    def open_read(self, path: str) -> IO[bytes]:
        return self._fs.open(path, "rb")

    def open_write(self, path: str) -> IO[bytes]:
        return self._fs.open(path, "wb")

    @staticmethod
    def abort(stream: Any) -> None:
        """Abort the stream's multipart upload, so that its ``close()`` neither finishes the upload of a partial
        file nor retries against a store that stopped answering."""
        discard = getattr(stream, "discard", None)
        if discard is None:
            return
        with suppress(Exception):
            discard()
        with suppress(AttributeError):  # a file whose ``closed`` is read-only
            stream.closed = True

    def publish(self, path: str, payload: bytes) -> None:
        self._fs.pipe_file(path, payload)  # one PUT: the old object or the new one, never a mix

    def link(self, target: str, link: str) -> None:
        self._fs.copy(target, link)

    def missing_root(self, path: str) -> str | None:
        bucket = path.split("/", 1)[0]
        try:
            return None if self._fs.exists(bucket) else bucket
        except Exception:  # cannot tell
            return None

    def preflight(self, path: str, directory: str) -> BaseException | None:
        # DCP's fsspec writer makes its directory with makedirs, which on s3fs creates a missing bucket.
        bucket = path.split("/", 1)[0]
        try:
            self._fs.info(bucket)
        except FileNotFoundError as exc:
            return FileNotFoundError(f"the bucket {bucket!r} does not exist ({exc})")
        except Exception:  # e.g. no s3:ListBucket permission: the uploads themselves will tell
            pass
        return None

    def classify(self, exc: BaseException) -> Failure:
        text = f"{type(exc).__name__}: {exc}"
        if any(sign in text for sign in _REFUSED):
            return Failure.PERMISSION
        if any(sign in text.lower() for sign in (s.lower() for s in _NO_BUCKET)):
            return Failure.MISSING
        if self.classify_text(text) is Failure.TRANSIENT:
            return Failure.TRANSIENT
        return super().classify(exc)

    def classify_text(self, text: str) -> Failure:
        return Failure.TRANSIENT if any(sign in text for sign in UNREACHABLE) else Failure.OTHER

    def _options(self) -> dict[str, Any]:
        return dict(getattr(self._fs, "storage_options", {}) or {})

    def dcp_writer(self, wrap: Callable[[type], type], directory: str, tuning: CheckpointTuning) -> Any:
        from lightning_zero import _compat

        # fsync fails on s3fs streams: durability there comes from the completed upload.
        fsspec_writer, _ = _compat.fsspec_storage_classes()
        written = wrap(fsspec_writer)(self.url(directory), sync_files=False, thread_count=tuning.write_threads,
                                      **self._options())
        self._same_retries(written)
        return written

    def dcp_reader(self, wrap: Callable[[type], type], directory: str) -> Any:
        from lightning_zero import _compat

        _, fsspec_reader = _compat.fsspec_storage_classes()
        read = wrap(fsspec_reader)(self.url(directory), **self._options())
        self._same_retries(read)
        return read

    def _same_retries(self, dcp_storage: Any) -> None:
        """DCP's fsspec reader/writer build their own filesystem from the options (a new instance when the
        cache is skipped): it gets the bounded retries of this one (see [Note: bounded S3 failures])."""
        inner = getattr(getattr(dcp_storage, "fs", None), "fs", None)
        if inner is not None and hasattr(self._fs, "retries"):
            inner.retries = self._fs.retries


S3_TIMEOUTS: dict[str, Any] = {
    "connect_timeout": 10,
    "read_timeout": 30,
    "retries": {"max_attempts": 3, "mode": "standard"},
}
"""botocore settings every s3fs location gets unless ``storage_options["config_kwargs"]`` sets them.

[Note: bounded S3 failures] botocore's default (legacy retries, 60 s read timeout) multiplied by
s3fs's own retries of timed-out calls let a save to an S3 endpoint that stopped answering hang for
many minutes. "standard" retries back off with jitter on 5xx and throttling (``SlowDown``) and
give up after ``max_attempts``; s3fs makes at most ``S3_CALL_ATTEMPTS`` attempts of a call that
timed out (its default: 5). A dead endpoint then fails a call within about S3_CALL_ATTEMPTS *
max_attempts * read_timeout (3 minutes) in the worst case (frozen), within seconds when the connection
is refused; a failed ``sharded`` save makes about two such calls (DCP deletes its partial file).
The s3torchconnector store bounds its client's attempts (``MAX_ATTEMPTS``); it has no timeout option, so a frozen
endpoint costs it about ``FROZEN_ATTEMPT_S`` per attempt (``s3torch.py``)."""

S3_CALL_ATTEMPTS = 2


class S3fsStore(FsspecStore):
    """``s3://`` through s3fs (``storage_options`` are s3fs's: ``endpoint_url``, ``key``, ``secret``, ``profile``...)."""

    name = "s3fs"

    @classmethod
    def open(cls, url: str, options: dict[str, Any]) -> tuple[Store, str]:
        config = {**S3_TIMEOUTS, **(options.get("config_kwargs") or {})}
        store, path = super().open(url, {**options, "config_kwargs": config})
        if "retries" not in options:
            store.fs.retries = S3_CALL_ATTEMPTS  # s3fs reads it per call; see [Note: bounded S3 failures]
        return store, path
