"""What a router's `GET /v1/load` costs the server, in CPU seconds per call (docs/OPERATIONS.md, "Autoscaling").

The service as the server runs it (the tiny built-in model, its scheduler on a thread of its own), in this
process; each figure is the process's CPU time (every thread: the caller's loop and the scheduler's) over N
calls, divided by N, after a warm-up:

- `load_report`: `EncoderService.load_report()` and its JSON body, the part any front (HTTP, gRPC) pays;
- `server_cpu_v1_load`: the whole request, HTTP parsing and JSON included, as the CPU time of a real server
  process (`encode-server --model tiny-qwen2.5-vl` on a loopback port, read from /proc) over N keep-alive
  calls (the median of 5 rounds, taking turns with `/health`); `server_cpu_health` the same for `/health` (a
  cached verdict), the floor of any route;
- `queue_load`: the queue's part alone, for a queue DEPTH requests deep (the scheduler's loop pays it).

    python benchmarks/load_report_cost.py [--calls 2000] [--depth 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time


async def measure(calls: int, depth: int) -> dict[str, float]:
    import torch

    from encode_server.assembly import build_service
    from encode_server.models.families.qwen2_5_vl import tiny_qwen25_vl
    from encode_server.ops.settings import Settings
    from encode_server.scheduling.cost_model import CostModel
    from encode_server.scheduling.load import queue_load
    from encode_server.scheduling.policy import QueuedView

    adapter = tiny_qwen25_vl(torch.device("cpu"), torch.float32)
    settings = Settings(model="tiny-qwen2.5-vl", device="cpu")
    figures: dict[str, float] = {}

    service = build_service(settings, adapter, scheduler_thread=True)
    await service.start()
    try:
        for _ in range(50):
            json.dumps((await service.load_report()).as_json())
        started = time.process_time()
        for _ in range(calls):
            json.dumps((await service.load_report()).as_json())
        figures["load_report_us"] = (time.process_time() - started) / calls * 1e6
    finally:
        await service.stop()

    figures.update(await over_http(calls))

    costs = CostModel()
    for size in range(1, 17):
        costs.observe_batch("image", size, 64 * size, 0.002 + 0.0005 * size)
    views = [QueuedView(arrival=float(index), tokens=64) for index in range(depth)]
    started = time.process_time()
    for _ in range(calls):
        queue_load({"image": views}, (), float(depth), costs, 32, 2)
    figures[f"queue_load_{depth}_us"] = (time.process_time() - started) / calls * 1e6
    return figures


async def over_http(calls: int, rounds: int = 5) -> dict[str, float]:
    """A real server process on a loopback port; its own CPU (/proc) over N keep-alive calls per route."""
    import os
    import socket
    import subprocess
    import sys

    import httpx

    from encode_server.ops.memory import cpu_seconds

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "encode_server", "--model", "tiny-qwen2.5-vl", "--device", "cpu",
                               "--port", str(port), "--log-level", "warning"],
                              env={**os.environ, "ENCODER_CACHE_BYTES": "0"})
    url = f"http://127.0.0.1:{port}"
    spent: dict[str, list[float]] = {"/v1/load": [], "/health": []}
    try:
        async with httpx.AsyncClient(base_url=url, timeout=5.0) as client:
            for _ in range(1200):
                try:
                    if (await client.get("/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
            else:
                raise RuntimeError("the server did not become healthy")
            for _ in range(rounds):  # taking turns, so that drift on a shared machine hits both alike
                for path in ("/v1/load", "/health"):  # /health: the same machinery, a cached verdict
                    before = cpu_seconds(server.pid)
                    for _ in range(calls):
                        await client.get(path)
                    spent[path].append((cpu_seconds(server.pid) - before) / calls * 1e6)
    finally:
        server.terminate()
        server.wait(30)
    return {f"server_cpu_{path.strip('/').replace('/', '_')}_us": statistics.median(values)
            for path, values in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls timed per figure")
    parser.add_argument("--depth", type=int, default=1000, help="queued requests for the queue_load figure")
    args = parser.parse_args()
    figures = asyncio.run(measure(args.calls, args.depth))
    print(json.dumps({key: round(value, 1) for key, value in figures.items()}))


if __name__ == "__main__":
    main()
