"""`--register-with`: announce this encoder to SGLang's encoder registry, and withdraw on drain.

SGLang's language side can discover encoders at run time (its `EncoderBootstrapServer`):
`POST {url}/register_encoder_url {"url": <encoder URL>}` adds one, `DELETE {url}/unregister_encoder_url`
with the same body removes it. On start the server registers with every given registry in the
background; when it starts draining it unregisters, so SGLang stops dispatching to it before it goes away.

A registry that is not up (or answers an error) is said at once, as a warning naming it and the cause;
the server then keeps trying, with exponential backoff (0.5 s doubling up to `max_delay_s`), until it
registers or drains, and repeats the warning at most once every `warn_every_s` (with the number of
attempts), so a registry that is down for hours neither floods the log nor goes unnoticed.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

log = logging.getLogger("encode_server.fronts.sglang.registry")


class SglangRegistry:
    """Registers `own_url` with each registry in `urls`; `withdraw()` undoes it."""

    def __init__(self, urls: list[str], own_url: str, timeout_s: float = 5.0, max_delay_s: float = 30.0,
                 warn_every_s: float = 60.0) -> None:
        self.urls = urls
        self.own_url = own_url
        self.timeout_s = timeout_s
        self.max_delay_s = max_delay_s
        self.warn_every_s = warn_every_s
        self.registered: set[str] = set()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.urls:
            self._task = asyncio.get_running_loop().create_task(self._register_all())

    async def _register_all(self) -> None:
        await asyncio.gather(*(self._register(url) for url in self.urls))

    async def _attempt(self, registry: str) -> str | None:
        """One registration; None on success, else what went wrong."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session, session.post(
                    f"{registry}/register_encoder_url", json={"url": self.own_url}) as response:
                if response.status == 200:
                    return None
                return f"HTTP {response.status}: {(await response.text())[:200]}"
        except asyncio.TimeoutError:
            return f"no answer within {self.timeout_s:g} s"
        except aiohttp.ClientError as exc:
            return f"{type(exc).__name__}: {exc}"

    async def _register(self, registry: str) -> None:
        loop = asyncio.get_running_loop()
        delay, attempts, warned_at = 0.5, 0, None
        while True:
            attempts += 1
            problem = await self._attempt(registry)
            if problem is None:
                self.registered.add(registry)
                after = f" after {attempts} attempts" if attempts > 1 else ""
                log.info("registered %s with SGLang's encoder registry at %s%s", self.own_url, registry, after)
                return
            now = loop.time()
            if warned_at is None or now - warned_at >= self.warn_every_s:
                warned_at = now
                log.warning("cannot register with SGLang's encoder registry at %s (%d attempts so far): %s; "
                            "retrying every %g s at most until it answers (--register-with)",
                            registry, attempts, problem, self.max_delay_s)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_delay_s)

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
