"""Delivery throughput and latency: our sender and receiver against a bare pyzmq zero-copy loop.

Both sides run in one process over loopback TCP, in the same run, for each payload size:
throughput (GB/s) streaming `--count` messages, and the median latency of one message sent and
received on its own. Each figure is the median of `--repeats` interleaved runs; "sender" and
"receiver" are each of our halves against the other half bare.

    python scripts/bench_transfer.py --sizes-mb 1,16 --count 200
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from encode_server.receiver import EmbeddingReceiver  # noqa: E402
from encode_server.transfer import EmbeddingSender  # noqa: E402
from encode_server.wire import Header  # noqa: E402
from processors.dtypes import raw_bytes as payload_view  # noqa: E402

DIM = 1024


def bare_pyzmq(tensor: torch.Tensor, count: int, rounds: int) -> tuple[float, float]:
    context = zmq.Context.instance()
    pull = context.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = context.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    payload = payload_view(tensor)
    header = b'{"v":1}'

    def drain(n: int) -> None:
        for _ in range(n):
            pull.recv_multipart(copy=False)

    consumer = threading.Thread(target=drain, args=(count,))
    consumer.start()
    started = time.perf_counter()
    for _ in range(count):
        push.send_multipart([header, payload], copy=False)
    consumer.join()
    throughput = count * len(payload) / (time.perf_counter() - started) / 1e9
    latencies = []
    for _ in range(rounds):
        started = time.perf_counter()
        push.send_multipart([header, payload], copy=False)
        pull.recv_multipart(copy=False)
        latencies.append(time.perf_counter() - started)
    push.close(0)
    pull.close(0)
    return throughput, statistics.median(latencies) * 1e3


def sender_only(tensor: torch.Tensor, count: int) -> float:
    """Our sender into a bare PULL socket: GB/s."""
    pull = zmq.Context.instance().socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    sender = EmbeddingSender(send_timeout_s=30)
    header = Header(req_id="x", part_idx=0, num_parts=1, modality="image", dtype="float32",
                    shape=(tensor.shape[0], DIM), items=[]).encode()

    async def run() -> float:
        drain = asyncio.ensure_future(asyncio.to_thread(lambda: [pull.recv_multipart(copy=False)
                                                                  for _ in range(count)]))
        started = time.perf_counter()
        for _ in range(count):
            await sender.send([f"tcp://127.0.0.1:{port}"], header, payload_view(tensor))
        await drain
        return count * tensor.numel() * 4 / (time.perf_counter() - started) / 1e9

    try:
        return asyncio.run(run())
    finally:
        sender.close()
        pull.close(0)


def receiver_only(tensor: torch.Tensor, count: int) -> float:
    """A bare PUSH socket into our receiver, every embedding claimed: GB/s."""
    receiver = EmbeddingReceiver(max_bytes=1 << 40)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(receiver.endpoint)
    headers = [Header(req_id=f"r{i}", part_idx=0, num_parts=1, modality="image", dtype="float32",
                      shape=(tensor.shape[0], DIM), items=[]).encode() for i in range(count)]
    feeder = threading.Thread(target=lambda: [push.send_multipart([h, payload_view(tensor)], copy=False)
                                              for h in headers])
    started = time.perf_counter()
    feeder.start()
    for index in range(count):
        receiver.get(f"r{index}", timeout=60)
    feeder.join()
    elapsed = time.perf_counter() - started
    push.close(0)
    receiver.close()
    return count * tensor.numel() * 4 / elapsed / 1e9


def ours(tensor: torch.Tensor, count: int, rounds: int) -> tuple[float, float]:
    receiver = EmbeddingReceiver(max_bytes=1 << 40)
    sender = EmbeddingSender(send_timeout_s=30)
    rows = tensor.shape[0]

    def header(req_id: str) -> bytes:
        return Header(req_id=req_id, part_idx=0, num_parts=1, modality="image", dtype="float32",
                      shape=(rows, DIM), items=[{"tokens": rows, "grid_thw": [1, 1, rows]}]).encode()

    async def run() -> tuple[float, float]:
        endpoints = [receiver.endpoint]
        claimed = asyncio.ensure_future(asyncio.to_thread(
            lambda: [receiver.get(f"s{i}", timeout=60) for i in range(count)]))
        started = time.perf_counter()
        for index in range(count):
            await sender.send(endpoints, header(f"s{index}"), payload_view(tensor))
        await claimed
        throughput = count * tensor.numel() * 4 / (time.perf_counter() - started) / 1e9
        latencies = []
        for index in range(rounds):
            started = time.perf_counter()
            await sender.send(endpoints, header(f"l{index}"), payload_view(tensor))
            await asyncio.to_thread(receiver.get, f"l{index}", 60)
            latencies.append(time.perf_counter() - started)
        return throughput, statistics.median(latencies) * 1e3

    try:
        return asyncio.run(run())
    finally:
        sender.close()
        receiver.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", default="1,16")
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats; medians are printed")
    args = parser.parse_args()
    print(f"{'size':>6} {'bare GB/s':>10} {'ours GB/s':>10} {'ratio':>6} {'sender GB/s':>12} "
          f"{'receiver GB/s':>14} {'bare p50 ms':>12} {'ours p50 ms':>12}")
    for size_mb in (float(s) for s in args.sizes_mb.split(",")):
        rows = max(1, int(size_mb * (1 << 20) / (DIM * 4)))
        tensor = torch.randn(rows, DIM)
        count = max(10, int(args.count / max(1.0, size_mb / 4)))
        samples = []
        for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both alike
            samples.append((*bare_pyzmq(tensor, count, args.rounds), *ours(tensor, count, args.rounds),
                            sender_only(tensor, count), receiver_only(tensor, count)))
        bare_gbps, bare_ms, our_gbps, our_ms, sender_gbps, receiver_gbps = (
            statistics.median(column) for column in zip(*samples))
        print(f"{size_mb:>5g}M {bare_gbps:>10.2f} {our_gbps:>10.2f} {our_gbps / bare_gbps:>6.2f} "
              f"{sender_gbps:>12.2f} {receiver_gbps:>14.2f} {bare_ms:>12.2f} {our_ms:>12.2f}", flush=True)


if __name__ == "__main__":
    main()
