"""Resident memory of the server under a steady mix, and after a burst of large images.

Starts `encode-server` (the built-in model unless `--server-args` says otherwise) on a free loopback
port, then:

1. the mix, for `--duration-s`: `--concurrency` clients in a loop, images of 56-140 px a side,
   every fourth 448x448, a third with `"return_embedding": true`, no destinations;
2. rest until RSS settles (`--rest-s`), then a burst of large images (`--burst-s`, 1024x1024 by
   default), then `--recovery-s` of rest, sampled every 5 s.

RSS comes from /proc/PID/status (VmRSS), sampled every `--sample-s`; the parked-embedding gauges
from /metrics beside it. Under load RSS saws up and down with the batches in flight, so the growth
figure compares peaks: the last minute's against the second minute's (runs of 3 minutes or more).
Loopback only; every request count and time is bounded.

    python benchmarks/rss_soak.py --duration-s 150
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import itertools
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from encode_server.bench.launcher import ServerProcess  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for pid {pid}")


def png_b64(width: int, height: int, seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def mix_images(count: int = 48, seed: int = 0) -> list[str]:
    """Images of 56-140 px a side (every fourth slot is filled with 448x448 by the caller)."""
    rng = random.Random(seed)
    return [png_b64(rng.randint(56, 140), rng.randint(56, 140), seed=index) for index in range(count)]


async def metric_values(session: aiohttp.ClientSession, url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Unlabelled samples of `names` from /metrics (absent ones are left out)."""
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            found[name] = float(value)
    return found


@dataclass
class Load:
    """Clients posting /encode in a loop until told to stop."""

    url: str
    images: list[str]
    large: str
    every_large: int = 4
    done: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    _serial: itertools.count = field(default_factory=itertools.count)

    async def client(self, session: aiohttp.ClientSession, stop_at: float, only_large: bool = False) -> None:
        while time.monotonic() < stop_at:
            serial = next(self._serial)
            large = only_large or serial % self.every_large == self.every_large - 1
            body = {"req_id": f"soak-{serial}", "modality": "image",
                    "mm_items": [self.large if large else self.images[serial % len(self.images)]],
                    "return_embedding": serial % 3 == 0}
            try:
                async with session.post(self.url + "/encode", json=body) as response:
                    await response.read()
                    status = response.status
            except aiohttp.ClientError as exc:
                status = type(exc).__name__
            if status == 200:
                self.done += 1
            else:
                self.failed[str(status)] = self.failed.get(str(status), 0) + 1

    async def run(self, session: aiohttp.ClientSession, concurrency: int, seconds: float,
                  only_large: bool = False) -> None:
        stop_at = time.monotonic() + seconds
        await asyncio.gather(*(self.client(session, stop_at, only_large) for _ in range(concurrency)))


async def sample_while(session, url: str, pid: int, task: asyncio.Future, every_s: float, started: float,
                       phase: str, samples: list[dict]) -> None:
    """Append an RSS sample every `every_s` until `task` ends (and one at its end)."""
    while True:
        try:
            await asyncio.wait_for(asyncio.shield(task), every_s)
            finished = True
        except asyncio.TimeoutError:
            finished = False
        gauges = await metric_values(session, url, ("encoder_parked_bytes", "encoder_parked_embeddings"))
        sample = {"phase": phase, "t_s": round(time.monotonic() - started, 1), "rss_mib": round(rss_mib(pid), 1),
                  "parked_mib": round(gauges.get("encoder_parked_bytes", 0.0) / (1 << 20), 1),
                  "parked": int(gauges.get("encoder_parked_embeddings", 0))}
        samples.append(sample)
        print(json.dumps(sample), flush=True)
        if finished:
            return


async def soak(url: str, pid: int, args) -> dict:
    load = Load(url, mix_images(), png_b64(448, 448, seed=999))
    burst = Load(url, [], png_b64(args.burst_px, args.burst_px, seed=998), every_large=1)
    samples: list[dict] = []
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    timeout = aiohttp.ClientTimeout(total=120)
    # The samples read /metrics on their own connection, never queued behind the load's.
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session, \
            aiohttp.ClientSession(timeout=timeout) as probe:
        started = time.monotonic()
        at_start = rss_mib(pid)
        print(json.dumps({"phase": "start", "t_s": 0.0, "rss_mib": round(at_start, 1)}), flush=True)
        mix = asyncio.ensure_future(load.run(session, args.concurrency, args.duration_s))
        await sample_while(probe, url, pid, mix, args.sample_s, started, "mix", samples)
        rest = asyncio.ensure_future(asyncio.sleep(args.rest_s))
        await sample_while(probe, url, pid, rest, 5.0, started, "rest", samples)
        before_burst = samples[-1]["rss_mib"]
        big = asyncio.ensure_future(burst.run(session, args.burst_concurrency, args.burst_s, only_large=True))
        await sample_while(probe, url, pid, big, 5.0, started, "burst", samples)
        recovery = asyncio.ensure_future(asyncio.sleep(args.recovery_s))
        await sample_while(probe, url, pid, recovery, 5.0, started, "recovery", samples)
    mix_samples = [s for s in samples if s["phase"] == "mix"]
    # Under load RSS saws up and down with the batches in flight: compare peaks, the second minute's
    # against the last minute's.
    second_minute = [s["rss_mib"] for s in mix_samples if 60.0 <= s["t_s"] < 120.0]
    last_minute = [s["rss_mib"] for s in mix_samples if s["t_s"] >= mix_samples[-1]["t_s"] - 60.0]
    growth = None
    if second_minute and args.duration_s >= 180:
        growth = max(last_minute) / max(second_minute) - 1.0
    burst_peak = max(s["rss_mib"] for s in samples if s["phase"] == "burst")
    burst_end = max(s["t_s"] for s in samples if s["phase"] == "burst")
    back = [s for s in samples if s["phase"] == "recovery" and s["rss_mib"] <= before_burst * 1.10]
    return {
        "rss_at_start_mib": round(at_start, 1),
        "mix_requests": load.done, "mix_failures": load.failed,
        "mix_rss_peak_second_minute_mib": max(second_minute) if second_minute else None,
        "mix_rss_peak_last_minute_mib": max(last_minute),
        "growth_after_first_minute": None if growth is None else round(growth, 4),
        "before_burst_mib": before_burst, "burst_peak_mib": burst_peak,
        "burst_requests": burst.done, "burst_failures": burst.failed,
        "recovered_within_10pct_after_s": round(back[0]["t_s"] - burst_end, 1) if back else None,
        "after_recovery_mib": samples[-1]["rss_mib"],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=150.0, help="how long the steady mix runs")
    parser.add_argument("--sample-s", type=float, default=15.0, help="RSS sampling period during the mix")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rest-s", type=float, default=20.0, help="rest between the mix and the burst")
    parser.add_argument("--burst-s", type=float, default=20.0)
    parser.add_argument("--burst-px", type=int, default=1024, help="side of the burst's square images")
    parser.add_argument("--burst-concurrency", type=int, default=32)
    parser.add_argument("--recovery-s", type=float, default=60.0)
    parser.add_argument("--server-args", default="", help="extra encode-server flags, space separated")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="environment of the server process (e.g. MALLOC_ARENA_MAX=2), repeatable")
    args = parser.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.env)
    with ServerProcess(*args.server_args.split(), env=env) as server:
        summary = asyncio.run(soak(server.url, server.proc.pid, args))
    print(json.dumps({"summary": summary}), flush=True)
    return summary


if __name__ == "__main__":
    main()
