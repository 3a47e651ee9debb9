"""Removing checkpoints and naming them again: a checkpoint removed marker first, then its data; links (a
second name of a committed checkpoint); stale and uncommitted versions and leftover temporaries cleaned;
the newest complete siblings of a name (the fallback of a damaged ``last*``). Built on
:mod:`~lightning_zero.checkpoint.store.storage`'s locations and markers ([Note: checkpoint layout] there)."""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any

from lightning_zero.checkpoint.store.backend import Store
from lightning_zero.checkpoint.store.storage import (
    DATA_DIR,
    Location,
    join_paths,
    read_marker,
    storage_error,
    version_dir_of,
)


def remove(loc: Location, discard: Callable[[str], None] | None = None) -> None:
    """Delete a checkpoint: the marker first (so it stops being one), then its data (``discard(directory)``
    instead of deleting it, where given: a local tier keeps the files as spares)."""
    try:
        store = loc.store
        if store.exists(loc.path):
            store.rm(loc.path, recursive=store.isdir(loc.path))
        root = loc.data_root()
        if store.exists(root):
            (discard or partial(store.rm, recursive=True))(root)
    except Exception as exc:
        raise storage_error(loc, "remove", exc) from exc


def link(target: Location, link: Location) -> None:
    """``link`` becomes another name of checkpoint ``target`` (same folder): a relative symlink on a
    local disk, a copy of the marker (or of the ``full`` file) on object stores, which have no links.
    Replaced atomically, as a marker is (``Store.link``)."""
    if target.path == link.path:
        return
    try:
        link.store.link(target.path, link.path)
    except Exception as exc:
        raise storage_error(link, "link", exc) from exc


def remove_stale_versions(loc: Location, keep: str, discard: Callable[[str], None] | None = None) -> None:
    """Delete data versions other than the committed one (after a commit, or left by a failed save);
    ``discard(directory)`` as in :func:`remove`."""
    root = loc.data_root()
    try:
        for entry in loc.store.ls(root):
            if entry.rstrip("/").rsplit("/", 1)[-1] != keep.rstrip("/").rsplit("/", 1)[-1]:
                (discard or partial(loc.store.rm, recursive=True))(entry)
    except FileNotFoundError:
        pass


def remove_leftover_temporaries(loc: Location) -> None:
    """(local disks) Delete the temporaries of earlier writes of ``loc`` that died before their rename
    (``replace_whole``); call it only where no other write of the name can be in progress."""
    loc.store.remove_leftover_temporaries(loc.path)


def remove_incomplete(directory: Location) -> list[str]:
    """Delete what saves that never committed left in ``directory``: data versions no commit marker
    there names (a ``local``/``sharded`` save killed before its marker) and ``*.tmp-*`` files (a
    ``full`` file or marker killed before its rename). Returns what was deleted.

    Every marker of the directory is read first, so a version that any name commits (a link or
    copied marker included) is kept. Run it when no save into this directory is in flight in another
    process: a save in progress looks exactly like a dead one."""
    store, root = directory.store, directory.path.rstrip("/")
    try:
        entries = store.ls(root, detail=True)
    except FileNotFoundError:
        return []
    referenced: set[str] = set()
    removed: list[str] = []
    for entry in entries:
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if ".tmp-" in name and entry.get("type") == "file":
            store.rm(entry["name"])
            removed.append(entry["name"])
        elif entry.get("type") == "file" or entry.get("islink"):
            try:
                marker = read_marker(directory.at(f"{root}/{name}", f"{directory.url.rstrip('/')}/{name}"))
            except Exception:  # not a checkpoint of this package (or damaged): names no version
                continue
            if marker is not None:
                referenced.add(version_dir_of(directory.at(f"{root}/{name}", ""), marker))
    data_root = join_paths(root, DATA_DIR)
    try:
        names = store.ls(data_root)
    except FileNotFoundError:
        return removed
    for name_dir in names:
        versions = store.ls(name_dir)
        for version in versions:
            if version.rstrip("/") not in referenced:
                store.rm(version, recursive=True)
                removed.append(version)
        if store.exists(name_dir) and not _entries(store, name_dir):
            store.rm(name_dir, recursive=True)
    return removed


def _entries(store: Store, path: str) -> list[str]:
    try:
        return store.ls(path)
    except FileNotFoundError:
        return []


def newest_siblings(loc: Location) -> list[str]:
    """Other checkpoint files in ``loc``'s directory, newest first (fallbacks for a damaged "last")."""
    try:
        entries = loc.store.ls(loc.parent, detail=True)
    except Exception:
        return []
    files = [e for e in entries if e.get("type") == "file" and e["name"].rstrip("/") != loc.path.rstrip("/")
             and ".tmp-" not in e["name"]]

    def newer(entry: dict[str, Any]) -> tuple[float, list[tuple[int, str]]]:
        stamp = entry.get("mtime") or entry.get("LastModified") or entry.get("created") or 0
        seconds = stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp)
        # Object stores keep whole seconds: saves within one second go by the numbers in their names (step=10
        # after step=9).
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        return seconds, [(int(part), "") if part.isdigit() else (-1, part) for part in re.split(r"(\d+)", name)]

    files.sort(key=newer, reverse=True)
    protocol = loc.url.split("://", 1)[0] + "://" if "://" in loc.url else ""
    return [protocol + e["name"] if protocol and not e["name"].startswith(protocol) else e["name"] for e in files]
