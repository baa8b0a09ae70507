"""Transfers on loopback, ours against the bare library: Mooncake TransferEngine writes (`--library mooncake`,
`transport.mooncake.MooncakeEngine`) and NIXL reads (`--library nixl`, the `ECCPUConnector` producer).

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

With `--library nixl` the consumer process reads (as vLLM's `ECCPUConnector` consumer does: one NIXL READ of
an item's blocks, in blocks of `--block-bytes`, with its notification) from one of two producers:

    bare        the library alone, as it ships (its progress thread on), in a process of its own that lives only
                while it is measured: a registered buffer already holding the item, read per item
    bare+copy   the same, the item's bytes copied into the registered buffer before each read (what any
                producer of rows just computed must do, unless it computes into registered memory)
    ours read   `fronts.vllm.connectors.cpu.ECCPUConnector`, as the consumer waits for it: the consumer's
                XferReq and our XferAck over the side channel, the READ, and the notification our side channel
                drains (the pin released). The item is in the pool already, as when served: its rows go in
                before the encoder answers, so before any consumer can ask for it
    ours put+read  the same with the put (blocks taken, bytes copied) in the timed span

The NIXL figure is the item's size over the median time per item of the `--count` items of a repeat: on a
shared machine single reads swing by two orders of magnitude (the producer's UCX progress must be
scheduled for a READ over TCP), and a sum would be the outliers'.

    python benchmarks/transport.py --library nixl --sizes-mb 1,16,64 --count 10 --repeats 5
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
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


def nixl_reader(connection, block_size: int, blocks: int, compat: str) -> None:
    """The consumer process: reads what it is told to, and says how long each read took."""
    from tests.support.nixl_consumer import NixlConsumer

    with NixlConsumer(block_size, compat, num_blocks=blocks) as consumer:
        connection.send("ready")
        while (command := connection.recv()) != "stop":
            if command[0] == "bare":
                _, metadata, descriptor, count, repeat = command
                ack = {"agent_metadata": metadata, "mem_descriptor": descriptor, "src_block_indices": range(count)}
                consumer.pull(ack, "bare")  # connects once
                times = []
                for _ in range(repeat):
                    started = time.perf_counter()
                    consumer.pull(ack, "bare")
                    times.append(time.perf_counter() - started)
                connection.send(times)
            else:
                _, host, port, mm_hash = command
                started = time.perf_counter()
                ack = consumer.ask(host, port, mm_hash)
                assert ack["status"] == 0, ack
                consumer.pull(ack, mm_hash)
                connection.send(time.perf_counter() - started)


def bare_producer(connection, block: int, blocks: int) -> None:
    """The bare library's producer process: an agent as NIXL ships it (its progress thread on) and a registered
    buffer; per command, the item's bytes copied in (timed) and the consumer's reads, until told to stop."""
    import mmap

    import msgpack
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    from encode_server.transport.nixl import block_descriptors, quiet_ucx_exit

    quiet_ucx_exit()
    agent = nixl_agent(f"bare-producer-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
    area = mmap.mmap(-1, blocks * block)
    buffer = np.frombuffer(area, dtype=np.uint8)
    buffer[::mmap.PAGESIZE] = 0
    registration = agent.get_reg_descs([(buffer.ctypes.data, blocks * block, 0, "")], "DRAM")
    agent.register_memory(registration, backends=["UCX"])
    connection.send((agent.get_agent_metadata(), msgpack.packb(block_descriptors(buffer.ctypes.data, blocks, block))))
    while (command := connection.recv()) != "stop":
        flat, count = command
        copies = []
        for _ in range(count):
            started = time.perf_counter()
            buffer[:flat.size] = flat
            copies.append(time.perf_counter() - started)
        connection.send(copies)
    agent.deregister_memory(registration, backends=["UCX"])
    connection.send("stopped")
    os._exit(0)  # NIXL's agents go with the process


def bench_nixl(args, sizes: list[int]) -> int:
    import asyncio  # noqa: F401 - the producer's module expects a loop-capable process

    import torch

    from encode_server.fronts.vllm.connectors.cpu import ECCPUConnector
    from encode_server.fronts.vllm.transfer_config import ECTransferConfig
    from encode_server.fronts.vllm.versions import VllmVersion
    from encode_server.transport.nixl import quiet_ucx_exit
    from tests.support.helpers import free_port

    quiet_ucx_exit()
    block = args.block_bytes
    most = max(-(-size // block) for size in sizes)
    config = ECTransferConfig("ECCPUConnector", "ec_producer", cpu_bytes=3 * most * block, hold_s=0.001,
                              progress_thread=args.progress_thread)
    port = free_port()
    ours = ECCPUConnector(config, "bench", block // 4, torch.float32, "bench", VllmVersion("0.33.0"), "127.0.0.1", port)
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=nixl_reader, args=(child, block, most + 1, ours.compat_hash))
    process.start()
    assert parent.recv() == "ready"

    def bare_reads(flat, rows: int) -> tuple[list[float], list[float]]:
        """The bare producer's reads, then its copy-then-read, for this repeat: its process (and its spinning progress
        thread) lives only while they are measured, as ours idles while they are."""
        here, there = context.Pipe()
        producer = context.Process(target=bare_producer, args=(there, block, most))
        producer.start()
        metadata, descriptor = here.recv()
        here.send((flat, 1))
        here.recv()
        parent.send(("bare", metadata, descriptor, rows, args.count))
        reads = parent.recv()
        here.send((flat, args.count))
        copies = here.recv()
        parent.send(("bare", metadata, descriptor, rows, args.count))
        copied_reads = [copy + read for copy, read in zip(copies, parent.recv())]
        here.send("stop")
        here.recv()
        producer.join(30)
        return reads, copied_reads

    print(f"NIXL reads (UCX, UCX_TLS {os.environ.get('UCX_TLS', 'default')}) on loopback, blocks of {block} bytes; "
          f"{args.count} items per measurement, {args.repeats} repeats; ours "
          f"{'with' if args.progress_thread else 'without'} NIXL's progress thread\n")
    print("| size | bare GB/s | bare+copy GB/s | ours read GB/s | ours put+read GB/s | ours read / bare | "
          "ours put+read / bare+copy |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    serial = 0
    try:
        for size in sizes:
            rows = size // block
            nbytes = rows * block
            source = torch.randn(rows, block // 4)
            flat = source.view(torch.uint8).numpy().reshape(-1)
            results: dict[str, list[float]] = {"bare": [], "bare+copy": [], "ours read": [], "ours put+read": []}
            for _ in range(args.repeats):
                reads, copied_reads = bare_reads(flat, rows)
                results["bare"].append(nbytes / statistics.median(reads) / 1e9)
                results["bare+copy"].append(nbytes / statistics.median(copied_reads) / 1e9)
                items, whole = [], []
                for _ in range(args.count + 1):
                    serial += 1
                    started = time.perf_counter()
                    ours.pool.put(f"item-{serial}", source, config.hold_s)
                    put = time.perf_counter() - started
                    parent.send(("ours", "127.0.0.1", port, f"item-{serial}"))
                    read = parent.recv()
                    if _:  # the first one connects
                        items.append(read)
                        whole.append(put + read)
                results["ours read"].append(nbytes / statistics.median(items) / 1e9)
                results["ours put+read"].append(nbytes / statistics.median(whole) / 1e9)

            def ratio(name: str, base: str, results=results) -> str:
                values = [a / b for a, b in zip(results[name], results[base])]
                return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"

            print(f"| {size >> 20} MiB | {statistics.median(results['bare']):.2f} | "
                  f"{statistics.median(results['bare+copy']):.2f} | {statistics.median(results['ours read']):.2f} | "
                  f"{statistics.median(results['ours put+read']):.2f} | {ratio('ours read', 'bare')} | "
                  f"{ratio('ours put+read', 'bare+copy')} |", flush=True)
        deadline = time.monotonic() + 5
        while ours.open_reservations and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ours.open_reservations == 0 and ours.stats.failures == 0
    finally:
        parent.send("stop")
        process.join(30)
        ours.close()
    os._exit(0)  # NIXL's agents go with the process


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", default="mooncake", choices=("mooncake", "nixl"))
    parser.add_argument("--sizes-mb", default="1,16,64")
    parser.add_argument("--count", type=int, default=20, help="items per measurement")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--protocol", default="tcp", choices=("tcp", "rdma"), help="Mooncake's transport")
    parser.add_argument("--block-bytes", type=int, default=3584 * 4,
                        help="NIXL: the consumer's block (one row of the language model: Qwen2.5-VL-7B's 3584 float32)")
    parser.add_argument("--progress-thread", action="store_true",
                        help="NIXL: run ours with NIXL's own progress thread (ec_connector_extra_config."
                             "nixl_progress_thread), as the bare agent runs")
    args = parser.parse_args()
    if args.library == "nixl":
        return bench_nixl(args, [int(float(size) * (1 << 20)) for size in args.sizes_mb.split(",")])
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
