"""Benchmarks for priorities and adaptive waiting, each against one local server.

`mixed`: interactive traffic on top of an offline flood, on one server, in one run. The capacity is
measured first (closed loop, concurrency 64); then, in alternating rounds of `--round-s` seconds:

- `idle`: the interactive stream alone (Poisson at `--interactive-share` of capacity, one image each);
- `fifo`: the same stream plus a closed-loop offline flood (concurrency `--offline-concurrency`), all
  at priority 0: today's first in, first out;
- `priority`: the same, the interactive requests at priority 1.

Each reports the interactive p50/p99 and errors, and the offline and total throughput. With
`--cache off,on` the whole comparison runs twice in one invocation, on a server with the embedding
cache off and one with its default size; every request then carries an image of its own (the same
pixels, distinct bytes), so the cache shares nothing and the run measures the scheduling of cache
misses, not cache hits.

`wait`: `--max-wait-ms auto` against a sweep of fixed waits on the standard closed-loop points
(concurrency 1, 16, 64), one server per setting, started one after another in one run.

    python benchmarks/mixed.py mixed --round-s 15 --rounds 2
    python benchmarks/mixed.py mixed --round-s 12 --rounds 2 --cache off,on
    python benchmarks/mixed.py wait --waits 0,2,5,10,auto

It prints a line per round or point as it goes, then the table docs/BENCHMARKS.md shows (Markdown);
`--json` prints the results as JSON instead, and `--out` writes them as JSON too.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/mixed.py` from anywhere

from benchmarks.mixed_tables import mixed_table, wait_table  # noqa: E402
from encode_server.bench.launcher import ServerProcess  # noqa: E402
from encode_server.bench.load import _Client, _session, _warm, closed_loop, make_payloads  # noqa: E402
from encode_server.bench.workloads import png_with_nonce  # noqa: E402


class DistinctPayloads:
    """The payloads, each request's with bytes of its own (a nonce chunk in the PNG, the same pixels): a
    sequence whose every read is a new item, so a server's cache never shares one between requests."""

    def __init__(self, payloads: list[str]) -> None:
        self._pngs = [base64.b64decode(payload) for payload in payloads]
        self._nonces = itertools.count()

    def __len__(self) -> int:
        return 10**12

    def __getitem__(self, index: int) -> str:
        png = self._pngs[index % len(self._pngs)]
        return base64.b64encode(png_with_nonce(png, f"request-{next(self._nonces)}")).decode()

    def requests(self, count: int) -> list[str]:
        """`count` distinct payloads made now (what `closed_loop` takes from a workload)."""
        return [self[index] for index in range(count)]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values) or [0.0]
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _interactive(url: str, rate: float, seconds: float, payloads: list[str], priority: int | None,
                       tag: str, seed: int) -> _Client:
    """A Poisson stream at `rate` for `seconds`; returns the client holding its latencies."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=int(rate * seconds * 2) + 10)
    async with _session(512) as session:
        client = _Client(session, url, "image", payloads, priority=priority)
        tasks, started = [], time.perf_counter()
        next_at = started
        for index, gap in enumerate(gaps):
            next_at += gap
            if next_at - started > seconds:
                break
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(client.one(index, tag)))
        await asyncio.gather(*tasks)
    return client


async def _flood(url: str, concurrency: int, payloads: list[str], stop: asyncio.Event, tag: str) -> tuple[int, int]:
    """Closed-loop offline clients at priority 0 until `stop`; (answered, errors) counted before the stop."""
    async with _session(concurrency + 8) as session:
        client = _Client(session, url, "image", payloads, priority=0)
        counter = iter(range(10**9))
        counted = [0, 0]

        async def worker() -> None:
            for index in counter:
                if stop.is_set():
                    return
                before = client.errors
                await client.one(index, tag)
                if not stop.is_set():
                    counted[0] += 1
                    counted[1] += client.errors - before

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return counted[0], counted[1]


async def _round(url: str, arm: str, rate: float, seconds: float, concurrency: int, payloads: list[str],
                 seed: int) -> dict:
    stop = asyncio.Event()
    flood = None
    if arm != "idle":
        flood = asyncio.ensure_future(_flood(url, concurrency, payloads, stop, f"offline-{arm}-{seed}"))
        await asyncio.sleep(2.0)  # let the flood fill the queue before measuring
    started = time.perf_counter()
    client = await _interactive(url, rate, seconds, payloads, 1 if arm == "priority" else None,
                                f"interactive-{arm}-{seed}", seed)
    wall = time.perf_counter() - started
    offline, offline_errors = 0, 0
    if flood is not None:
        # Count offline answers over the same window as the interactive stream.
        stop.set()
        offline, offline_errors = await flood
        flood_wall = time.perf_counter() - started + 2.0
    interactive_ok = len(client.latencies) - client.errors
    return {
        "arm": arm, "seconds": round(wall, 2),
        "interactive_requests": len(client.latencies), "interactive_errors": client.errors,
        "interactive_p50_ms": round(_percentile(client.latencies, 0.5), 1),
        "interactive_p99_ms": round(_percentile(client.latencies, 0.99), 1),
        "offline_rps": round(offline / flood_wall, 1) if flood is not None else 0.0,
        "offline_errors": offline_errors,
        "total_rps": round((offline + interactive_ok) / (flood_wall if flood is not None else wall), 1),
    }


async def run_mixed(args) -> dict:
    """One comparison per `--cache` setting, in one invocation: {setting: result}."""
    return {cache: await run_mixed_once(args, cache) for cache in args.cache}


async def run_mixed_once(args, cache: str) -> dict:
    payloads = make_payloads("image", 64, args.image_size)
    if cache == "on":
        payloads = DistinctPayloads(payloads)
    with ServerProcess("--model", args.model, "--cache-bytes", "auto" if cache == "on" else "0",
                       "--max-batch-size", str(args.max_batch_size)) as server:
        async with _session(72) as session:
            await _warm(_Client(session, server.url, "image", payloads), "warm")
        capacity = await closed_loop(server.url, "capacity", 64, 600, "image", payloads)
        rate = args.interactive_share * capacity.throughput_rps
        print(f"capacity {capacity.throughput_rps:.1f} req/s; interactive at {rate:.1f} req/s", flush=True)
        rounds = []
        for round_index in range(args.rounds):
            for arm in ("idle", "fifo", "priority"):
                result = await _round(server.url, arm, rate, args.round_s, args.offline_concurrency, payloads,
                                      seed=round_index)
                print(f"cache {cache}, round {round_index + 1}, {arm}: interactive p50 "
                      f"{result['interactive_p50_ms']} ms, p99 {result['interactive_p99_ms']} ms, "
                      f"{result['interactive_errors']} errors; offline {result['offline_rps']} req/s, total "
                      f"{result['total_rps']} req/s", flush=True)
                rounds.append(result)
    summary = {}
    for arm in ("idle", "fifo", "priority"):
        mine = [r for r in rounds if r["arm"] == arm]
        summary[arm] = {key: round(statistics.median(r[key] for r in mine), 1)
                        for key in ("interactive_p50_ms", "interactive_p99_ms", "offline_rps", "total_rps")}
        summary[arm]["interactive_errors"] = sum(r["interactive_errors"] for r in mine)
        summary[arm]["interactive_requests"] = sum(r["interactive_requests"] for r in mine)
    return {"capacity_rps": round(capacity.throughput_rps, 1), "interactive_rps": round(rate, 1),
            "rounds": rounds, "median": summary}


async def run_wait(args) -> dict:
    payloads = make_payloads("image", 64, args.image_size)
    results = []
    for wait in args.waits:
        with ServerProcess("--model", args.model, "--cache-bytes", "0", "--max-batch-size", str(args.max_batch_size),
                           "--max-wait-ms", wait) as server:
            async with _session(72) as session:
                warm = _Client(session, server.url, "image", payloads)
                for _ in range(4):  # a few varied batch sizes so `auto` has a curve to start from
                    await _warm(warm, "warm")
            for concurrency in args.concurrency:
                point = await closed_loop(server.url, f"wait={wait}", concurrency, args.requests, "image", payloads)
                row = {"max_wait_ms": wait, "concurrency": concurrency,
                       "throughput_rps": round(point.throughput_rps, 1), "p50_ms": round(point.p50_ms, 1),
                       "p99_ms": round(point.p99_ms, 1), "mean_batch": round(point.mean_batch_size, 1),
                       "errors": point.errors}
                print(f"--max-wait-ms {wait}, c={concurrency}: {row['throughput_rps']} req/s, p50 {row['p50_ms']} ms, "
                      f"p99 {row['p99_ms']} ms, mean batch {row['mean_batch']}, {row['errors']} errors", flush=True)
                results.append(row)
            if wait == "auto":  # what it learned, as /v1/performance shows it
                learned = httpx.get(server.url + "/v1/performance", timeout=10).json().get("cost_model")
                print(f"--max-wait-ms auto learned: {json.dumps(learned)}", flush=True)
                results.append({"max_wait_ms": wait, "cost_model": learned})
    return {"points": results}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=("mixed", "wait"))
    parser.add_argument("--model", default="tiny-qwen2.5-vl")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=56)
    parser.add_argument("--round-s", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--interactive-share", type=float, default=0.2)
    parser.add_argument("--offline-concurrency", type=int, default=256)
    parser.add_argument("--waits", type=lambda text: text.split(","), default=["0", "2", "5", "10", "auto"])
    parser.add_argument("--concurrency", type=lambda text: [int(x) for x in text.split(",")], default=[1, 16, 64])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--cache", type=lambda text: text.split(","), default=["off"],
                        help="mixed: off, on, or off,on (both, one after the other in this run)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    args = parser.parse_args(argv)
    result = asyncio.run(run_mixed(args) if args.which == "mixed" else run_wait(args))
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print()
        print(mixed_table(result) if args.which == "mixed" else wait_table(result["points"]))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
