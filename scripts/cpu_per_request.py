"""The server's CPU per request under a closed loop, normalised by its forward time (A/B of code changes).

This VM's speed drifts by a third from one minute to the next, so requests per second of two builds
run one after the other say little. The CPU the server process spends per request, divided by the
forward time per request (`encoder_forward_seconds`, the same work in both builds), cancels most of
that drift: compare `cpu_per_forward` of builds run alternately (A B B A: the second run of a pair is
often slower). Starts `encode-server` on a free loopback port with the tiny built-in model, the cache
off, `--pin` puts the server on core 0 (`--cpu-threads 1`) and the load on core 1; bounded requests.

    python scripts/cpu_per_request.py --concurrency 64 --requests 3000 --pin
    python scripts/cpu_per_request.py --concurrency 1 --requests 600
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from encode_server.bench.load import closed_loop, make_payloads  # noqa: E402
from encode_server.bench.pinned import pinned_server  # noqa: E402


def process_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def forward_s(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("encoder_forward_seconds_sum{"))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--image-size", type=int, default=56)
    parser.add_argument("--pin", action="store_true", help="server on core 0 with one torch thread, load on core 1")
    parser.add_argument("--server-flag", action="append", default=[], help="extra encode-server flag (repeatable)")
    args = parser.parse_args(argv)
    payloads = make_payloads("image", 32, args.image_size)
    flags = ["--model", "tiny-qwen2.5-vl", "--max-batch-size", "32", "--cache-bytes", "0",
             *(part for flag in args.server_flag for part in flag.split())]
    with pinned_server(0 if args.pin else None, 1 if args.pin else None, *flags) as server:
        asyncio.run(closed_loop(server.url, "warmup", args.concurrency, args.warmup, "image", payloads))
        cpu0, forward0, started = process_cpu_s(server.proc.pid), forward_s(server.url), time.perf_counter()
        result = asyncio.run(closed_loop(server.url, "measured", args.concurrency, args.requests, "image",
                                         payloads)).as_dict()
        cpu1, forward1, elapsed = process_cpu_s(server.proc.pid), forward_s(server.url), time.perf_counter() - started
    cpu, forwards = cpu1 - cpu0, forward1 - forward0
    summary = {
        "concurrency": args.concurrency, "requests": args.requests, "errors": result["errors"],
        "throughput_rps": round(result["throughput_rps"], 1), "p50_ms": round(result["p50_ms"], 2),
        "mean_batch_size": round(result["mean_batch_size"], 2),
        "cpu_ms_per_request": round(cpu / args.requests * 1e3, 3),
        "forward_ms_per_request": round(forwards / args.requests * 1e3, 3),
        "cpu_per_forward": round(cpu / forwards, 3), "server_busy": round(cpu / elapsed, 3),
    }
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
