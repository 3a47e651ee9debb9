"""``s3://`` through AWS's s3torchconnector (the CRT-based client SageMaker documents for checkpoints):
:class:`S3TorchConnectorStore`, chosen with ``storage_options={"client": "s3torchconnector"}``. Every byte of
the checkpoint goes through its ``S3Client``: files (``put_object``/``get_object``), listing, removal, links
(``copy_object``) and DCP's files (its ``S3FileSystem`` over the same client).

The optional extra ``pip install "lightning-zero[s3torchconnector]"`` installs it (and ``tenacity``, which its DCP
module imports); the package imports it only when a store of this kind is resolved.

``storage_options``: ``endpoint_url`` (or ``client_kwargs["endpoint_url"]``, else ``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL``), ``region`` (or ``client_kwargs["region_name"]``, else ``AWS_REGION`` or
``AWS_DEFAULT_REGION``, else us-east-1), ``profile``, ``anon`` (unsigned requests), ``force_path_style`` (True by
default with an endpoint: local S3 servers are addressed by path), ``part_size``, ``throughput_target_gbps`` and
``max_attempts`` (3 by default, as [Note: bounded S3 failures] in fsspec_store.py bounds s3fs). Credentials come
from the environment or the profile, as the CRT client takes them: s3fs's ``key``/``secret``/``token`` are refused.
"""

from __future__ import annotations

import os
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

from lightning_zero.checkpoint.store.backend import Failure, Store
from lightning_zero.checkpoint.store.tuning import DEFAULT_TUNING, CheckpointTuning

EXTRA = 'pip install "lightning-zero[s3torchconnector]"'
MAX_ATTEMPTS = 3
FROZEN_ATTEMPT_S = 47
"""About how long one attempt of the CRT client waits on an endpoint that accepted the connection and stopped
answering (measured against a proxy that freezes mid-upload): s3torchconnector 1.5.0 has no timeout option, so a
call to a frozen endpoint fails after about ``max_attempts * FROZEN_ATTEMPT_S`` seconds (2.5 minutes with the
default 3 attempts, as s3fs's bound in [Note: bounded S3 failures]); a refused connection fails at once."""

_OPTIONS = {"endpoint_url", "region", "profile", "anon", "force_path_style", "part_size", "throughput_target_gbps",
            "max_attempts", "client_kwargs"}
_NOT_FOUND = ("object was not found", "key does not exist", "bucket does not exist", "NoSuchKey", "NoSuchBucket")
_REFUSED = ("Forbidden", "AccessDenied", "Access Denied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403")
_UNREACHABLE = ("CRT error", "socket", "timed out", "Timeout", "connection", "Connection", "dispatch failure")

_stores: dict[tuple[Any, ...], S3TorchConnectorStore] = {}
_stores_lock = threading.Lock()


def _new_lock_in_child() -> None:
    global _stores_lock
    _stores_lock = threading.Lock()  # a fork while another thread held it would leave it held forever


os.register_at_fork(after_in_child=_new_lock_in_child)  # the clients themselves reconnect per process


def _import() -> Any:
    try:
        import s3torchconnector
        import tenacity  # noqa: F401 - s3torchconnector.dcp imports it
    except ImportError as exc:
        raise ImportError(f"storage_options={{'client': 's3torchconnector'}} needs the s3torchconnector extra: {EXTRA}"
                          f" ({exc}).") from exc
    return s3torchconnector


class _Translated:
    """A client stream whose ``S3Exception`` s are raised as the store's ``OSError`` s."""

    def __init__(self, inner: Any, store: S3TorchConnectorStore, url: str) -> None:
        self.inner = inner
        self._store = store
        self._path = url.removeprefix("s3://")

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self.inner, name)(*args)
        except self._store._exception as exc:
            raise self._store._os_error(exc, self._path) from exc

    def write(self, data: Any) -> int:
        return self._call("write", data)

    def read(self, *args: Any) -> bytes:
        return self._call("read", *args)

    def readinto(self, buffer: Any) -> int:
        return self._call("readinto", buffer)

    def seek(self, *args: Any) -> int:
        return self._call("seek", *args)

    def close(self) -> None:
        self._call("close")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _split(path: str) -> tuple[str, str]:
    bucket, _, key = path.partition("/")
    return bucket, key


