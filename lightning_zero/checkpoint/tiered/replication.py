"""Copying local-tier files between nodes over the coordination group (gloo, CPU tensors).

[Note: replication ring] Nodes are ordered by node rank; with ``replicas = k`` the rank with local rank
``l`` on the i-th node sends its file to the rank with local rank ``l`` on nodes i+1, ..., i+k (mod the
number of nodes) and receives from nodes i-1, ..., i-k. Every rank sends and receives in the same order
(round 1, 2, ...), so no pair waits on another. Losing one node's storage loses one copy of each of its
ranks' files, never both when ``replicas >= 1``.

[Note: streamed replication] A file is sent while it is still being written. ``torch.save`` writes its zip
front to back and never goes back to patch a byte (its writer fails on any write out of order), so every
byte below what the writer has handed to the kernel is final. The writer reports that offset to a
:class:`Tail`; a sender thread sends each ``CHUNK_BYTES`` piece as soon as it is final, as a header
(its length, and whether more follows, or that the writer failed) then the bytes, read from a mapping of
the file (no copy in memory). A receiver thread takes each piece into one of two buffers and appends it
to a temporary beside the replica's path, renamed into place, fsynced, once the last piece is in: a
replica is whole or absent, and a marker lists it only after every rank reported its arrival. So
replication overlaps the local write instead of following it: time to replicated is about the longer of
the two, not their sum. The sender and receiver threads use point-to-point messages on the coordination
group while the save's worker thread runs its collectives there: gloo keys a collective's messages by a
slot of its own (the algorithm's prefix in the high bits), never a plain tag as these are.
Round (or plan entry) i uses tags from ``i << 16``; piece k its header under ``+ 2k + 1``, its bytes under
``+ 2k + 2``.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.checkpoint.store import storage

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


CHUNK_BYTES = 4 * 1024 * 1024
PIECES_IN_FLIGHT = 2
"""A replicated file moves in pieces of ``CHUNK_BYTES``, at most ``PIECES_IN_FLIGHT`` in flight each way."""

_MORE, _LAST, _FAILED = 0, 1, 2  # a piece header's second field
_TAG_STRIDE = 1 << 16


class SourceFailed(RuntimeError):
    """The sending rank's own write of the file failed, so no replica of it is made (that rank reports why)."""


class Tail:
    """How much of a file being written is final ([Note: streamed replication]). The writer calls
    :meth:`advance` as its bytes reach the kernel, then :meth:`finish` or :meth:`fail`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._changed = threading.Condition()
        self._written = 0
        self._size: int | None = None
        self._failed = False

    @classmethod
    def whole(cls, path: str) -> Tail:
        """The tail of a file already complete."""
        tail = cls(path)
        tail.finish(os.path.getsize(path))
        return tail

    def advance(self, written: int) -> None:
        with self._changed:
            self._written = written
            self._changed.notify_all()

    def finish(self, size: int) -> None:
        with self._changed:
            self._written, self._size = size, size
            self._changed.notify_all()

    def fail(self) -> None:
        with self._changed:
            self._failed = True
            self._changed.notify_all()

    def next_piece(self, offset: int) -> tuple[int, bool] | None:
        """Wait for the piece after ``offset`` to be final: its end and whether it is the file's last
        (possibly empty); None if the writer failed."""
        with self._changed:
            self._changed.wait_for(lambda: self._failed or self._size is not None
                                   or self._written - offset >= CHUNK_BYTES)
            if self._failed:
                return None
            end = min(offset + CHUNK_BYTES, self._written)
            return end, self._size is not None and end == self._size


def send_file(tail: Tail, dst: int, group: object, tag: int) -> None:
    """Send the file behind ``tail`` to ``dst`` piece by piece, each as soon as it is final."""
    in_flight: deque[Any] = deque()
    offset, k = 0, 0
    try:
        while True:
            piece = tail.next_piece(offset)
            end, last = piece if piece is not None else (offset, True)
            state = _FAILED if piece is None else _LAST if last else _MORE
            header = torch.tensor([end - offset, state], dtype=torch.int64)
            in_flight.append(dist.isend(header, dst, group=group, tag=_piece_tag(tag, k)))
            if end > offset:
                data = torch.from_file(tail.path, shared=False, size=end, dtype=torch.uint8)[offset:end]
                in_flight.append(dist.isend(data, dst, group=group, tag=_piece_tag(tag, k) + 1))
            offset, k = end, k + 1
            while len(in_flight) > 2 * PIECES_IN_FLIGHT:
                in_flight.popleft().wait()
            if last:
                return
    finally:
        _wait(list(in_flight))


def receive_file(path: str, src: int, group: object, tag: int, recycle: Callable[[str], bool] | None = None) -> None:
    """Receive the file ``src`` sends (:func:`send_file`) into ``path``, whole or not at all, fsynced.
    If the file cannot be written (a full disk), the rest is still received, so that the sender is not left
    waiting, and the error is raised. Raises :class:`SourceFailed` if the sender's own write failed.
    ``recycle(tmp)`` may put an old file at the temporary's name to write over ([Note: spare tier files])."""
    def write(tmp: str) -> None:
        buffers = [torch.empty(0, dtype=torch.uint8) for _ in range(2)]
        error: OSError | None = None
        fd = -1
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            over = recycle is not None and recycle(tmp)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | (0 if over else os.O_TRUNC), 0o644)
        except OSError as exc:
            error = exc  # the pieces are still received (and dropped)
        try:
            offset, k = 0, 0
            header = _receive_header(src, group, tag, 0)
            pending: tuple[Tensor, int] | None = None  # the piece received, not yet written
            while True:
                header[1].wait()
                length, state = header[0].tolist()
                if state == _FAILED:
                    raise SourceFailed(f"rank {src}'s write of its file failed; no replica of it was made")
                buffer = buffers[k % 2]
                if buffer.numel() < length:
                    buffer = buffers[k % 2] = torch.empty(length, dtype=torch.uint8)
                data = dist.irecv(buffer[:length], src, group=group, tag=_piece_tag(tag, k) + 1) if length else None
                if state != _LAST:
                    header = _receive_header(src, group, tag, k + 1)
                if pending is not None and error is None:  # written while this piece arrives
                    error = _append(fd, *pending)
                if data is not None:
                    data.wait()
                pending = (buffer[:length], offset)
                offset, k = offset + length, k + 1
                if state == _LAST:
                    break
            if pending is not None and error is None:
                error = _append(fd, *pending)
            if error is not None:
                raise error
            os.ftruncate(fd, offset)
            os.fsync(fd)
        finally:
            if fd >= 0:
                os.close(fd)

    storage.replace_whole(path, write)


