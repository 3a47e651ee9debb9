"""Copying local-tier files between nodes over the coordination group (gloo, CPU tensors).

[Note: replication ring] Nodes are ordered by node rank; with ``replicas = k`` the rank with local rank
``l`` on the i-th node sends its file to the rank with local rank ``l`` on nodes i+1, ..., i+k (mod the
number of nodes) and receives from nodes i-1, ..., i-k. Every rank sends and receives in the same order
(round 1, 2, ...), each round a non-blocking send and receive, so no pair waits on another. Losing one
node's storage loses one copy of each of its ranks' files, never both when ``replicas >= 1``.
A file moves as ``CHUNK_BYTES`` pieces of two file mappings: the sender's tier file mapped for reading, and on
the receiver a temporary of the same size mapped shared, renamed into place when whole. gloo reads and writes
the page cache directly, so replication holds no copy of the files in memory and makes no read or write call.
Round (or plan entry) i uses tag ``i << 16``, its pieces the tags after it.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

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


CHUNK_BYTES = 16 * 1024 * 1024
PIECES_IN_FLIGHT = 2
"""A replicated file moves in pieces of ``CHUNK_BYTES``, at most ``PIECES_IN_FLIGHT`` each way at once."""


def exchange_files(own_file: str, sends: Sequence[int | None], receives: Sequence[int | None], group: object,
                   target: Callable[[int], str]) -> list[int]:
    """(every rank of ``group``, in the same rounds) Send ``own_file`` to ``sends[i]`` while the file of
    ``receives[i]`` arrives into ``target(source)`` (whole or not at all, fsynced), round by round.
    Returns the sources whose files arrived."""
    received = []
    source = _mapped(own_file)
    for round_index, (dst, src) in enumerate(zip(sends, receives)):
        tag = round_index << 16
        size_out = torch.tensor([source.numel()], dtype=torch.int64)
        size_in = torch.zeros(1, dtype=torch.int64)
        _wait([dist.isend(size_out, dst, group=group, tag=tag) if dst is not None else None,
               dist.irecv(size_in, src, group=group, tag=tag) if src is not None else None])
        outgoing = source if dst is not None else None
        if src is None:
            _transfer(outgoing, dst, [], None, group, tag)
            continue
        _receive_into(target(src), int(size_in), partial(_transfer, outgoing, dst, src=src, group=group, tag=tag))
        received.append(src)
    return received


def send_plan(plan: Sequence[tuple[int, int, str]], rank: int, group: object, path_of: Callable[[str], str]) -> None:
    """(every rank of ``group``) Run ``plan``, a list of (sender, receiver, key) the same on every rank, in
    order: the sender sends the file ``path_of(key)`` to the receiver, which writes it (whole) at its own
    ``path_of(key)``; the other ranks skip the entry."""
    for index, (sender, receiver, key) in enumerate(plan):
        tag = index << 16
        if rank == sender:
            source = _mapped(path_of(key))
            dist.send(torch.tensor([source.numel()], dtype=torch.int64), receiver, group=group, tag=tag)
            _transfer(source, receiver, [], None, group, tag)
        elif rank == receiver:
            size_in = torch.zeros(1, dtype=torch.int64)
            dist.recv(size_in, sender, group=group, tag=tag)
            _receive_into(path_of(key), int(size_in), partial(_transfer, None, None, src=sender, group=group, tag=tag))


def _transfer(source: Tensor | None, dst: int | None, incoming: list[Tensor], src: int | None, group: object,
              tag: int) -> None:
    """Send ``source`` to ``dst`` in ``CHUNK_BYTES`` pieces while ``incoming``'s pieces are received from ``src``,
    at most ``2 * PIECES_IN_FLIGHT`` in flight; piece k travels under ``tag + 1 + k`` both ways. The tensors
    are file mappings ([Note: replication ring]): gloo reads from and writes into the page cache directly."""
    outgoing = _pieces(source) if source is not None and dst is not None else []
    in_flight: deque[Any] = deque()
    try:
        for k in range(max(len(outgoing), len(incoming))):
            if k < len(outgoing):
                in_flight.append(dist.isend(outgoing[k], dst, group=group, tag=tag + 1 + k))
            if k < len(incoming):
                in_flight.append(dist.irecv(incoming[k], src, group=group, tag=tag + 1 + k))
            while len(in_flight) > 2 * PIECES_IN_FLIGHT:
                in_flight.popleft().wait()
    finally:
        _wait(list(in_flight))


def _pieces(tensor: Tensor) -> list[Tensor]:
    return list(tensor.split(CHUNK_BYTES)) if tensor.numel() else []


def _mapped(path: str) -> Tensor:
    """A file's bytes as a uint8 tensor over a private read mapping of it (no copy in memory)."""
    size = os.path.getsize(path)
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(path, shared=False, size=size, dtype=torch.uint8)


def _receive_into(path: str, size: int, receive: Callable[[list[Tensor]], None]) -> None:
    """``receive(pieces)`` fills a file of ``size`` bytes, mapped shared from a temporary beside ``path`` that
    then replaces ``path`` whole, fsynced (a marker that lists it is written after). If the temporary cannot
    be made (a full disk), the pieces are still received, into one scratch piece, so that the sender is not
    left waiting on this rank, and the error is raised."""
    os.makedirs(os.path.dirname(path), exist_ok=True)

    def write(tmp: str) -> None:
        try:
            with open(tmp, "wb") as f:
                if size:  # blocks taken now: a full disk is an OSError here, not a SIGBUS in a mapped write
                    os.posix_fallocate(f.fileno(), 0, size)
            target = torch.from_file(tmp, shared=True, size=size, dtype=torch.uint8) if size else None
        except OSError:
            scratch = torch.empty(min(size, CHUNK_BYTES), dtype=torch.uint8)
            receive([scratch[: min(CHUNK_BYTES, size - start)] for start in range(0, size, CHUNK_BYTES)])
            raise
        receive(_pieces(target) if target is not None else [])
        del target  # unmapped before the fsync
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())

    storage.replace_whole(path, write)


def _wait(requests: list[object]) -> None:
    for request in requests:
        if request is not None:
            request.wait()  # type: ignore[attr-defined]
