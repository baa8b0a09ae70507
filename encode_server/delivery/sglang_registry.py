"""`--register-with`: announce this encoder to SGLang's encoder registry, and withdraw on drain.

SGLang's language side can discover encoders at run time (its `EncoderBootstrapServer`):
`POST {url}/register_encoder_url {"url": <encoder URL>}` adds one, `DELETE {url}/unregister_encoder_url`
with the same body removes it. On start the server registers with every given registry in the
background, retrying with backoff while one is not up yet; when it starts draining it unregisters, so
SGLang stops dispatching to it before it goes away.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

log = logging.getLogger("encode_server.delivery.sglang_registry")


class SglangRegistry:
    """Registers `own_url` with each registry in `urls`; `withdraw()` undoes it."""

    def __init__(self, urls: list[str], own_url: str, retry_for_s: float = 120.0, timeout_s: float = 5.0) -> None:
        self.urls = urls
        self.own_url = own_url
        self.retry_for_s = retry_for_s
        self.timeout_s = timeout_s
        self.registered: set[str] = set()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.urls:
            self._task = asyncio.get_running_loop().create_task(self._register_all())

    async def _register_all(self) -> None:
        await asyncio.gather(*(self._register(url) for url in self.urls))

    async def _register(self, registry: str) -> None:
        delay, waited = 0.5, 0.0
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        while True:
            try:
                async with aiohttp.ClientSession(timeout=timeout) as session, session.post(
                        f"{registry}/register_encoder_url", json={"url": self.own_url}) as response:
                    if response.status == 200:
                        self.registered.add(registry)
                        log.info("registered %s with SGLang's encoder registry at %s", self.own_url, registry)
                        return
                    problem = f"HTTP {response.status}: {(await response.text())[:200]}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if waited >= self.retry_for_s:
                log.warning("could not register with %s within %g s: %s", registry, self.retry_for_s, problem)
                return
            await asyncio.sleep(delay)
            waited += delay
            delay = min(delay * 2, 10.0)

    async def withdraw(self) -> None:
        """Unregister from every registry (best effort, each within the timeout)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if not self.urls:
            return
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async def one(registry: str) -> None:
                try:
                    async with session.delete(f"{registry}/unregister_encoder_url",
                                              json={"url": self.own_url}) as response:
                        log.info("unregistered from %s: HTTP %d", registry, response.status)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    log.warning("could not unregister from %s: %s", registry, exc)
            await asyncio.gather(*(one(registry) for registry in self.urls))
        self.registered.clear()
