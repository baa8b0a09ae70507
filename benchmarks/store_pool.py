"""A pool of encoders with per-pod caches against the same pool sharing one cache through Mooncake Store,
side by side in one run, on loopback (docs/BENCHMARKS.md, "A pool-wide cache: Mooncake Store").

1. per-pod: PODS servers with their own embedding cache only;
2. shared: a mooncake_master, a mooncake_client lending the pool 256 MB, and PODS servers with
   `--cache-store` (lending none themselves);

each gets the same chat-like requests (`encode_server.bench.workloads.ChatWorkload`: Zipf-popular
conversations whose turns re-send the earlier turns' images, 1 to 4 images a request), sent round-robin
over the pods with CONCURRENCY in flight. Reported per configuration: items, the share not encoded (the
pool-wide hit rate; in the shared pool split into local and Store hits), the forwards, requests per second.
Then, on the shared pool, the latency of one-image requests answered by an encode, a local hit and a Store
hit (medians over SAMPLES fresh images), and the Store's own read time (its histogram's mean).

    python benchmarks/store_pool.py --pods 3 --requests 600 --concurrency 8 [--json out.json]

Needs the mooncake extra (pip install 'encode-server[mooncake]'). Everything runs on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from encode_server.bench.launcher import ServerProcess, free_port  # noqa: E402
from encode_server.bench.workloads import ChatWorkload, _ImagePool  # noqa: E402


def metric(url: str, name: str) -> float:
    """The sum of a metric's samples named exactly `name` on one server."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            if head.partition("{")[0] == name:
                total += float(value)
    return total


class Mooncake:
    """mooncake_master and a mooncake_client lending `memory` to the pool, on loopback."""

    def __init__(self, memory: str = "256MB") -> None:
        import mooncake

        self.bin = Path(mooncake.__file__).parent
        self.port, self.memory = free_port(), memory
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> Mooncake:
        env = {**os.environ, "GLOG_minloglevel": "2"}
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env}
        self.processes.append(subprocess.Popen(
            [str(self.bin / "mooncake_master"), f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
             f"--metrics_port={free_port()}", "--metrics_host=127.0.0.1", "--enable_metric_reporting=false"], **quiet))
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("mooncake_master did not listen") from None
                time.sleep(0.05)
        self.processes.append(subprocess.Popen(
            [str(self.bin / "mooncake_client"), f"--master_server_address=127.0.0.1:{self.port}",
             "--metadata_server=P2PHANDSHAKE", f"--global_segment_size={self.memory}", "--protocol=tcp",
             "--host=127.0.0.1", f"--port={free_port()}"], **quiet))
        time.sleep(1.0)
        return self

    def __exit__(self, *exc) -> None:
        for process in reversed(self.processes):
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


def warm_up(urls: list[str]) -> None:
    """A few one-image requests per pod (images of their own), so that neither configuration pays first-call
    costs inside the measurement."""
    pool = _ImagePool(56, "warm-up")
    with httpx.Client(timeout=120) as client:
        for index, url in enumerate(urls):
            for number in range(3):
                client.post(url + "/encode", json={"req_id": "w", "modality": "image",
                                                   "mm_items": [pool.image(index * 3 + number)]}).raise_for_status()


