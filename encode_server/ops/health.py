"""The real health probe: a tiny input through the whole encode path, its verdict cached.

`/health` never waits for the probe: it reads the last verdict and, when that is older than
`interval_s` and no probe is running, starts a new one in the background. So an idle server that
nobody asks spends nothing, and a server behind a long batch still answers at once. A probe that
fails, or that has not finished after `timeout_s`, makes the server unhealthy. `on_finish` is told after each
probe (the service keeps `encoder_healthy` current with it).

The probe's input is the model's own sample, shrunk by `fit_sample` to within the server's decode limits
(`--max-image-pixels`, `--max-audio-seconds`), so that a server configured with small limits probes what it
accepts instead of failing its own probe forever.
"""

from __future__ import annotations

import asyncio
import io
import logging
import math
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger("encode_server.ops.health")


class HealthProbe:
    """Runs `probe` at most every `interval_s`; `verdict()` says healthy or why not."""

    def __init__(self, probe: Callable[[], Awaitable[None]], interval_s: float, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic, on_finish: Callable[[], None] | None = None) -> None:
        self._probe = probe
        self.on_finish = on_finish
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._task: asyncio.Task | None = None
        self._started_at = 0.0
        self._finished_at: float | None = None
        self._error: str | None = None

    def _start(self) -> None:
        self._started_at = self._clock()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            await asyncio.wait_for(self._probe(), self.timeout_s)
            self._error = None
        except asyncio.TimeoutError:
            self._error = f"the health probe did not finish within {self.timeout_s:g} s"
        except Exception as exc:  # any failure of the encode path makes the server unhealthy
            self._error = f"the health probe failed: {exc}"
        if self._error:
            log.warning("%s", self._error)
        self._finished_at = self._clock()
        if self.on_finish is not None:
            self.on_finish()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def verdict(self) -> tuple[bool, str]:
        """(healthy, message) from the cached result; refreshes it in the background when stale."""
        now = self._clock()
        if self.running:
            if now - self._started_at > self.timeout_s:
                return False, f"the health probe has not finished after {now - self._started_at:.1f} s"
        elif self._finished_at is None or now - self._finished_at >= self.interval_s:
            self._start()
        if self._finished_at is None:
            return True, "first probe running"
        if self._error:
            return False, self._error
        return True, "ok"

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def fit_sample(modality: str, data: bytes, max_image_pixels: int, max_audio_seconds: float) -> bytes:
    """A sample file (`Processor.sample_encoded`: a PNG image or a WAV clip) made to fit the decode limits:
    an image over `max_image_pixels` scaled down (aspect kept, at least 1x1), a clip over `max_audio_seconds`
    cut; what already fits comes back as it is."""
    if modality == "image":
        from PIL import Image

        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height <= max_image_pixels:
            return data
        scale = math.sqrt(max(1, max_image_pixels) / (width * height))
        new_width = max(1, math.floor(width * scale))
        new_height = max(1, min(math.floor(height * scale), max(1, max_image_pixels) // new_width))
        buffer = io.BytesIO()
        image.resize((new_width, new_height)).save(buffer, "PNG")
        return buffer.getvalue()
    if modality == "audio":
        import soundfile

        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
        keep = max(1, math.floor(max_audio_seconds * rate))
        if len(samples) <= keep:
            return data
        buffer = io.BytesIO()
        soundfile.write(buffer, samples[:keep], rate, format="WAV")
        return buffer.getvalue()
    return data
