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
import orjson
from PIL import Image

JSON = {"Content-Type": "application/json"}


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
                 progress=None, priority: int | None = None) -> None:
        self.session, self.url, self.modality, self.requests = session, url, modality, requests
        self.priority = priority  # sent as the body's "priority" when set
        self.latencies: list[float] = []
        self.batch_sizes: list[int] = []
        self.errors = 0
        self.items = 0
        self.cached_items = 0
        self.progress = progress

    async def one(self, index: int, tag: str) -> None:
        entry = self.requests[index % len(self.requests)]
        items = [entry] if isinstance(entry, str) else entry  # a plain payload list: one item per request
        body = {"req_id": f"{tag}-{index}", "modality": self.modality, "mm_items": items}
        if self.priority is not None:
            body["priority"] = self.priority
        started = time.perf_counter()
        try:
            # orjson both ways: the load generator shares the machine, and the stdlib's json costs it a millisecond
            # a request for a few 224x224 images
            async with self.session.post(self.url + "/encode", data=orjson.dumps(body), headers=JSON) as response:
                payload = orjson.loads(await response.read())
                ok = response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError):
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


def _session(limit: int, headers: dict[str, str] | None = None) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit), headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=300))


class _Cycle:
    """A plain list of payloads as a workload: one item per request, cycling through them."""

    def __init__(self, payloads: list[str]) -> None:
        self.payloads, self._next = payloads, iter(range(10**12))

    def requests(self, total: int) -> list[list[str]]:
        return [[self.payloads[next(self._next) % len(self.payloads)]] for _ in range(total)]


#: Requests in flight during a warm-up of more than this many.
WARM_CONCURRENCY = 32


async def _warm(client: _Client, tag: str, count: int = 8) -> None:
    """`count` requests through `client` (at most `WARM_CONCURRENCY` at once), then its records cleared."""
    counter = iter(range(count))

    async def worker() -> None:
        for index in counter:
            await client.one(index, f"warm-{tag}")

    await asyncio.gather(*(worker() for _ in range(min(count, WARM_CONCURRENCY))))
    client.latencies.clear()
    client.batch_sizes.clear()
    client.errors = client.items = client.cached_items = 0


async def _warm_up(session: aiohttp.ClientSession, url: str, modality: str, workload, tag: str,
                   count: int = 8) -> None:
    await _warm(_Client(session, url, modality, workload.requests(count)), tag, count)


async def closed_loop(url: str, config: str, concurrency: int, total: int, modality: str, workload,
                      progress=None, on_start=None, headers: dict[str, str] | None = None,
                      warm: int = 8) -> LoadResult:
    """`concurrency` clients, each sending its next request as soon as the last is answered. `workload`
    is a `workloads` object or a plain list of payloads (one per request, cycling).
    `on_start()` runs after the warm-up (`warm` requests of the workload), just before the clock starts;
    `headers` go with every request."""
    async with _session(max(concurrency, min(warm, WARM_CONCURRENCY)) + 8, headers) as session:
        workload = _Cycle(workload) if isinstance(workload, list) else workload
        await _warm_up(session, url, modality, workload, f"{config}-{concurrency}", warm)
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
                    progress=None, on_start=None, seed: int = 0, headers: dict[str, str] | None = None,
                    warm: int = 8) -> LoadResult:
    """Poisson arrivals at `rate` requests/s, whatever the server's answers (the load does not wait)."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=total)
    async with _session(1024, headers) as session:
        workload = _Cycle(workload) if isinstance(workload, list) else workload
        await _warm_up(session, url, modality, workload, f"{config}-{rate}", warm)
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
