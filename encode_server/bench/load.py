"""Load generators for `/encode`: closed loop (fixed concurrency) and open loop (Poisson arrivals).

Both send to one base URL (loopback in every use here), a bounded number of requests, and return
throughput and latency percentiles. What each request carries comes from a workload
(`workloads.py`): its item lists are made before the clock starts.
"""

from __future__ import annotations

import asyncio
import base64
import io
import time
from dataclasses import asdict, dataclass

import aiohttp
import numpy as np
from PIL import Image


def make_payloads(modality: str, count: int, image_size: int = 56, audio_seconds: float = 1.0) -> list[str]:
    """`count` distinct base64 items: PNG images of `image_size` pixels square, or 16 kHz WAV clips."""
    rng = np.random.default_rng(0)
    items = []
    for _ in range(count):
        buffer = io.BytesIO()
        if modality == "audio":
            import soundfile

            wave = (rng.standard_normal(int(16000 * audio_seconds)) * 0.1).astype(np.float32)
            soundfile.write(buffer, wave, 16000, format="WAV")
        else:
            Image.fromarray(rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8)).save(buffer, "PNG")
        items.append(base64.b64encode(buffer.getvalue()).decode())
    return items


@dataclass
class LoadResult:
    """One point of a sweep."""

    config: str
    mode: str  # "closed" or "open"
    load: float  # concurrency (closed) or offered requests/s (open)
    requests: int
    errors: int
    throughput_rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_batch_size: float
    items: int = 0  # media items in the answered requests
    cached_items: int = 0  # of those, the ones the response marked "cached": true

    def as_dict(self) -> dict:
        return asdict(self)


def _summary(config: str, mode: str, load: float, client: _Client, wall_s: float) -> LoadResult:
    latencies, batch_sizes, errors = client.latencies, client.batch_sizes, client.errors
    ordered = sorted(latencies) or [0.0]

    def pick(q: float) -> float:
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return LoadResult(config=config, mode=mode, load=load, requests=len(latencies), errors=errors,
                      throughput_rps=(len(latencies) - errors) / wall_s if wall_s > 0 else 0.0,
                      p50_ms=pick(0.5), p90_ms=pick(0.9), p99_ms=pick(0.99),
                      mean_batch_size=float(np.mean(batch_sizes)) if batch_sizes else 0.0,
                      items=client.items, cached_items=client.cached_items)


class _Client:
    """Sends one request and records its latency, the batch it rode in and its items' cache flags."""

    def __init__(self, session: aiohttp.ClientSession, url: str, modality: str, requests: list[list[str]],
                 progress=None) -> None:
        self.session, self.url, self.modality, self.requests = session, url, modality, requests
        self.latencies: list[float] = []
        self.batch_sizes: list[int] = []
        self.errors = 0
        self.items = 0
        self.cached_items = 0
        self.progress = progress

    async def one(self, index: int, tag: str) -> None:
        body = {"req_id": f"{tag}-{index}", "modality": self.modality, "mm_items": self.requests[index]}
        started = time.perf_counter()
        try:
            async with self.session.post(self.url + "/encode", json=body) as response:
                payload = await response.json(content_type=None)
                ok = response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ok, payload = False, {}
        self.latencies.append(time.perf_counter() - started)
        if ok:
            self.batch_sizes.append(int(payload.get("batch_size", 1)))
            items = payload.get("items") or []
            self.items += len(items)
            self.cached_items += sum(1 for item in items if item.get("cached"))
        else:
            self.errors += 1
        if self.progress is not None:
            self.progress.update(1)


def _session(limit: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit),
                                 timeout=aiohttp.ClientTimeout(total=300))


async def _warm(session: aiohttp.ClientSession, url: str, modality: str, workload, tag: str) -> None:
    warm = _Client(session, url, modality, workload.requests(8))
    await asyncio.gather(*(warm.one(i, f"warm-{tag}") for i in range(8)))


async def closed_loop(url: str, config: str, concurrency: int, total: int, modality: str, workload,
                      progress=None, on_start=None) -> LoadResult:
    """`concurrency` clients, each sending its next request as soon as the last is answered.
    `on_start()` runs after the warm-up, just before the clock starts."""
    async with _session(concurrency + 8) as session:
        await _warm(session, url, modality, workload, f"{config}-{concurrency}")
        client = _Client(session, url, modality, workload.requests(total), progress)
        counter = iter(range(total))
        tag = f"{config}-c{concurrency}"
        if on_start is not None:
            on_start()

        async def worker() -> None:
            for index in counter:
                await client.one(index, tag)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return _summary(config, "closed", concurrency, client, wall)


async def open_loop(url: str, config: str, rate: float, total: int, modality: str, workload,
                    progress=None, on_start=None, seed: int = 0) -> LoadResult:
    """Poisson arrivals at `rate` requests/s, whatever the server's answers (the load does not wait)."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=total)
    async with _session(1024) as session:
        await _warm(session, url, modality, workload, f"{config}-{rate}")
        client = _Client(session, url, modality, workload.requests(total), progress)
        tag = f"{config}-r{rate:g}"
        if on_start is not None:
            on_start()
        tasks = []
        started = time.perf_counter()
        next_at = started
        for index, gap in enumerate(gaps):
            next_at += gap
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(client.one(index, tag)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - started
    return _summary(config, "open", rate, client, wall)
