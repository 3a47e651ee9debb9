"""``checkpoint/replication.py``: files streamed between ranks in pieces, whole or not at all on arrival."""

from __future__ import annotations

import os

import torch.distributed as dist
from _dist import run_distributed

from lightning_zero.checkpoint import replication

_SIZES = (0, 1, 7, 4096, 4096 * 3 + 5)  # empty, one byte, under one piece, exactly one, several with a tail


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
        arrived = replication.exchange_files(own, [peer], [(rank - 1) % world_size], group,
                                             lambda source, size=size: os.path.join(root, f"got{rank}-from{source}-{size}"))
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

        replication.os.posix_fallocate = full  # type: ignore[assignment]
    try:
        replication.exchange_files(own, [1 - rank], [1 - rank], group, lambda source: os.path.join(root, f"got{rank}"))
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