async def run(urls: list[str], requests: list[list[str]], concurrency: int) -> dict:
    """Send every request (request i to pod i mod len(urls)); count items by how they were served."""
    warm_up(urls)
    forwards_before = sum(metric(url, "encoder_batch_tokens_count") for url in urls)
    counts = {"items": 0, "encoded": 0, "local": 0, "store": 0}
    queue = list(enumerate(requests))
    semaphore = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, index: int, items: list[str]) -> None:
        async with semaphore:
            response = await client.post(urls[index % len(urls)] + "/encode", json={
                "req_id": f"r{index}", "modality": "image", "mm_items": items})
            response.raise_for_status()
            for item in response.json()["items"]:
                counts["items"] += 1
                counts[item.get("cache_tier") or "encoded"] += 1

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency * 2)) as client:
        await asyncio.gather(*(one(client, index, items) for index, items in queue))
    counts["seconds"] = time.perf_counter() - started
    counts["requests_per_s"] = len(requests) / counts["seconds"]
    counts["hit_rate"] = 1 - counts["encoded"] / counts["items"]
    counts["forwards"] = sum(metric(url, "encoder_batch_tokens_count") for url in urls) - forwards_before
    for name in ("read_timeouts", "reads_skipped", "publish_drops", "corrupt"):
        counts[f"store_{name}"] = sum(metric(url, f"encoder_cache_store_{name}_total") for url in urls)
    return counts


def start_pods(stack: ExitStack, pods: int, *args: str) -> list[str]:
    servers = [ServerProcess("--cache-bytes", "64MiB", "--health-probe-interval-s", "3600", *args,
                             env={"GLOG_minloglevel": "2"}, startup_timeout=300) for _ in range(pods)]
    return [stack.enter_context(server).url for server in servers]


def latencies(urls: list[str], samples: int) -> dict:
    """One-image requests: an encode on pod 0, the same image on pod 0 (local hit), on pod 1 (Store hit)."""
    pool = _ImagePool(56, "latency")
    times: dict[str, list[float]] = {"encoded": [], "local": [], "store": []}
    published = metric(urls[0], "encoder_cache_store_published_total")
    with httpx.Client(timeout=60) as client:
        for number in range(samples):
            image = pool.image(number)
            for url, expected in ((urls[0], "encoded"), (urls[0], "local"), (urls[1], "store")):
                if expected == "store":
                    deadline = time.monotonic() + 5  # wait until pod 0 has published it
                    while metric(urls[0], "encoder_cache_store_published_total") < published + number + 1:
                        assert time.monotonic() < deadline, "the item was not published"
                        time.sleep(0.01)
                started = time.perf_counter()
                body = client.post(url + "/encode", json={"req_id": f"l{number}", "modality": "image",
                                                           "mm_items": [image]}).json()
                elapsed = time.perf_counter() - started
                got = body["items"][0].get("cache_tier") or "encoded"
                assert got == expected, (got, expected)
                times[expected].append(elapsed * 1e3)
    read_sum = sum(metric(url, "encoder_cache_store_read_seconds_sum") for url in urls)
    read_count = sum(metric(url, "encoder_cache_store_read_seconds_count") for url in urls)
    return {**{f"{kind}_request_ms_median": statistics.median(values) for kind, values in times.items()},
            "store_read_ms_mean": read_sum / read_count * 1e3 if read_count else None, "samples": samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=3)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=128)
    parser.add_argument("--samples", type=int, default=20, help="images for the latency comparison")
    parser.add_argument("--model", default="tiny-qwen2.5-vl")
    parser.add_argument("--json", type=Path, help="also write the results here")
    options = parser.parse_args()
    requests = ChatWorkload(conversations=options.conversations, seed=0).requests(options.requests)
    model = ("--model", options.model)
    results: dict = {"pods": options.pods, "requests": options.requests, "concurrency": options.concurrency,
                     "conversations": options.conversations, "model": options.model}
    with ExitStack() as stack:
        urls = start_pods(stack, options.pods, *model)
        results["per_pod"] = asyncio.run(run(urls, requests, options.concurrency))
    with ExitStack() as stack:
        store = stack.enter_context(Mooncake())
        urls = start_pods(stack, options.pods, *model, "--cache-store", f"mooncake://127.0.0.1:{store.port}",
                          "--cache-store-global-segment-size", "0", "--cache-store-local-buffer-size", "16MiB")
        results["shared"] = asyncio.run(run(urls, requests, options.concurrency))
        results["latency"] = latencies(urls, options.samples)
    print(json.dumps(results, indent=2))
    if options.json:
        options.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
