"""Spare files of a local tier: the files of retired checkpoints, overwritten by the next saves.

[Note: spare tier files] Retention used to delete a local checkpoint's files and the next save then wrote
as many fresh ones. On a host-memory tier (``/dev/shm``) a fresh file's every page is allocated and zeroed
as it is written, and on a VM whose freed memory goes back to its host (free page reporting) first touched
again through the host: writing 67 MB into a new tmpfs file took 29-36 ms on this project's benchmark
machine, over the pages of an existing file 14-17 ms. A tiered save writes two such files per rank (its own
and the replica it receives), on the path to recoverable. So retention moves a retired checkpoint's files
into ``<tier root>/_zero_spare/`` (at most as many as one save writes on the node; the rest are deleted),
and a save's writer and replica receiver each claim one by renaming it to the name they write (atomic:
two ranks of a node never claim the same one), write over it and cut it to length. A tier holds ``keep``
checkpoints and one save's worth of spares between saves, what it held at the peak of a save before.
Spares are never read: no marker names them, and a file's integrity header ties it to its save. The
plugin's ``teardown`` deletes them (a crashed run's are claimed by the next run's saves, or deleted there).
"""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import suppress

SPARE_DIR = "_zero_spare"


def spare_dir(root: str) -> str:
    return os.path.join(root, SPARE_DIR)


def retire(tree: str, root: str, limit: int) -> None:
    """Delete ``tree`` (a retired checkpoint's data directory), keeping its files as spares of the tier at
    ``root`` while the pool holds fewer than ``limit``."""
    pool = spare_dir(root)
    with suppress(OSError):
        os.makedirs(pool, exist_ok=True)
        held = len(os.listdir(pool))
        for parent, _, names in os.walk(tree):
            for name in names:
                if held >= limit or ".tmp-" in name:
                    continue
                with suppress(OSError):
                    os.replace(os.path.join(parent, name), os.path.join(pool, uuid.uuid4().hex[:12]))
                    held += 1
    shutil.rmtree(tree, ignore_errors=True)


def claim(root: str, path: str) -> bool:
    """Move a spare file of the tier at ``root`` to ``path`` (which it replaces); False if none is left."""
    pool = spare_dir(root)
    try:
        names = os.listdir(pool)
    except OSError:
        return False
    for name in names:
        try:
            os.replace(os.path.join(pool, name), path)
            return True
        except FileNotFoundError:  # another rank of this node claimed it first
            continue
        except OSError:
            return False
    return False


def clear(root: str) -> None:
    """Delete the tier's spares (the end of a fit)."""
    shutil.rmtree(spare_dir(root), ignore_errors=True)