class S3TorchConnectorStore(Store):
    """``s3://`` through one s3torchconnector ``S3Client`` (module docstring). A whole object is one upload (complete
    at ``close()``, dropped unfinished by :meth:`abort`), so the marker needs no rename; a link is a server-side copy."""

    name = "s3torchconnector"

    def __init__(self, region: str, endpoint: str | None, config: dict[str, Any]) -> None:
        module = _import()
        from s3torchconnector._s3client import S3Client

        self.region = region
        self.endpoint = endpoint
        self.client = S3Client(region, endpoint=endpoint, s3client_config=module.S3ClientConfig(**config))
        self._exception = module.S3Exception
        self._fs: Any = None

    @classmethod
    def open(cls, url: str, options: dict[str, Any]) -> tuple[Store, str]:
        unknown = sorted(set(options) - _OPTIONS)
        if unknown:
            raise ValueError(
                f"storage_options {unknown} are not options of the s3torchconnector client (it takes {sorted(_OPTIONS)});"
                " it reads credentials from the environment or storage_options['profile'].")
        client_kwargs = dict(options.get("client_kwargs") or {})
        endpoint = (options.get("endpoint_url") or client_kwargs.get("endpoint_url")
                    or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None)
        region = (options.get("region") or client_kwargs.get("region_name") or os.environ.get("AWS_REGION")
                  or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1")
        config: dict[str, Any] = {"force_path_style": bool(options.get("force_path_style", endpoint is not None)),
                                  "max_attempts": int(options.get("max_attempts", MAX_ATTEMPTS)),
                                  "unsigned": bool(options.get("anon", False))}
        for key in ("profile", "part_size", "throughput_target_gbps"):
            if options.get(key) is not None:
                config[key] = options[key]
        key = (region, endpoint, tuple(sorted(config.items())))
        with _stores_lock:  # one client per configuration and process: the CRT client holds threads and sockets
            store = _stores.get(key)
            if store is None:
                store = _stores[key] = cls(region, endpoint, config)
        return store, url.split("://", 1)[1].rstrip("/")

    def url(self, path: str) -> str:
        return f"s3://{path}"

    @property
    def fs(self) -> Any:
        if self._fs is None:
            import fsspec

            self._fs = fsspec.filesystem("s3", endpoint_url=self.endpoint, client_kwargs={"region_name": self.region})
        return self._fs

    # -- listing and removing ----------------------------------------------------------------------

    def _list(self, path: str, delimiter: str = "/", max_keys: int = 1000) -> tuple[list[Any], list[str]]:
        bucket, key = _split(path)
        prefix = f"{key.rstrip('/')}/" if key else ""
        objects: list[Any] = []
        prefixes: list[str] = []
        try:
            for page in self.client.list_objects(bucket, prefix, delimiter, max_keys):
                objects += page.object_info
                prefixes += page.common_prefixes
                if max_keys == 1 and (objects or prefixes):
                    break
        except self._exception as exc:
            raise self._os_error(exc, path) from exc
        return objects, prefixes

    def _head(self, path: str) -> Any | None:
        bucket, key = _split(path)
        if not key:
            return None
        try:
            return self.client.head_object(bucket, key)
        except self._exception as exc:
            if self.classify(exc) is Failure.MISSING:
                return None
            raise self._os_error(exc, path) from exc

    def exists(self, path: str) -> bool:
        return self._head(path) is not None or self.isdir(path)

    def isdir(self, path: str) -> bool:
        try:
            objects, prefixes = self._list(path, max_keys=1)
        except FileNotFoundError:
            return False
        return bool(objects or prefixes) or not _split(path)[1]

    def ls(self, path: str, detail: bool = False) -> list[Any]:
        bucket = _split(path)[0]
        objects, prefixes = self._list(path)
        entries = [{"name": f"{bucket}/{info.key}", "type": "file", "size": info.size, "mtime": info.last_modified}
                   for info in objects]
        entries += [{"name": f"{bucket}/{prefix.rstrip('/')}", "type": "directory", "size": 0} for prefix in prefixes]
        if not entries:
            raise FileNotFoundError(self.url(path))
        return entries if detail else [entry["name"] for entry in entries]

    def rm(self, path: str, recursive: bool = False) -> None:
        bucket, key = _split(path)
        keys = [info.key for info in self._list(path, delimiter="")[0]] if recursive else []
        if self._head(path) is not None:
            keys.append(key)
        elif not keys:
            raise FileNotFoundError(self.url(path))
        for name in keys:
            try:
                self.client.delete_object(bucket, name)
            except self._exception as exc:
                raise self._os_error(exc, f"{bucket}/{name}") from exc

    # -- files ------------------------------------------------------------------------------------

    def open_read(self, path: str) -> IO[bytes]:
        from s3torchconnector import S3ReaderConstructor

        info = self._head(path)
        if info is None:
            raise FileNotFoundError(self.url(path))
        bucket, key = _split(path)
        return self.client.get_object(bucket, key, object_info=info,  # type: ignore[return-value]
                                      reader_constructor=S3ReaderConstructor.sequential())

    def open_write(self, path: str) -> IO[bytes]:
        bucket, key = _split(path)
        try:
            return self.client.put_object(bucket, key)  # type: ignore[return-value]
        except self._exception as exc:
            raise self._os_error(exc, path) from exc

    def abort(self, stream: Any) -> None:
        # An S3Writer completes its multipart upload at close(); one never closed is dropped unfinished.
        stream = stream.inner if isinstance(stream, _Translated) else stream
        if hasattr(stream, "_closed"):
            stream._closed = True

    def write_file(self, path: str, write: Callable[[IO[bytes]], None], tuning: CheckpointTuning = DEFAULT_TUNING,
                   *, progress: Callable[[int], None] | None = None,
                   recycle: Callable[[str], bool] | None = None) -> None:
        stream = self.open_write(path)
        try:
            write(stream)
            stream.close()
        except self._exception as exc:
            self.abort(stream)
            raise self._os_error(exc, path) from exc
        except BaseException:
            self.abort(stream)
            raise

    def publish(self, path: str, payload: bytes) -> None:
        self.write_file(path, lambda stream: stream.write(payload))  # one object: the old one or the new one

    def link(self, target: str, link: str) -> None:
        source_bucket, source_key = _split(target)
        bucket, key = _split(link)
        try:  # CopyObject's source is a URL path: its segments quoted, as s3torchconnector's own rename does
            self.client.copy_object(source_bucket, urllib.parse.quote(source_key, safe="/"), bucket, key)
        except self._exception as exc:
            raise self._os_error(exc, link) from exc

    def missing_root(self, path: str) -> str | None:
        bucket = _split(path)[0]
        try:
            self._list(bucket, max_keys=1)
        except FileNotFoundError:
            return bucket
        except Exception:  # cannot tell
            return None
        return None

    def preflight(self, path: str, directory: str) -> BaseException | None:
        bucket = self.missing_root(path)
        return FileNotFoundError(f"the bucket {bucket!r} does not exist") if bucket else None

    # -- errors -----------------------------------------------------------------------------------

    def _os_error(self, exc: BaseException, path: str) -> OSError:
        """The client's ``S3Exception`` as the ``OSError`` the rest of the package catches."""
        kind = self.classify(exc)
        error = {Failure.MISSING: FileNotFoundError, Failure.PERMISSION: PermissionError,
                 Failure.TRANSIENT: ConnectionError}.get(kind, OSError)
        return error(f"{exc} ({self.url(path)})")

    def classify(self, exc: BaseException) -> Failure:
        if not isinstance(exc, self._exception):  # the OSErrors of _os_error say it by their type
            return super().classify(exc)
        text = str(exc)
        if any(sign.lower() in text.lower() for sign in _NOT_FOUND):
            return Failure.MISSING
        if any(sign in text for sign in _REFUSED):
            return Failure.PERMISSION
        return self.classify_text(text)

    def classify_text(self, text: str) -> Failure:
        return Failure.TRANSIENT if any(sign in text for sign in _UNREACHABLE) else Failure.OTHER

    # -- DCP --------------------------------------------------------------------------------------

    def _dcp_fs(self, for_reads: bool) -> Any:
        from s3torchconnector import S3ReaderConstructor
        from s3torchconnector.dcp.s3_file_system import S3FileSystem

        store = self

        class StoreFileSystem(S3FileSystem):
            """s3torchconnector's DCP file system whose client errors are the store's ``OSError`` s."""

            @contextmanager
            def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
                try:
                    with super().create_stream(path, mode) as stream:
                        yield _Translated(stream, store, str(path))
                except store._exception as exc:
                    raise store._os_error(exc, str(path).removeprefix("s3://")) from exc

            def exists(self, path: Any) -> bool:
                return store.exists(str(path).removeprefix("s3://"))

            def rename(self, path: Any, new_path: Any) -> None:
                try:
                    super().rename(path, new_path)
                except store._exception as exc:
                    raise store._os_error(exc, str(new_path).removeprefix("s3://")) from exc

        # Ranged reads: a reader thread reads its items' byte ranges, not the file from its start.
        reader = S3ReaderConstructor.range_based() if for_reads else None
        return StoreFileSystem(self.region, s3_client=self.client, reader_constructor=reader)

    def dcp_writer(self, wrap: Callable[[type], type], directory: str, tuning: CheckpointTuning) -> Any:
        from torch.distributed.checkpoint import FileSystemWriter

        store = self

        class S3TorchConnectorWriter(FileSystemWriter):
            """DCP's file writer over the store's client (s3torchconnector's ``S3StorageWriter`` builds a client of
            its own, without the endpoint). No fsync: an object is durable once its upload completes."""

            def __init__(self, path: str, **kwargs: Any) -> None:
                super().__init__(path, sync_files=False, **kwargs)
                self.fs = store._dcp_fs(for_reads=False)  # type: ignore[assignment]
                self.path = self.fs.init_path(path)

            @classmethod
            def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
                return str(checkpoint_id).startswith("s3://")

        return wrap(S3TorchConnectorWriter)(self.url(directory), thread_count=tuning.write_threads)

    def dcp_reader(self, wrap: Callable[[type], type], directory: str) -> Any:
        from torch.distributed.checkpoint import FileSystemReader

        store = self

        class S3TorchConnectorReader(FileSystemReader):
            def __init__(self, path: str) -> None:
                super().__init__(path)
                self.fs = store._dcp_fs(for_reads=True)  # type: ignore[assignment]
                self.path = self.fs.init_path(path)

            @classmethod
            def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
                return str(checkpoint_id).startswith("s3://")

        return wrap(S3TorchConnectorReader)(self.url(directory))
