"""``checkpoint/tiered/replication.py``: files streamed between ranks in pieces, whole or not at all on arrival."""

from __future__ import annotations

import os

import torch.distributed as dist
from _dist import run_distributed

from lightning_zero.checkpoint.tiered import replication

_SIZES = (0, 1, 7, 4096, 4096 * 3 + 5)  # empty, one byte, under one piece, exactly one, several with a tail


def _exchange(own: str, sends: list[int], receives: list[int], group: object, target, recycle=None) -> list[int]:
    """A complete file sent and received in the same rounds, as a tiered save runs it once its file is written."""
    return replication.Replicating(replication.Tail.whole(own), sends, receives, group, target, recycle).join()


def _payload(rank: int, size: int) -> bytes:
    return bytes((rank * 31 + i * 7) % 251 for i in range(size))


def _exchange_in_small_pieces(rank: int, world_size: int, root: str) -> list[tuple[int, bool]]:
    replication.CHUNK_BYTES = 4096  # many pieces, two in flight each way
    group = dist.new_group(backend="gloo")
    results = []
    for size in _SIZES:
        own = os.path.join(root, f"own{rank}-{size}")
        with open(own, "wb") as f:
            f.write(_payload(rank, size))
        peer = (rank + 1) % world_size

        def longer_old_file(tmp: str) -> bool:  # a spare to write over, longer than any file here
            with open(tmp, "wb") as f:
                f.write(b"\xff" * (4096 * 4))
            return True

        arrived = _exchange(own, [peer], [(rank - 1) % world_size], group,
                                             lambda source, size=size: os.path.join(root, f"got{rank}-from{source}-{size}"),
                                             recycle=longer_old_file if size % 2 else None)
        source = (rank - 1) % world_size
        with open(os.path.join(root, f"got{rank}-from{source}-{size}"), "rb") as f:
            results.append((size, arrived == [source] and f.read() == _payload(source, size)))
        # One-way: rank 0 sends, rank 1 receives (a plan entry, as recovery runs it).
        plan = [(0, 1, f"k{size}")]
        path_of = (lambda key, own=own: own) if rank == 0 else (lambda key: os.path.join(root, f"planned-{key}"))
        replication.send_plan(plan, rank, group, path_of)
        if rank == 1:
            with open(os.path.join(root, f"planned-k{size}"), "rb") as f:
                results.append((-size, f.read() == _payload(0, size)))
    dist.barrier(group)  # both ranks done before either looks for temporaries
    leftovers = [n for n in os.listdir(root) if ".tmp" in n]
    results.append((-1, not leftovers))
    return results


def test_files_stream_between_ranks_in_pieces_and_arrive_bit_for_bit(tmp_path):
    for rank_results in run_distributed(_exchange_in_small_pieces, 2, str(tmp_path)):
        assert all(ok for _, ok in rank_results), rank_results


def _receiver_disk_full(rank: int, world_size: int, root: str) -> tuple[str, list[str]]:
    import errno

    replication.CHUNK_BYTES = 1 << 20  # 24 MiB in 1 MiB pieces: more than socket buffers take unread
    group = dist.new_group(backend="gloo")
    own = os.path.join(root, f"own{rank}")
    with open(own, "wb") as f:
        f.write(bytes([rank + 1]) * (24 << 20))
    if rank == 1:
        def full(*_args: object) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        replication.os.pwrite = full  # type: ignore[assignment]
    try:
        _exchange(own, [1 - rank], [1 - rank], group, lambda source: os.path.join(root, f"got{rank}"))
        outcome = "ok"
    except OSError as exc:
        outcome = f"OSError: {exc}"
    dist.barrier(group)
    return outcome, sorted(n for n in os.listdir(root) if n.startswith(f"got{rank}"))


def test_a_receiver_with_a_full_disk_raises_and_its_sender_is_not_left_waiting(tmp_path):
    sender, receiver = run_distributed(_receiver_disk_full, 2, str(tmp_path))
    assert sender == ("ok", ["got0"])  # rank 0's own receive went through; its send was drained
    assert receiver[0].startswith("OSError") and "No space left" in receiver[0]
    assert receiver[1] == []  # no partial file, no temporary


