"""Delivery throughput and latency: our sender and receiver against bare pyzmq zero-copy, side by side.

The sending side runs here, the receiving side in a separate process (as a prefill node is), both on
loopback TCP, so neither side's Python threads compete with the other's for one GIL. Four pairs are
measured in one run, interleaved, for each payload size:

    bare      a blocking pyzmq PUSH (`copy=False`)     ->  a bare PULL (`recv_multipart(copy=False)`)
    sender    our `EmbeddingSender`, from an event loop ->  the same bare PULL
    receiver  the bare PUSH                             ->  our `EmbeddingReceiver`, every embedding claimed
    ours      our `EmbeddingSender`                     ->  our `EmbeddingReceiver` (end to end)

Throughput streams `--count` messages (first send to the last one received, GB/s); latency is the
median time of one message sent alone until the receiving process acknowledges it; "sending thread"
is the CPU time of the thread that sends, per message (for our sender: what it costs the event loop). Each repeat
measures all four back to back, so drift on a shared machine hits them alike; the ratios to bare are
taken per repeat and printed as median [min-max] over `--repeats`.

    python benchmarks/zmq_delivery.py --sizes-mb 1,16 --count 200 --repeats 9
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DIM = 1024


def consumer(control_port: int) -> None:
    """The receiving process: a bare PULL and an EmbeddingReceiver, driven over a control socket."""
    import zmq

    from encode_server.receiver import EmbeddingReceiver

    context = zmq.Context()
    control = context.socket(zmq.PAIR)
    control.connect(f"tcp://127.0.0.1:{control_port}")
    pull = context.socket(zmq.PULL)
    pull_port = pull.bind_to_random_port("tcp://127.0.0.1")
    receiver = EmbeddingReceiver(max_bytes=1 << 40)
    control.send_pyobj((pull_port, receiver.port))
    while True:
        command, prefix, count = control.recv_pyobj()
        if command == "stop":
            break
        for index in range(count):
            if command.startswith("pull"):
                pull.recv_multipart(copy=False)
            else:
                receiver.get(f"{prefix}{index}", timeout=60)
            if count == 1 or command.endswith("-each"):
                control.send(b"")  # acknowledge each message: the latency rounds
        if not command.endswith("-each"):
            control.send(b"")
    receiver.close()
    pull.close(0)
    control.close(0)
    context.term()


class Bench:
    """The sending side: the bare socket, our sender on its own event loop, and the consumer process."""

    def __init__(self) -> None:
        import zmq

        from encode_server.delivery.sockets import EmbeddingSender

        self.zmq = zmq
        self.context = zmq.Context()
        self.control = self.context.socket(zmq.PAIR)
        control_port = self.control.bind_to_random_port("tcp://127.0.0.1")
        self.process = multiprocessing.get_context("spawn").Process(target=consumer, args=(control_port,))
        self.process.start()
        pull_port, receiver_port = self.control.recv_pyobj()
        self.endpoints = {"pull": f"tcp://127.0.0.1:{pull_port}", "claim": f"tcp://127.0.0.1:{receiver_port}"}
        self.bare = {}
        for name, endpoint in self.endpoints.items():
            self.bare[name] = self.context.socket(zmq.PUSH)
            self.bare[name].connect(endpoint)
        self.loop = asyncio.new_event_loop()
        self.sender = EmbeddingSender(send_timeout_s=60)
        self.serial = 0

    def close(self) -> None:
        self.control.send_pyobj(("stop", "", 0))
        self.process.join(30)
        self.sender.close()
        self.loop.close()
        for sock in self.bare.values():
            sock.close(0)
        self.control.close(0)
        self.context.term()

    def _headers(self, count: int, shape: tuple[int, int]) -> tuple[str, list[bytes]]:
        from encode_server.delivery.wire import Header

        self.serial += 1
        prefix = f"b{self.serial}-"
        return prefix, [Header(req_id=f"{prefix}{index}", part_idx=0, num_parts=1, modality="image",
                               dtype="float32", shape=shape, items=[]).encode() for index in range(count)]

    def stream(self, ours: bool, target: str, tensor, count: int) -> tuple[float, float]:
        """GB/s of `count` messages, first send to the last one received; and the sending thread's
        CPU microseconds per message (for ours: what delivery costs the event loop)."""
        from encode_server.models.dtypes import raw_bytes as payload_view

        prefix, headers = self._headers(count, tuple(tensor.shape))
        self.control.send_pyobj((target, prefix, count))
        started, cpu_started = time.perf_counter(), time.thread_time()
        if ours:
            endpoints = [self.endpoints[target]]

            async def send_all() -> None:
                for header in headers:
                    await self.sender.send(endpoints, [header, payload_view(tensor)])

            self.loop.run_until_complete(send_all())
        else:
            sock = self.bare[target]
            for header in headers:
                sock.send_multipart([header, payload_view(tensor)], copy=False)
        cpu_us = (time.thread_time() - cpu_started) / count * 1e6
        self.control.recv()
        return count * tensor.numel() * 4 / (time.perf_counter() - started) / 1e9, cpu_us

    def latency(self, ours: bool, target: str, tensor, rounds: int) -> float:
        """Median ms from sending one message alone to its receipt acknowledged by the consumer."""
        from encode_server.models.dtypes import raw_bytes as payload_view

        prefix, headers = self._headers(rounds, tuple(tensor.shape))
        self.control.send_pyobj((target + "-each", prefix, rounds))
        samples = []
        endpoints = [self.endpoints[target]]

        async def one_by_one() -> None:  # inside one running loop, as in the server
            for header in headers:
                started = time.perf_counter()
                await self.sender.send(endpoints, [header, payload_view(tensor)])
                self.control.recv()  # blocks the loop, which has nothing else to do here
                samples.append(time.perf_counter() - started)

        if ours:
            self.loop.run_until_complete(one_by_one())
        else:
            for header in headers:
                started = time.perf_counter()
                self.bare[target].send_multipart([header, payload_view(tensor)], copy=False)
                self.control.recv()
                samples.append(time.perf_counter() - started)
        return statistics.median(samples) * 1e3


PAIRS = {"bare": (False, "pull"), "sender": (True, "pull"), "receiver": (False, "claim"), "ours": (True, "claim")}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", default="1,16")
    parser.add_argument("--count", type=int, default=200, help="messages per throughput run at 1 MiB (fewer above)")
    parser.add_argument("--rounds", type=int, default=20, help="single messages per latency run")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved repeats; medians and ranges are printed")
    args = parser.parse_args()
    bench = Bench()
    try:
        for size_mb in (float(s) for s in args.sizes_mb.split(",")):
            rows = max(1, int(size_mb * (1 << 20) / (DIM * 4)))
            tensor = torch.randn(rows, DIM)
            count = max(20, int(args.count / max(1.0, size_mb / 4)))
            for ours, target in PAIRS.values():  # warm up: connections, allocator, page cache
                bench.stream(ours, target, tensor, min(count, 20))
            gbps = {name: [] for name in PAIRS}
            cpu_us = {name: [] for name in PAIRS}
            ms = {name: [] for name in PAIRS}
            for _ in range(args.repeats):
                for name, (ours, target) in PAIRS.items():
                    throughput, cpu = bench.stream(ours, target, tensor, count)
                    gbps[name].append(throughput)
                    cpu_us[name].append(cpu)
                    ms[name].append(bench.latency(ours, target, tensor, args.rounds))
            print(f"{size_mb:g} MiB x {count} messages, {args.repeats} repeats, median [min-max]:")
            for name in PAIRS:
                ratios = [value / bare for value, bare in zip(gbps[name], gbps["bare"])]
                print(f"  {name:<9} {spread(gbps[name]):>20} GB/s  ratio to bare {spread(ratios):>18}  "
                      f"p50 latency {spread(ms[name]):>20} ms  sending thread {spread(cpu_us[name]):>22} us/msg",
                      flush=True)
    finally:
        bench.close()


if __name__ == "__main__":
    main()
