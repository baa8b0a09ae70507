"""The small-image scenario: the service pinned to one core against its in-process ceiling on that core.

- ceiling: this process on core 0, one torch thread: base64 + PNG decode + the processor + the forward
  for batches of `--batch-size` small images, in a loop (everything the service does per image except
  HTTP, JSON, queueing and the response);
- service: `encode-server` started on core 0 alone (`--cpu-threads 1`, and any `--server-flag`s), the
  load generator on core 1, a closed loop at `--concurrency` with one image per request.

The ratio service / ceiling says what the per-request path costs. Needs two cores.

    python -m encode_server.bench.pinned --concurrency 64 --requests 3000   # with the machine to itself
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import time
from collections.abc import Iterator

import torch
from PIL import Image


def ceiling(model: str, payloads: list[str], batch_size: int, seconds: float, core: int) -> dict:
    from encode_server.models import load_adapter

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    adapter = load_adapter(model, "cpu", "float32")

    def one_batch(batch: list[str]) -> None:
        items = [Image.open(io.BytesIO(base64.b64decode(payload))).convert("RGB") for payload in batch]
        adapter.forward(adapter.preprocess("image", items))

    one_batch(payloads[:batch_size])
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        one_batch([payloads[(done + i) % len(payloads)] for i in range(batch_size)])
        done += batch_size
    wall = time.perf_counter() - started
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


def service(model: str, payloads: list[str], concurrency: int, requests: int, server_core: int, client_core: int,
            flags: list[str]) -> dict:
    from encode_server.bench.load import closed_loop

    # --cache-bytes 0: the payloads repeat, and the embedding cache would answer all but the first 32.
    with pinned_server(server_core, client_core, "--model", model, "--max-batch-size", "32", "--cache-bytes", "0",
                       *flags) as server:
        result = asyncio.run(closed_loop(server.url, "pinned", concurrency, requests, "image", payloads))
    return {**result.as_dict(), "mode": "service"}


def main(argv=None) -> None:
    from encode_server.bench.load import make_payloads

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-qwen2.5-vl")
    parser.add_argument("--image-size", type=int, default=56)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--server-flag", action="append", default=[], help="extra server flag (repeatable)")
    args = parser.parse_args(argv)
    payloads = make_payloads("image", 32, args.image_size)
    served = service(args.model, payloads, args.concurrency, args.requests, 0, 1, args.server_flag)
    print(json.dumps(served), flush=True)
    top = ceiling(args.model, payloads, args.batch_size, args.seconds, 0)
    print(json.dumps(top), flush=True)
    print(f"pinned service / in-process ceiling: {served['throughput_rps']:.0f} / {top['images_per_s']:.0f} = "
          f"{served['throughput_rps'] / top['images_per_s']:.2f}", flush=True)


if __name__ == "__main__":
    main()
