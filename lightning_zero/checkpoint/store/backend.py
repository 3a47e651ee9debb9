"""The storage seam: :class:`Store`, the one object per kind of store that the rest of the package asks for
everything that differs between stores, and :class:`Failure`, how a store classifies its errors.

[Note: storage seam] Every checkpoint byte is written and read through a :class:`Store`; nothing outside
``store/`` asks which kind of store it has. A path becomes a :class:`~lightning_zero.checkpoint.store.
storage.Location` (the store, the path as the store spells it, the URL for messages) through
:func:`~lightning_zero.checkpoint.store.registry.resolve`, which picks the store by the URL's scheme and,
for ``s3://``, by ``storage_options["client"]``. Adding a store is one subclass and one
``@register(...)`` in ``store/``, as DCP's ``FileSystemBase`` subclasses add file systems to its writer.

The calls a save makes, in order, and which ranks make them:

1. (every rank) :meth:`Store.preflight`: this rank's reason it cannot write, before any data is written.
2. (every rank) :meth:`Store.write_file` for its own files, or :meth:`Store.dcp_writer` for a ``sharded``
   save; a failed stream is given up with :meth:`Store.abort` so its close does not publish it.
3. (coordinator) :meth:`Store.publish`: the commit marker, whole or not at all, written last.
4. (coordinator) :meth:`Store.rm` of the older versions; :meth:`Store.link` for a second name.

A load: (coordinator) :meth:`Store.open_read` of the marker, then every rank's :meth:`Store.open_read`,
:meth:`Store.mappable` (a local file memory-mapped instead) or :meth:`Store.dcp_reader`. Errors raised
anywhere are explained by :meth:`Store.classify` and :meth:`Store.hint`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any, ClassVar

from lightning_zero.checkpoint.store.tuning import DEFAULT_TUNING, CheckpointTuning


class Failure(enum.Enum):
    """What kind of failure a store's error is (:meth:`Store.classify`)."""

    TRANSIENT = "transient"
    """The store stopped answering (a timeout, a refused or reset connection): every further call would wait
    out its timeouts and retries too."""
    PERMISSION = "permission"
    MISSING = "missing"
    """The bucket, prefix, directory or file does not exist."""
    NO_SPACE = "no space"
    READ_ONLY = "read-only"
    OTHER = "other"


_HINTS = {
    Failure.PERMISSION: "access was refused: check the credentials/profile in storage_options and the bucket policy",
    Failure.MISSING: "the bucket or prefix does not exist: create it or fix the path",
    Failure.NO_SPACE: "the disk is full: free space or point the checkpoint elsewhere; the previous checkpoint is"
                      " intact",
    Failure.READ_ONLY: "the file system is read-only: mount it read-write or point the checkpoint elsewhere",
    Failure.TRANSIENT: "the store did not answer: check the endpoint and the network, then save again",
    Failure.OTHER: "see the cause below",
}


