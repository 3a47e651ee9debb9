"""Copying local-tier files between nodes over the coordination group (gloo, CPU tensors).

[Note: replication ring] Nodes are ordered by node rank; with ``replicas = k`` the rank with local rank
``l`` on the i-th node sends its file to the rank with local rank ``l`` on nodes i+1, ..., i+k (mod the
number of nodes) and receives from nodes i-1, ..., i-k. Every rank sends and receives in the same order
(round 1, 2, ...), each round a non-blocking send and receive, so no pair waits on another. Losing one
node's storage loses one copy of each of its ranks' files, never both when ``replicas >= 1``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.checkpoint import storage

Place = tuple[str, str, int, int]  # host, tier directory, node rank, local rank


def ring_peers(places: Sequence[Place], rank: int, replicas: int) -> tuple[list[int | None], list[int | None]]:
    """For each round 1..``replicas``: the rank this rank sends to and the rank it receives from (None where
    that node has no rank of this local rank). Pure: every rank computes the same plan."""
    nodes = sorted({p[2] for p in places})
    by_place = {(p[2], p[3]): r for r, p in enumerate(places)}
    index, local_rank = nodes.index(places[rank][2]), places[rank][3]
    sends: list[int | None] = []
    receives: list[int | None] = []
    for step in range(1, replicas + 1):
        sends.append(by_place.get((nodes[(index + step) % len(nodes)], local_rank)))
        receives.append(by_place.get((nodes[(index - step) % len(nodes)], local_rank)))
    return sends, receives


def exchange_files(own_file: str, sends: Sequence[int | None], receives: Sequence[int | None], group: object,
                   store: Callable[[int, memoryview], None]) -> None:
    """(every rank of ``group``, in the same rounds) Send ``own_file`` to ``sends[i]`` and hand what arrives
    from ``receives[i]`` to ``store(source, payload)``, round by round."""
    payload = read_tensor(own_file)
    for round_index, (dst, src) in enumerate(zip(sends, receives)):
        tag = 2 * round_index
        size_out = torch.tensor([payload.numel()], dtype=torch.int64)
        size_in = torch.zeros(1, dtype=torch.int64)
        _wait([dist.isend(size_out, dst, group=group, tag=tag) if dst is not None else None,
               dist.irecv(size_in, src, group=group, tag=tag) if src is not None else None])
        incoming = torch.empty(int(size_in.item()) if src is not None else 0, dtype=torch.uint8)
        _wait([dist.isend(payload, dst, group=group, tag=tag + 1) if dst is not None else None,
               dist.irecv(incoming, src, group=group, tag=tag + 1) if src is not None else None])
        if src is not None:
            store(src, memoryview(incoming.numpy()))  # no copy: written straight from the received buffer


def send_plan(plan: Sequence[tuple[int, int, str]], rank: int, group: object,
              read: Callable[[str], Tensor], store: Callable[[str, memoryview], None]) -> None:
    """(every rank of ``group``) Run ``plan``, a list of (sender, receiver, key) the same on every rank, in
    order: the sender sends ``read(key)``, the receiver ``store(key, payload)``; others skip the entry."""
    for sender, receiver, key in plan:
        if rank == sender:
            payload = read(key)
            dist.send(torch.tensor([payload.numel()], dtype=torch.int64), receiver, group=group)
            dist.send(payload, receiver, group=group)
        elif rank == receiver:
            size = torch.zeros(1, dtype=torch.int64)
            dist.recv(size, sender, group=group)
            incoming = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(incoming, sender, group=group)
            store(key, memoryview(incoming.numpy()))


def write_file(path: str, payload: bytes | memoryview) -> None:
    """A received file, whole or not at all, fsynced (a marker that lists it is written after)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())

    storage.replace_whole(path, write)


def read_tensor(path: str) -> Tensor:
    """A file's bytes as a uint8 tensor (what gloo sends), read straight into it."""
    payload = torch.empty(os.path.getsize(path), dtype=torch.uint8)
    with open(path, "rb", buffering=0) as f:
        view, done = memoryview(payload.numpy()), 0
        while done < len(view):
            read = f.readinto(view[done:])
            if not read:
                raise OSError(f"{path} ended after {done} of {len(view)} bytes: it changed while being read.")
            done += read
    return payload


def _wait(requests: list[object]) -> None:
    for request in requests:
        if request is not None:
            request.wait()  # type: ignore[attr-defined]