def _stream_while_writing(rank: int, world_size: int, root: str) -> tuple[bool, bool, list[str]]:
    """Rank 0 writes its file in three steps and waits, after the second, until rank 1 has a piece of it on
    disk: only a sender that sends pieces before the file is whole lets it go on."""
    import time

    replication.CHUNK_BYTES = 4096
    group = dist.new_group(backend="gloo")
    payload = _payload(7, 4096 * 2 + 100)
    flag = os.path.join(root, "first-piece-arrived")
    if rank == 0:
        own = os.path.join(root, "growing")
        tail = replication.Tail(own)
        replicating = replication.Replicating(tail, [1], [None], group, lambda source: "")
        overlapped = False
        with open(own, "wb") as f:
            f.write(payload[:4096 * 2])
            f.flush()
            tail.advance(4096 * 2)
            deadline = time.monotonic() + 30
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.01)
            overlapped = os.path.exists(flag)
            f.write(payload[4096 * 2:])
        tail.finish(len(payload))
        replicating.join()
        arrived_whole = True
    else:
        target = os.path.join(root, "replica")
        replicating = replication.Replicating(replication.Tail(""), [None], [0], group, lambda source: target)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
                n.startswith("replica.tmp") and os.path.getsize(os.path.join(root, n)) >= 4096 for n in os.listdir(root)):
            time.sleep(0.01)
        open(flag, "w").close()
        overlapped = replicating.join() == [0]
        with open(target, "rb") as f:
            arrived_whole = f.read() == payload
    dist.barrier(group)
    return overlapped, arrived_whole, sorted(n for n in os.listdir(root) if ".tmp" in n)


def test_a_file_is_sent_while_it_is_written_and_arrives_whole(tmp_path):
    for overlapped, whole, leftovers in run_distributed(_stream_while_writing, 2, str(tmp_path)):
        assert overlapped and whole and leftovers == []


def _writer_fails(rank: int, world_size: int, root: str) -> tuple[str, list[str]]:
    replication.CHUNK_BYTES = 4096
    group = dist.new_group(backend="gloo")
    if rank == 0:
        own = os.path.join(root, "broken")
        with open(own, "wb") as f:
            f.write(b"x" * 4096 * 3)
        tail = replication.Tail(own)
        replicating = replication.Replicating(tail, [1], [None], group, lambda source: "")
        tail.advance(4096 * 3)  # two pieces sent, then the writer fails (a full disk, say)
        tail.fail()
        replicating.join()
        outcome = "sent"
    else:
        replicating = replication.Replicating(replication.Tail(""), [None], [0], group,
                                              lambda source: os.path.join(root, "replica"))
        try:
            replicating.join()
            outcome = "received"
        except replication.SourceFailed as exc:
            outcome = f"SourceFailed: {exc}"
    dist.barrier(group)
    return outcome, sorted(n for n in os.listdir(root) if n.startswith("replica"))


def test_a_sender_whose_write_fails_leaves_no_replica(tmp_path):
    sender, receiver = run_distributed(_writer_fails, 2, str(tmp_path))
    assert sender[0] == "sent"
    assert receiver[0].startswith("SourceFailed") and "rank 0" in receiver[0]
    assert receiver[1] == []  # no partial replica, no temporary


def _first_round_fails_on_rank_1(rank: int, world_size: int, root: str) -> tuple[str, list[int]]:
    """Three ranks, two replicas each: rank 1 cannot write the file of round 1; it still takes round 2's."""
    import errno

    replication.CHUNK_BYTES = 4096
    group = dist.new_group(backend="gloo")
    own = os.path.join(root, f"own{rank}")
    with open(own, "wb") as f:
        f.write(_payload(rank, 4096 * 2 + 3))
    calls = []

    def full_once(tmp: str) -> bool:
        calls.append(tmp)
        if rank == 1 and len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return False

    sends = [(rank + 1) % world_size, (rank + 2) % world_size]
    receives = [(rank - 1) % world_size, (rank - 2) % world_size]
    replicating = replication.Replicating(replication.Tail.whole(own), sends, receives, group,
                                          lambda source: os.path.join(root, f"got{rank}-from{source}"), full_once)
    try:
        outcome = f"arrived {replicating.join()}"
    except OSError as exc:
        outcome = f"OSError: {exc}"
    dist.barrier(group)
    whole = []
    for source in receives:
        path = os.path.join(root, f"got{rank}-from{source}")
        if os.path.exists(path):
            with open(path, "rb") as f:
                whole.append(source if f.read() == _payload(source, 4096 * 2 + 3) else -1)
    return outcome, whole


def test_a_failed_round_does_not_stop_the_next_ones(tmp_path):
    results = run_distributed(_first_round_fails_on_rank_1, 3, str(tmp_path))
    assert results[0] == ("arrived [2, 1]", [2, 1])
    assert results[1][0].startswith("OSError") and "No space left" in results[1][0]
    assert results[1][1] == [2]  # round 1 (from rank 0) failed; round 2 (from rank 2) arrived whole
    assert results[2] == ("arrived [1, 0]", [1, 0])
