"""Closed-loop load generator for `/encode`: throughput and latency percentiles per concurrency.

Starts its own servers on loopback (batching on and off, side by side in one run) unless `--url`
points at a running one. Traffic goes to loopback only, bounded by `--requests` per point.

    python scripts/bench.py --concurrency 1,16,64 --requests 400 --image-size 56 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers import ServerProcess  # noqa: E402


def make_images(count: int, size: int) -> list[str]:
    rng = np.random.default_rng(0)
    images = []
    for _ in range(count):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buffer, "PNG")
        images.append(base64.b64encode(buffer.getvalue()).decode())
    return images


async def closed_loop(url: str, concurrency: int, total: int, images: list[str]) -> dict:
    """`concurrency` clients, each sending its next request when the last one is answered."""
    latencies: list[float] = []
    batch_sizes: list[int] = []
    errors = 0
    counter = iter(range(total))

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        for index in counter:
            body = {"req_id": f"bench-{concurrency}-{index}", "modality": "image",
                    "mm_items": [images[index % len(images)]]}
            started = time.perf_counter()
            async with session.post(url + "/encode", json=body) as response:
                payload = await response.json()
            latencies.append(time.perf_counter() - started)
            if response.status == 200:
                batch_sizes.append(payload["batch_size"])
            else:
                errors += 1

    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        # warm-up: a few requests that do not count
        await asyncio.gather(*(session.post(url + "/encode", json={
            "req_id": f"warm-{i}", "modality": "image", "mm_items": [images[0]]}) for i in range(4)))
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    latencies.sort()
    return {
        "concurrency": concurrency,
        "requests": total,
        "errors": errors,
        "throughput_rps": total / wall,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "mean_batch_size": statistics.fmean(batch_sizes) if batch_sizes else 0.0,
    }


def run_sweep(url: str, label: str, concurrencies: list[int], requests: int, images: list[str]) -> list[dict]:
    results = []
    for concurrency in concurrencies:
        total = max(requests, concurrency * 4)
        result = asyncio.run(closed_loop(url, concurrency, total, images))
        result["config"] = label
        results.append(result)
        print(f"{label:14s} c={concurrency:<3d} {result['throughput_rps']:8.1f} req/s  "
              f"p50 {result['p50_ms']:7.1f} ms  p99 {result['p99_ms']:7.1f} ms  "
              f"batch {result['mean_batch_size']:5.1f}  errors {result['errors']}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server; default: start batching-on and -off servers here")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--requests", type=int, default=400, help="requests per concurrency point")
    parser.add_argument("--image-size", type=int, default=56)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("server_args", nargs="*", help="extra encode-server flags (after --)")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    images = make_images(32, args.image_size)
    results: list[dict] = []
    if args.url:
        results += run_sweep(args.url, "given", concurrencies, args.requests, images)
    else:
        for label, flags in (("batching-on", ["--enable-dynamic-batching", "true"]),
                             ("batching-off", ["--enable-dynamic-batching", "false"])):
            with ServerProcess(*flags, *args.server_args) as server:
                results += run_sweep(server.url, label, concurrencies, args.requests, images)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
