"""The small-image scenario: the service pinned to one core against its in-process ceiling on that core.

- ceiling: this process on core 0, one torch thread: base64 + PNG decode + the processor + the forward
  for batches of `--batch-size` small images, in a loop (everything the service does per image except
  HTTP, JSON, queueing and the response);
- service: `encode-server` started on core 0 alone (`--cpu-threads 1`, and any `--server-flag`s), the
  load generator on core 1, a closed loop at `--concurrency` with one image per request.

With `--thread-cpu`, each service round also prints the server's CPU per request by thread (from
`/proc/<pid>/task`, the threads' OS-level names; Linux), which says where a request's time goes without a
profiler's own cost: `MainThread` is the HTTP event loop, `encoder-forward` the forward, `encoder-process` the
processor, `encoder-schedul` the scheduler's loop, `media_N` the decode threads.

The two alternate for `--rounds` rounds against one server (a shared machine drifts between minutes, and a
ratio of two figures taken minutes apart would carry the drift); each round's ratio service / ceiling says
what the per-request path costs, and the median and spread of the rounds are printed. Needs two cores.

    python benchmarks/pinned.py --concurrency 64 --requests 3000 --rounds 5   # the machine to itself
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import statistics
import time
from collections.abc import Iterator

import torch
from PIL import Image

from encode_server.bench.machine import describe_machine
from encode_server.media import base64_codec as base64  # the service's decoder: the ceiling does what it does


def load_ceiling_model(model: str):
    from encode_server.models import load_adapter

    return load_adapter(model, "cpu", "float32")


def ceiling(adapter, payloads: list[str], batch_size: int, seconds: float, core: int) -> dict:
    """Images per second through decode, the processor and the forward on `core`, one torch thread."""
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)

    def one_batch(batch: list[str]) -> None:
        items = [Image.open(io.BytesIO(base64.b64decode(payload))).convert("RGB") for payload in batch]
        adapter.forward(adapter.processor.preprocess("image", items))

    try:
        one_batch(payloads[:batch_size])
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            one_batch([payloads[(done + i) % len(payloads)] for i in range(batch_size)])
            done += batch_size
        wall = time.perf_counter() - started
    finally:
        os.sched_setaffinity(0, own)
    return {"mode": "ceiling", "images": done, "images_per_s": done / wall}


@contextlib.contextmanager
def pinned_server(server_core: int | None, client_core: int | None, *flags: str) -> Iterator:
    """`encode-server` with `flags` on `server_core` alone (with `--cpu-threads 1`), this process moved to
    `client_core` meanwhile; both None: no pinning. Yields the started `ServerProcess`."""
    from encode_server.bench.launcher import ServerProcess

    own = os.sched_getaffinity(0)
    if server_core is not None:
        os.sched_setaffinity(0, {server_core})  # the server (and its threads) inherit this
        flags = ("--cpu-threads", "1", *flags)
    try:
        server = ServerProcess(*flags, startup_timeout=300).__enter__()
    finally:
        os.sched_setaffinity(0, own if client_core is None else {client_core})
    try:
        yield server
    finally:
        server.__exit__(None, None, None)
        os.sched_setaffinity(0, own)


def service_run(url: str, payloads: list[str], concurrency: int, requests: int, client_core: int) -> dict:
    from encode_server.bench.load import closed_loop

    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {client_core})
    try:
        result = asyncio.run(closed_loop(url, "pinned", concurrency, requests, "image", payloads))
    finally:
        os.sched_setaffinity(0, own)
    return {**result.as_dict(), "mode": "service"}


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds each thread of process `pid` has used, by its OS-level name (threads of one name summed)."""
    from encode_server.ops.memory import cpu_seconds

    used: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as comm:
                name = "MainThread" if int(tid) == pid else comm.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        spent = cpu_seconds(pid, tid)
        if spent is not None:
            used[name] = used.get(name, 0.0) + spent
    return used


def per_request_ms(before: dict[str, float], after: dict[str, float], requests: int) -> dict[str, float]:
    """Each thread's CPU milliseconds per request between two `thread_cpu_s` readings, busiest first."""
    spent = {name: (after[name] - before.get(name, 0.0)) * 1e3 / max(1, requests) for name in after}
    return dict(sorted(((name, round(ms, 3)) for name, ms in spent.items() if ms > 0), key=lambda kv: -kv[1]))


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main(argv=None) -> None:
    from encode_server.bench.load import make_payloads

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-qwen2.5-vl")
    parser.add_argument("--image-size", type=int, default=56)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each round's ceiling")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=3000, help="requests in each round's service run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--server-flag", action="append", default=[], help="extra server flag (repeatable)")
    parser.add_argument("--thread-cpu", action="store_true",
                        help="print the server's CPU per request by thread in each service round (Linux)")
    args = parser.parse_args(argv)
    print(describe_machine()[1], flush=True)
    payloads = make_payloads("image", 32, args.image_size)
    adapter = load_ceiling_model(args.model)
    ratios, served, tops = [], [], []
    # --cache-bytes 0: the payloads repeat, and the embedding cache would answer all but the first 32.
    with pinned_server(0, None, "--model", args.model, "--max-batch-size", "32", "--cache-bytes", "0",
                       *args.server_flag) as server:
        for round_ in range(1, args.rounds + 1):
            before = thread_cpu_s(server.proc.pid) if args.thread_cpu else {}
            run = service_run(server.url, payloads, args.concurrency, args.requests, 1)
            if args.thread_cpu:
                by_thread = per_request_ms(before, thread_cpu_s(server.proc.pid), run["requests"])
                print(json.dumps({"round": round_, "server_cpu_ms_per_request": round(sum(by_thread.values()), 3),
                                  "by_thread": by_thread}), flush=True)
            top = ceiling(adapter, payloads, args.batch_size, args.seconds, 0)
            print(json.dumps({"round": round_, **run}), flush=True)
            print(json.dumps({"round": round_, **top}), flush=True)
            served.append(run["throughput_rps"])
            tops.append(top["images_per_s"])
            ratios.append(served[-1] / tops[-1])
            print(f"round {round_}: pinned service / in-process ceiling: {served[-1]:.0f} / {tops[-1]:.0f} = "
                  f"{ratios[-1]:.2f}", flush=True)
    print(f"pinned service / in-process ceiling over {args.rounds} rounds: service {statistics.median(served):.0f} "
          f"req/s [{min(served):.0f}-{max(served):.0f}], ceiling {statistics.median(tops):.0f} img/s "
          f"[{min(tops):.0f}-{max(tops):.0f}], ratio {spread(ratios)}", flush=True)


if __name__ == "__main__":
    main()
