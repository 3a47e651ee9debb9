"""Copying local-tier files between nodes over the coordination group (gloo, CPU tensors).

[Note: replication ring] Nodes are ordered by node rank; with ``replicas = k`` the rank with local rank
``l`` on the i-th node sends its file to the rank with local rank ``l`` on nodes i+1, ..., i+k (mod the
number of nodes) and receives from nodes i-1, ..., i-k. Every rank sends and receives in the same order
(round 1, 2, ...), each round a non-blocking send and receive, so no pair waits on another. Losing one
node's storage loses one copy of each of its ranks' files, never both when ``replicas >= 1``.
A file is streamed in ``CHUNK_BYTES`` pieces, read from the sender's tier and written into a temporary
file on the receiver's (renamed into place when whole), so replication holds a few pieces in memory, not the
files. Round (or plan entry) i uses tag ``i << 16``, its pieces the tags after it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, BinaryIO

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
"""A replicated file moves in pieces of this size, two in flight each way: a rank holds four such buffers,
not a copy of its file and of the one it receives ([Note: replication ring])."""


def exchange_files(own_file: str, sends: Sequence[int | None], receives: Sequence[int | None], group: object,
                   target: Callable[[int], str]) -> list[int]:
    """(every rank of ``group``, in the same rounds) Send ``own_file`` to ``sends[i]`` while the file of
    ``receives[i]`` streams into ``target(source)`` (whole or not at all, fsynced), round by round.
    Returns the sources whose files arrived."""
    received = []
    for round_index, (dst, src) in enumerate(zip(sends, receives)):
        tag = round_index << 16
        size_out = torch.tensor([os.path.getsize(own_file)], dtype=torch.int64)
        size_in = torch.zeros(1, dtype=torch.int64)
        _wait([dist.isend(size_out, dst, group=group, tag=tag) if dst is not None else None,
               dist.irecv(size_in, src, group=group, tag=tag) if src is not None else None])
        with open(own_file, "rb", buffering=0) as reader:
            out_size = int(size_out) if dst is not None else 0
            if src is None:
                _transfer(reader, out_size, dst, None, 0, None, group, tag)
                continue
            _receive_into(target(src), partial(_transfer, reader, out_size, dst, size_in=int(size_in), src=src,
                                                group=group, tag=tag))
        received.append(src)
    return received


def send_plan(plan: Sequence[tuple[int, int, str]], rank: int, group: object, path_of: Callable[[str], str]) -> None:
    """(every rank of ``group``) Run ``plan``, a list of (sender, receiver, key) the same on every rank, in
    order: the sender streams the file ``path_of(key)`` to the receiver, which writes it (whole) at its own
    ``path_of(key)``; the other ranks skip the entry."""
    for index, (sender, receiver, key) in enumerate(plan):
        tag = index << 16
        if rank == sender:
            path = path_of(key)
            size = os.path.getsize(path)
            dist.send(torch.tensor([size], dtype=torch.int64), receiver, group=group, tag=tag)
            with open(path, "rb", buffering=0) as reader:
                _transfer(reader, size, receiver, None, 0, None, group, tag)
        elif rank == receiver:
            size_in = torch.zeros(1, dtype=torch.int64)
            dist.recv(size_in, sender, group=group, tag=tag)

            _receive_into(path_of(key), partial(_transfer, None, 0, None, size_in=int(size_in), src=sender,
                                                 group=group, tag=tag))


def _transfer(reader: BinaryIO | None, size_out: int, dst: int | None, writer: BinaryIO | None, size_in: int,
              src: int | None, group: object, tag: int) -> None:
    """Send ``size_out`` bytes of ``reader`` to ``dst`` while ``size_in`` bytes from ``src`` go to ``writer``,
    in ``CHUNK_BYTES`` pieces: the next piece is read (sent) while one is in flight, and received while the
    previous one is written. Piece k of a transfer travels under ``tag + 1 + k`` both ways."""
    n_out = -(-size_out // CHUNK_BYTES) if dst is not None else 0
    n_in = -(-size_in // CHUNK_BYTES) if src is not None else 0
    out_buffers = [torch.empty(min(CHUNK_BYTES, size_out), dtype=torch.uint8) for _ in range(min(2, n_out))]
    in_buffers = [torch.empty(min(CHUNK_BYTES, size_in), dtype=torch.uint8) for _ in range(min(2, n_in))]
    sending: list[Any] = [None, None]
    receiving: dict[int, tuple[Any, Tensor]] = {}

    def post_receive(k: int) -> None:
        if k < n_in:
            piece = in_buffers[k % 2][: min(CHUNK_BYTES, size_in - k * CHUNK_BYTES)]
            receiving[k] = (dist.irecv(piece, src, group=group, tag=tag + 1 + k), piece)

    post_receive(0)
    post_receive(1)
    try:
        for k in range(max(n_out, n_in)):
            if k < n_out:
                assert reader is not None
                slot = k % 2
                if sending[slot] is not None:
                    sending[slot].wait()
                piece = out_buffers[slot][: min(CHUNK_BYTES, size_out - k * CHUNK_BYTES)]
                _read_exactly(reader, piece)
                sending[slot] = dist.isend(piece, dst, group=group, tag=tag + 1 + k)
            if k < n_in:
                assert writer is not None
                request, piece = receiving.pop(k)
                request.wait()
                writer.write(memoryview(piece.numpy()))
                post_receive(k + 2)
    finally:
        _wait(sending)


def _read_exactly(reader: BinaryIO, piece: Tensor) -> None:
    view, done = memoryview(piece.numpy()), 0
    while done < len(view):
        read = reader.readinto(view[done:])
        if not read:
            raise OSError(f"{reader.name} ended early: it changed while being sent.")
        done += read


def _receive_into(path: str, fill: Callable[[BinaryIO], None]) -> None:
    """``fill(file)`` writes a received file, which appears whole or not at all, fsynced (a marker that lists
    it is written after)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as writer:
            fill(writer)
            writer.flush()
            os.fsync(writer.fileno())

    storage.replace_whole(path, write)


def _wait(requests: list[object]) -> None:
    for request in requests:
        if request is not None:
            request.wait()  # type: ignore[attr-defined]
