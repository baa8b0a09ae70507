"""Mooncake TransferEngine writes: ours (`transport.mooncake.MooncakeEngine`) against the bare library, on loopback.

The receiving side runs in a separate process (as a consumer rank does): a TransferEngine with a registered
buffer, which hands its session and buffer address back over a pipe. The sending side runs here, one item
after another, for each payload size:

    bare        the library alone: the source registered once, then `batch_transfer_sync_write` per item
    bare+reg    the library, registering and unregistering the source around each write (what any
                producer must do for rows it has just computed)
    ours        `MooncakeEngine`: `memory.pinned` (registration within the bound) and `write` per item,
                counters and all

Each repeat measures the three back to back (so drift on a shared machine hits them alike); the figure is
GB/s over `--count` items, and the ratio to bare is taken per repeat and printed as median [min-max].

    python benchmarks/transport.py --sizes-mb 1,16,64 --count 20 --repeats 5 --protocol tcp
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def receiver(connection, buffer_bytes: int, protocol: str) -> None:
    """The receiving process: a registered buffer, kept until told to stop."""
    import torch
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") == 0
    buffer = torch.zeros(buffer_bytes, dtype=torch.uint8)
    assert engine.register_memory(buffer.data_ptr(), buffer_bytes) == 0
    connection.send((f"127.0.0.1:{engine.get_rpc_port()}", buffer.data_ptr()))
    connection.recv()  # stop
    engine.unregister_memory(buffer.data_ptr())


def measure(bare, ours, session: str, address: int, size: int, count: int, repeats: int) -> dict[str, list[float]]:
    """GB/s of each way of writing, per repeat."""
    import torch

    source = torch.randint(0, 255, (size,), dtype=torch.uint8)
    pointer = source.data_ptr()

    def bare_write() -> None:
        assert bare.batch_transfer_sync_write(session, [pointer], [address], [size]) == 0

    def bare_registered_write() -> None:
        assert bare.register_memory(pointer, size) == 0
        try:
            bare_write()
        finally:
            bare.unregister_memory(pointer)

    def ours_write() -> None:
        with ours.memory.pinned([(pointer, size)]):
            ours.write(session, [pointer], [address], [size])

    results: dict[str, list[float]] = {"bare": [], "bare+reg": [], "ours": []}
    for _ in range(repeats):
        for name, write in (("bare", bare_write), ("bare+reg", bare_registered_write), ("ours", ours_write)):
            if name == "bare":
                assert bare.register_memory(pointer, size) == 0
            write()  # warm the connection
            started = time.perf_counter()
            for _ in range(count):
                write()
            results[name].append(size * count / (time.perf_counter() - started) / 1e9)
            if name == "bare":
                bare.unregister_memory(pointer)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", default="1,16,64")
    parser.add_argument("--count", type=int, default=20, help="items per measurement")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--protocol", default="tcp", choices=("tcp", "rdma"))
    args = parser.parse_args()
    from mooncake.engine import TransferEngine

    from encode_server.transport.mooncake import MooncakeEngine

    sizes = [int(float(size) * (1 << 20)) for size in args.sizes_mb.split(",")]
    parent, child = multiprocessing.get_context("spawn").Pipe()
    process = multiprocessing.get_context("spawn").Process(target=receiver, args=(child, max(sizes), args.protocol))
    process.start()
    session, address = parent.recv()
    bare = TransferEngine()
    assert bare.initialize("127.0.0.1", "P2PHANDSHAKE", args.protocol, "") == 0
    ours = MooncakeEngine("127.0.0.1", args.protocol, limit_bytes=1 << 34)
    print(f"Mooncake TransferEngine over {args.protocol} on loopback; {args.count} items per measurement, "
          f"{args.repeats} repeats\n")
    print("| size | bare GB/s | bare+reg GB/s | ours GB/s | ours / bare | ours / bare+reg |")
    print("| --- | --- | --- | --- | --- | --- |")
    try:
        for size in sizes:
            results = measure(bare, ours, session, address, size, args.count, args.repeats)

            def ratio(name: str, base: str, results=results) -> str:
                values = [a / b for a, b in zip(results[name], results[base])]
                return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"

            print(f"| {size >> 20} MiB | {statistics.median(results['bare']):.2f} | "
                  f"{statistics.median(results['bare+reg']):.2f} | {statistics.median(results['ours']):.2f} | "
                  f"{ratio('ours', 'bare')} | {ratio('ours', 'bare+reg')} |", flush=True)
        assert ours.memory.bytes_held == 0
    finally:
        parent.send("stop")
        process.join(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