def _receive_header(src: int, group: object, tag: int, k: int) -> tuple[Tensor, Any]:
    header = torch.zeros(2, dtype=torch.int64)
    return header, dist.irecv(header, src, group=group, tag=_piece_tag(tag, k))


def _piece_tag(tag: int, k: int) -> int:
    if 2 * k + 2 >= _TAG_STRIDE:
        raise ValueError(f"a replicated file has more than {_TAG_STRIDE // 2 - 1} pieces of {CHUNK_BYTES} bytes;"
                         " raise replication.CHUNK_BYTES")
    return tag + 2 * k + 1


def _append(fd: int, piece: Tensor, offset: int) -> OSError | None:
    """Write ``piece`` at ``offset``; the error (a full disk) instead of raising it, so receiving goes on."""
    view = memoryview(piece.numpy()).cast("B")
    try:
        while view:
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written
    except OSError as exc:
        return exc
    return None


class Replicating:
    """A file's exchange with its ring peers, under way on two threads (one sends, one receives) while
    the file is still being written ([Note: streamed replication])."""

    def __init__(self, tail: Tail, sends: Sequence[int | None], receives: Sequence[int | None], group: object,
                 target: Callable[[int], str], recycle: Callable[[str], bool] | None = None) -> None:
        self.received: list[int] = []
        self._errors: list[BaseException] = []

        def receive(src: int, tag: int) -> None:
            receive_file(target(src), src, group, tag, recycle)
            self.received.append(src)

        self._threads = [
            threading.Thread(target=self._run, args=(lambda dst, tag: send_file(tail, dst, group, tag), sends),
                             daemon=True, name="lightning_zero-replicate-send"),
            threading.Thread(target=self._run, args=(receive, receives), daemon=True,
                             name="lightning_zero-replicate-receive"),
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, work: Callable[[int, int], None], peers: Sequence[int | None]) -> None:
        """Every round, whatever an earlier one did: a peer of a later round waits for this rank's part
        in it. The errors are raised by :meth:`join`, on the save's worker thread."""
        for round_index, peer in enumerate(peers):
            if peer is None:
                continue
            try:
                work(peer, round_index * _TAG_STRIDE)
            except BaseException as exc:
                self._errors.append(exc)

    def join(self) -> list[int]:
        """Wait for both directions; the sources whose files arrived. Raises the first failure."""
        for thread in self._threads:
            thread.join()
        if self._errors:
            raise self._errors[0]
        return self.received


def send_plan(plan: Sequence[tuple[int, int, str]], rank: int, group: object, path_of: Callable[[str], str]) -> None:
    """(every rank of ``group``) Run ``plan``, a list of (sender, receiver, key) the same on every rank, in
    order: the sender sends the file ``path_of(key)`` to the receiver, which writes it (whole) at its own
    ``path_of(key)``; the other ranks skip the entry."""
    for index, (sender, receiver, key) in enumerate(plan):
        if rank == sender:
            send_file(Tail.whole(path_of(key)), receiver, group, index * _TAG_STRIDE)
        elif rank == receiver:
            receive_file(path_of(key), sender, group, index * _TAG_STRIDE)


def _wait(requests: list[object]) -> None:
    for request in requests:
        request.wait()  # type: ignore[attr-defined]
