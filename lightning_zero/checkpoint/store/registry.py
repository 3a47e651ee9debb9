"""Which :class:`~lightning_zero.checkpoint.store.backend.Store` serves a path: one table from a URL scheme (and,
for a scheme several clients serve, ``storage_options["client"]``) to a store class ([Note: storage seam] in
backend.py). A new store is a module of ``store/`` and one line here."""

from __future__ import annotations

import os
from typing import Any, Protocol

from lightning_zero.checkpoint.store.backend import Store
from lightning_zero.checkpoint.store.fsspec_store import FsspecStore, S3fsStore
from lightning_zero.checkpoint.store.local import LocalStore
from lightning_zero.checkpoint.store.s3torch import S3TorchConnectorStore


class Opener(Protocol):
    def open(self, url: str, options: dict[str, Any]) -> tuple[Store, str]:
        """The store for ``url`` with these ``storage_options`` (without ``client``), and the path in it."""
        ...


BACKENDS: dict[tuple[str, str | None], Opener] = {
    ("file", None): LocalStore,
    ("s3", None): S3fsStore,
    ("s3", "s3fs"): S3fsStore,
    ("s3a", None): S3fsStore,
    ("s3", "s3torchconnector"): S3TorchConnectorStore,
}
"""(scheme, ``storage_options["client"]``) -> store class. ``client`` None is the scheme's default; a scheme
missing here goes to fsspec (:class:`FsspecStore`)."""

CLIENT_OPTION = "client"


def resolve_store(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> tuple[Store, str, str]:
    """``(store, path in it, url)`` for a checkpoint path as a user gives it."""
    url = os.fspath(url)
    options = dict(storage_options or {})
    client = options.pop(CLIENT_OPTION, None)
    scheme = url.split("://", 1)[0].lower() if "://" in url else "file"
    clients = sorted(str(name) for known, name in BACKENDS if known == scheme and name is not None)
    if not clients:  # a client names how to reach one kind of store: a plugin's options serve its local paths too
        client = None
    opener = BACKENDS.get((scheme, client))
    if opener is None:
        if client is not None:
            raise ValueError(f"storage_options[{CLIENT_OPTION!r}]={client!r} is not a client for {scheme}:// paths"
                             f" ({', '.join(repr(c) for c in clients)}).")
        opener = FsspecStore
    store, path = opener.open(url, options)
    return store, path, url
