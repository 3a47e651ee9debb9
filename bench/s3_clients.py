"""The two S3 clients side by side: the same checkpoint saved and loaded through s3fs (the default) and through
s3torchconnector (``storage_options={"client": "s3torchconnector"}``), against the same S3 server.

The server is moto's (``moto.server``) on 127.0.0.1, in a process of its own so that it does not share this
process's GIL with the clients. One gloo rank saves ``--size-mb`` MiB of fp32 state (``FlatShard`` s of
``--tensors`` tensors) in each of ``--modes`` synchronously (``lightning_zero.checkpoint.save``: the background
write and the commit, timed to the commit) and loads it back into zeroed tensors, checked equal; clients and
modes interleaved within each of ``--repeats`` rounds, the median reported.

What it shows: the cost of each client's own path on this machine (its request pattern, its threads, the copies
between torch.save and the socket) for the package's three modes; which of the two is CPU-bound first. What it
cannot show: S3's own behaviour. moto keeps objects in Python memory and answers over loopback, so neither the
network (bandwidth, latency, many connections in flight: where the CRT client's parallel parts pay off) nor
S3's throttling and per-prefix limits are in the figures; the server's own CPU time is part of every figure.

    .venv/bin/python bench/s3_clients.py                 # 256 MiB, 3 repeats, every mode (make bench)
    .venv/bin/python bench/s3_clients.py --quick         # 32 MiB, 1 repeat
    .venv/bin/python bench/s3_clients.py --size-mb 512 --repeats 5 --modes sharded

The markdown report goes to stdout and to ``bench/out/s3_clients.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_zero.checkpoint import FlatShard, load, save  # noqa: E402

MIB = 2**20
OUT = Path(__file__).resolve().parent / "out" / "s3_clients.md"
CLIENTS = ("s3fs", "s3torchconnector")
MODES = ("local", "sharded", "full")
KEY = "testing"


def storage_options(client: str, endpoint: str) -> dict[str, Any]:
    """What a user passes for ``client`` (the environment holds the keys, as the CRT client takes them)."""
    if client == "s3torchconnector":
        return {"client": "s3torchconnector", "endpoint_url": endpoint}
    return {"endpoint_url": endpoint, "key": KEY, "secret": KEY}


@contextmanager
def moto_process(bucket: str) -> Iterator[str]:
    """moto's S3 server in a child process on a free port of 127.0.0.1 with ``bucket``; yields the endpoint."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=KEY,
                              region_name="us-east-1")
        for _ in range(200):
            try:
                client.create_bucket(Bucket=bucket)
                break
            except Exception:  # not listening yet
                time.sleep(0.1)
        else:
            raise RuntimeError(f"moto did not start on {endpoint}")
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=30)


def state(size_mb: int, tensors: int, value: float = 1.0) -> dict[str, Any]:
    numel = size_mb * MIB // 4 // tensors
    return {f"t{i}": FlatShard(torch.full((numel,), value + i), (numel,), 0, 1) for i in range(tensors)}


def measure(client: str, endpoint: str, bucket: str, mode: str, size_mb: int, tensors: int) -> tuple[float, float]:
    """Seconds to save (to the commit) and to load one checkpoint through ``client``."""
    options = storage_options(client, endpoint)
    url = f"s3://{bucket}/{client}-{mode}-{uuid.uuid4().hex[:8]}/last.ckpt"
    saved = state(size_mb, tensors)
    start = time.perf_counter()
    save(saved, url, mode=mode, storage_options=options)
    saved_s = time.perf_counter() - start
    target = state(size_mb, tensors, 0.0)
    start = time.perf_counter()
    load(target, url, storage_options=options)
    loaded_s = time.perf_counter() - start
    for name, leaf in saved.items():
        assert torch.equal(target[name].local, leaf.local), f"{client} {mode}: {name} differs after the load"
    return saved_s, loaded_s


def report(rows: dict[tuple[str, str], list[tuple[float, float]]], size_mb: int, repeats: int, command: str,
           machine: str) -> str:
    lines = [
        "# S3 clients side by side", "",
        f"`{command}`: {size_mb} MiB of fp32 state, one gloo rank, {repeats} interleaved repeats (median).",
        f"{machine} The server is moto on 127.0.0.1 in its own process: loopback and Python, not S3 (see the script's"
        " docstring for what that leaves out).", "",
        "| mode | client | save (s) | save MB/s | load (s) | load MB/s |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    size = size_mb * MIB / 1e6
    for (mode, client), runs in rows.items():
        save_s = statistics.median(r[0] for r in runs)
        load_s = statistics.median(r[1] for r in runs)
        lines.append(f"| {mode} | {client} | {save_s:.2f} | {size / save_s:.0f} | {load_s:.2f} | {size / load_s:.0f} |")
    lines += ["", "s3torchconnector / s3fs, time (below 1: s3torchconnector faster):", ""]
    for mode in dict.fromkeys(mode for mode, _ in rows):
        if (mode, CLIENTS[0]) in rows and (mode, CLIENTS[1]) in rows:
            base, other = rows[(mode, CLIENTS[0])], rows[(mode, CLIENTS[1])]
            ratio_save = statistics.median(r[0] for r in other) / statistics.median(r[0] for r in base)
            ratio_load = statistics.median(r[1] for r in other) / statistics.median(r[1] for r in base)
            lines.append(f"- {mode}: save {ratio_save:.2f}, load {ratio_load:.2f}")
    return "\n".join(lines) + "\n"


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=None, help="MiB of state (default 256; --quick 32)")
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default 3; --quick 1)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--quick", action="store_true", help="a smoke run: 32 MiB, 1 repeat")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    args.size_mb = args.size_mb or (32 if args.quick else 256)
    args.repeats = args.repeats or (1 if args.quick else 3)
    return args


def main(argv: Sequence[str] | None = None) -> str:
    args = parse(argv)
    os.environ.update(AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=KEY, AWS_DEFAULT_REGION="us-east-1")
    torch.set_num_threads(1)
    command = " ".join([".venv/bin/python", "bench/s3_clients.py", *(argv if argv is not None else sys.argv[1:])])
    machine = f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, torch {torch.__version__}."
    rows: dict[tuple[str, str], list[tuple[float, float]]] = {(m, c): [] for m in args.modes for c in CLIENTS}
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        with moto_process("lightning-zero-bench") as endpoint:
            for mode in args.modes:  # one warm-up each: sessions, DCP's planners, the CRT client's threads
                for client in CLIENTS:
                    measure(client, endpoint, "lightning-zero-bench", mode, 1, 2)
            for _ in range(args.repeats):
                for mode in args.modes:
                    for client in CLIENTS:
                        rows[(mode, client)].append(
                            measure(client, endpoint, "lightning-zero-bench", mode, args.size_mb, args.tensors))
    finally:
        if owns_group:
            dist.destroy_process_group()
    text = report(rows, args.size_mb, args.repeats, command, machine)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return text


if __name__ == "__main__":
    main()
