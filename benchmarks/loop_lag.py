"""Event-loop lag of the server while it answers a burst of concurrent requests.

Starts `encode-server` on a free loopback port (`--max-pending` above the burst, so every request is
admitted), sends `--requests` /encode requests at once (56-140 px images, a third with
`return_embedding`), and reads `encoder_event_loop_tick_lag_seconds` (a histogram of every 100 ms
loop timer) from /metrics before and after: the difference is the burst's own lag distribution,
with the CPU each loop's thread used (`encoder_event_loop_cpu_seconds_total`; `busy` is that over the
burst's duration: near 1, the loop had more work than it could do).
The first burst opens one connection per request; later `--rounds` reuse them, as a router's pool
would. Also prints the request latencies and statuses. Loopback only; the request count is bounded.

`--floor` also runs an idle event loop in a process of its own during the bursts, with the same
100 ms timer: how late this machine itself runs a timer while the server and the load use its cores.

    python benchmarks/loop_lag.py --requests 2000 --floor
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.rss_soak import mix_images  # noqa: E402
from encode_server.bench.launcher import ServerProcess  # noqa: E402

HISTOGRAM = "encoder_event_loop_tick_lag_seconds"
LOOP_CPU = "encoder_event_loop_cpu_seconds_total"

#: The `--floor` process: an idle loop timing a 100 ms timer until its stdin closes, then one JSON line.
FLOOR = """
import asyncio, json, sys
async def main():
    loop = asyncio.get_running_loop()
    done, lags = asyncio.Event(), []
    loop.add_reader(sys.stdin.fileno(), done.set)
    while not done.is_set():
        expected = loop.time() + 0.1
        await asyncio.sleep(0.1)
        lags.append(max(0.0, loop.time() - expected))
    lags.sort()
    at = lambda q: round(lags[min(len(lags) - 1, int(q * len(lags)))] * 1e3, 2)
    print(json.dumps({"ticks": len(lags), "lag_p50_ms": at(0.5), "lag_p99_ms": at(0.99), "worst_ms": at(1.0)}))