class Store:
    """One kind of store: paths are the store's own (no protocol), as :class:`Location` holds them.

    Subclasses implement the abstract methods; the others have defaults that suit object stores (no
    directories, no links, a single PUT is atomic).
    """

    name: ClassVar[str] = "store"
    """What users call it (``"local"``, ``"s3fs"``, ``"s3torchconnector"``): in messages and the bench."""
    machine_files: ClassVar[bool] = False
    """Whether its paths are files of this machine's file system (a local disk, ``/dev/shm``, an NFS mount), which
    the local tier's direct file reads, writes and replication need."""

    # -- paths ------------------------------------------------------------------------------------

    def url(self, path: str) -> str:
        """``path`` with the store's protocol, as a user (or DCP) names it."""
        raise NotImplementedError

    @property
    def fs(self) -> Any:
        """An fsspec file system over the same store, for code outside this package that lists with fsspec
        (Lightning's ``ModelCheckpoint``); the package itself never uses it."""
        raise NotImplementedError

    # -- listing and removing -------------------------------------------------------------------

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def isdir(self, path: str) -> bool:
        raise NotImplementedError

    def ls(self, path: str, detail: bool = False) -> list[Any]:
        """The entries of directory (prefix) ``path``, as fsspec's ``ls`` gives them: their names (without the
        protocol), or with ``detail`` dicts with ``name``, ``type`` (``"file"``/``"directory"``), ``mtime`` or
        ``LastModified`` and, on local disks, ``islink``. Raises ``FileNotFoundError`` when it holds nothing."""
        raise NotImplementedError

    def rm(self, path: str, recursive: bool = False) -> None:
        raise NotImplementedError

    def makedirs(self, path: str) -> None:
        """(directories only) Object stores have none: nothing to do."""

    # -- files ------------------------------------------------------------------------------------

    def open_read(self, path: str) -> IO[bytes]:
        """A seekable binary stream of ``path``; ``FileNotFoundError`` when it does not exist."""
        raise NotImplementedError

    def open_write(self, path: str) -> IO[bytes]:
        """A binary stream whose close completes ``path`` (an upload is complete or absent)."""
        raise NotImplementedError

    def abort(self, stream: Any) -> None:
        """Give up ``stream`` (from :meth:`open_write`) so its close does not complete a partial file."""

    def mappable(self, path: str) -> str | None:
        """A local file name ``torch.load(mmap=True)`` can map, or None (the store streams)."""
        return None

    def write_file(self, path: str, write: Callable[[IO[bytes]], None], tuning: CheckpointTuning = DEFAULT_TUNING,
                   *, progress: Callable[[int], None] | None = None,
                   recycle: Callable[[str], bool] | None = None) -> None:
        """``write(stream)`` into ``path``, streamed (no second copy of the bytes in memory); durable once it
        returns. ``progress`` and ``recycle`` are hints a local disk uses
        (:func:`~lightning_zero.checkpoint.store.file_io.write_file`); object stores ignore them."""
        stream = self.open_write(path)
        try:
            write(stream)
        except BaseException:
            self.abort(stream)
            raise
        stream.close()

    def write_whole(self, path: str, write_at: Callable[[str], None]) -> None:
        """``path`` appears whole or not at all: ``write_at(name)`` writes the file at a name the store picks
        (a temporary one renamed on a local disk; ``path`` itself on an object store, where an upload is complete
        or absent)."""
        write_at(path)

    def publish(self, path: str, payload: bytes) -> None:
        """(coordinator) ``path`` holds ``payload``, replaced atomically: readers see the old or the new bytes,
        never a mix (the commit marker). Object stores: one PUT."""
        with self.open_write(path) as stream:
            stream.write(payload)

    def link(self, target: str, link: str) -> None:
        """``link`` becomes another name of file ``target``, atomically (object stores copy it)."""
        raise NotImplementedError

    def remove_leftover_temporaries(self, path: str) -> None:
        """Delete temporaries of earlier whole writes of ``path`` that died before their rename (local disks)."""

    @contextmanager
    def local_directory(self, path: str) -> Iterator[str]:
        """A local directory whose files end up in ``path`` once the block ends without an error (for writers
        that only write local files: ``save_pretrained``, DCP in one process)."""
        import os
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            yield tmp
            for name in os.listdir(tmp):
                with open(os.path.join(tmp, name), "rb") as source:
                    self.write_file(f"{path.rstrip('/')}/{name}", lambda stream, source=source: _copy(source, stream))

    # -- before a save ------------------------------------------------------------------------------

    def preflight(self, path: str, directory: str) -> BaseException | None:
        """Why nothing can be written under ``directory`` (the save's own directory; ``path`` the checkpoint),
        found before any data is written; None when nothing says so. Object stores check the bucket: their
        other refusals come from the first upload, which every rank then reports."""
        return None

    def missing_root(self, path: str) -> str | None:
        """The bucket of ``path`` when the store can tell it does not exist (object stores), else None."""
        return None

    # -- errors -----------------------------------------------------------------------------------

    def classify(self, exc: BaseException) -> Failure:
        """What kind of failure ``exc`` (raised by this store's calls) is."""
        import errno

        if isinstance(exc, PermissionError):
            return Failure.PERMISSION
        if isinstance(exc, FileNotFoundError):
            return Failure.MISSING
        if isinstance(exc, TimeoutError | ConnectionError):
            return Failure.TRANSIENT
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return Failure.NO_SPACE
        if isinstance(exc, OSError) and exc.errno == errno.EROFS:
            return Failure.READ_ONLY
        return Failure.OTHER

    def classify_text(self, text: str) -> Failure:
        """The kind of failure an error reported by another rank (as text) is; TRANSIENT or OTHER."""
        return Failure.OTHER

    def hint(self, failure: Failure) -> str:
        """What a user does about ``failure``."""
        return _HINTS[failure]

    # -- DCP --------------------------------------------------------------------------------------

    def dcp_writer(self, wrap: Callable[[type], type], directory: str, tuning: CheckpointTuning) -> Any:
        """A DCP ``StorageWriter`` of ``directory``: ``wrap(base)`` of this store's writer class (the package's
        checksums), ``tuning.write_threads`` files per rank."""
        raise NotImplementedError

    def dcp_reader(self, wrap: Callable[[type], type], directory: str) -> Any:
        """A DCP ``StorageReader`` of ``directory``: ``wrap(base)`` of this store's reader class."""
        raise NotImplementedError


def _copy(source: IO[bytes], stream: IO[bytes]) -> None:
    import shutil

    shutil.copyfileobj(source, stream, 1 << 22)