asyncio.run(main())
"""


async def lag_buckets(session: aiohttp.ClientSession, url: str) -> dict[str, dict]:
    """Cumulative bucket counts of the lag histogram, by loop ("http", "scheduler") and upper bound; and
    under "batches", the count and sum of `encoder_batch_size` (forwards, and requests fused in them); under
    "cpu", each loop's thread's CPU seconds."""
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    loops: dict[str, dict[float, float]] = {}
    for line in text.splitlines():
        for name in ("encoder_batch_size_count", "encoder_batch_size_sum"):  # fused forwards, requests in them
            if line.startswith(name + "{"):
                loops.setdefault("batches", {}).setdefault(name.rsplit("_", 1)[1], 0.0)
                loops["batches"][name.rsplit("_", 1)[1]] += float(line.rsplit(" ", 1)[1])
        if line.startswith(HISTOGRAM + "_bucket{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            loop = line.split('loop="', 1)[1].split('"', 1)[0] if 'loop="' in line else "event"
            loops.setdefault(loop, {})[math.inf if bound == "+Inf" else float(bound)] = float(line.rsplit(" ", 1)[1])
        if line.startswith(LOOP_CPU + "{"):
            loop = line.split('loop="', 1)[1].split('"', 1)[0]
            loops.setdefault("cpu", {})[loop] = float(line.rsplit(" ", 1)[1])
    if not loops:
        raise SystemExit(f"the server exports no {HISTOGRAM}")
    return loops


def quantile_bound(before: dict[float, float], after: dict[float, float], q: float) -> tuple[float, int]:
    """The smallest bucket bound holding fraction `q` of the ticks observed between the two reads."""
    deltas = {bound: after[bound] - before.get(bound, 0.0) for bound in sorted(after)}
    total = deltas[math.inf]
    for bound, count in deltas.items():
        if total and count >= q * total:
            return bound, int(total)
    return math.inf, int(total)


async def burst(url: str, count: int, images: list[str], rounds: int = 1,
                profile: list[str] | None = None) -> list[dict]:
    """`rounds` bursts on one client session: the first opens `count` connections, later ones reuse them
    (as a router's pool does), so the two show what connection set-up costs the loop."""
    connector = aiohttp.TCPConnector(limit=count + 10)
    results = []
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session, \
            aiohttp.ClientSession() as probe:
        for round_index in range(rounds):
            before = await lag_buckets(probe, url)
            profiler = subprocess.Popen(profile) if profile and round_index == 0 else None
            started = time.monotonic()
            latencies: list[float] = []
            statuses: dict[str, int] = {}

            async def one(index: int, round_index: int = round_index, latencies: list[float] = latencies,
                          statuses: dict[str, int] = statuses) -> None:
                sent = time.monotonic()
                try:
                    async with session.post(url + "/encode", json={
                            "req_id": f"lag-{round_index}-{index}", "modality": "image",
                            "mm_items": [images[index % len(images)]], "return_embedding": index % 3 == 0}) as response:
                        await response.read()
                        status = str(response.status)
                except aiohttp.ClientError as exc:
                    status = type(exc).__name__
                latencies.append(time.monotonic() - sent)
                statuses[status] = statuses.get(status, 0) + 1

            await asyncio.gather(*(one(index) for index in range(count)))
            elapsed = time.monotonic() - started
            if profiler is not None:
                profiler.wait(60)
            after = await lag_buckets(probe, url)
            results.append(summarise(round_index, count, statuses, elapsed, sorted(latencies), before, after))
            await asyncio.sleep(1.0)
    return results


def summarise(round_index: int, count: int, statuses: dict[str, int], elapsed: float, latencies: list[float],
              before: dict[str, dict[float, float]], after: dict[str, dict[float, float]]) -> dict:
    summary = {
        "round": round_index, "connections": "new" if round_index == 0 else "reused",
        "requests": count, "statuses": statuses, "burst_s": round(elapsed, 2),
        "latency_p50_s": round(latencies[len(latencies) // 2], 3),
        "latency_p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3),
    }
    batches = {key: after["batches"][key] - before["batches"][key] for key in ("count", "sum")}
    summary["forwards"] = int(batches["count"])
    summary["mean_batch_size"] = round(batches["sum"] / max(1.0, batches["count"]), 2)
    for loop, loop_after in sorted(after.items()):
        if loop not in ("batches", "cpu"):
            summary[loop + "_loop"] = loop_summary(before.get(loop, {}), loop_after)
            if loop in after.get("cpu", {}):
                cpu = after["cpu"][loop] - before.get("cpu", {}).get(loop, 0.0)
                summary[loop + "_loop"].update(cpu_s=round(cpu, 2), busy=round(cpu / elapsed, 2))
    return summary


def loop_summary(before: dict[float, float], after: dict[float, float]) -> dict:
    """One loop's ticks during the burst: how many, the bucket bounds holding half and 99% of them, the worst."""
    p50, ticks = quantile_bound(before, after, 0.50)
    p99, _ = quantile_bound(before, after, 0.99)
    per_bucket, below = {}, 0.0
    for bound in sorted(after):
        cumulative = after[bound] - before.get(bound, 0.0)
        if cumulative > below:
            per_bucket[f"le {bound:g}"] = int(cumulative - below)
        below = cumulative
    return {"ticks": ticks, "lag_p50_at_most_s": p50, "lag_p99_at_most_s": p99,
            "worst_bucket_s": highest_bucket(before, after), "ticks_by_bucket": per_bucket}


def highest_bucket(before: dict[float, float], after: dict[float, float]) -> float:
    """The upper bound of the highest bucket that got a tick between the two reads."""
    worst, below = 0.0, 0.0
    for bound in sorted(after):
        cumulative = after[bound] - before.get(bound, 0.0)
        if cumulative > below:
            worst = bound
        below = cumulative
    return worst


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2, help="bursts: the first on new connections, then reused")
    parser.add_argument("--server-args", default="", help="extra encode-server flags, space separated")
    parser.add_argument("--py-spy", metavar="PATH", help="record the server with this py-spy during the burst")
    parser.add_argument("--py-spy-out", default="loop-lag-profile.txt",
                        help="where py-spy writes its collapsed stacks (one line per stack, per thread)")
    parser.add_argument("--py-spy-seconds", type=int, default=8)
    parser.add_argument("--py-spy-args", default="", help="more py-spy record flags, e.g. '--gil' or '--idle'")
    parser.add_argument("--floor", action="store_true",
                        help="also time an idle event loop in a process of its own during the bursts")
    parser.add_argument("--server-module", default="encode_server",
                        help="run this module instead of encode_server (a variant of the server to compare)")
    args = parser.parse_args(argv)
    server_args = ["--max-pending", str(args.requests + 100), *args.server_args.split()]
    with ServerProcess(*server_args, module=args.server_module) as server:
        profile = None
        if args.py_spy:
            extra = args.py_spy_args.split()
            if "--native" not in extra:  # native stacks need the process paused while sampled
                extra.append("--nonblocking")
            profile = [args.py_spy, "record", "--pid", str(server.proc.pid), "--duration", str(args.py_spy_seconds),
                       "--rate", "200", "--threads", "--format", "raw", "--output", args.py_spy_out, *extra]
        floor = subprocess.Popen([sys.executable, "-c", FLOOR], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True) if args.floor else None
        results: list[dict] = []
        try:
            results = asyncio.run(burst(server.url, args.requests, mix_images(), args.rounds, profile))
        finally:
            if floor is not None:
                out, _ = floor.communicate(timeout=10)  # closing its stdin ends it
                results.append({"floor_idle_loop_in_own_process": json.loads(out)})
    for result in results:
        print(json.dumps(result), flush=True)
    return results


if __name__ == "__main__":
    main()
