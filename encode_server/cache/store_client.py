"""A connection to Mooncake Store that can never fail or hold up a request: reads with a deadline, writes in
the background within a bound, and a master that is down, lost or slow costing only hit rate.

- **Connecting** happens on a thread of its own: a TCP probe of the master first (Mooncake's own setup
  waits about 90 s for a master that is not there), then the client's `setup`, then the protocol marker
  (`store_format.PROTOCOL_MARKER_KEY`: written if absent; a marker naming a protocol this server cannot
  read refuses the Store for good, and refuses the start when found during `start`). Failures retry with
  a backoff from 0.5 s doubling to 30 s.
- **Watching**: once connected, the master is probed every second. Lost: reads and writes are skipped
  (the client would fail them anyway) until it answers again; Mooncake's client re-registers with a
  restarted master by itself, and the marker is written again then (a restarted master forgets it).
- **Warnings**: the first of a kind at once, later ones at most every 30 s with the count in between.
- **Reads** (`get`) run on a small thread pool and are awaited with a deadline; a read that misses it
  is a miss for the caller (the thread finishes on its own). With every read thread still busy, a new
  read is skipped rather than queued behind them.
- **Writes** (`publish`) go into a queue bounded in objects and bytes, drained by one thread; beyond the
  bound an object is dropped, counted. A key already in the Store keeps its first value (Mooncake's put).

- **Closing** waits at most 3 s for Mooncake's client to close (with the master gone it spends about 10 s
  trying to unmount a lent segment), so a server's shutdown is never held up by the Store.

Counters and the read-latency histogram (`StoreStats`) are read by `ops.metrics` at scrape time.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from encode_server.cache import store_format
from encode_server.ops.libraries import missing_message
from encode_server.ops.settings import Settings

log = logging.getLogger("encode_server.cache.store")


#: Mooncake's error code for a put of a key the Store holds already (its first value is kept).
OBJECT_ALREADY_EXISTS = -705

#: Read-latency histogram buckets (seconds).
READ_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


class StoreRefused(RuntimeError):
    """The Store speaks a protocol this server cannot read (its marker says so)."""


@dataclass(frozen=True)
class StoreConfig:
    """How to reach the Store, in Mooncake's own terms, and the tier's bounds."""

    master_server_address: str  # host:port of mooncake_master's RPC
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = ""  # empty: the address this host reaches the master from
    global_segment_size: int = 512 << 20
    local_buffer_size: int = 128 << 20
    read_timeout_s: float = 0.1
    publish_max_items: int = 1024
    publish_max_bytes: int = 256 << 20
    read_threads: int = 2


@dataclass
class StoreStats:
    """What the tier did; `read_buckets` counts reads per `READ_BUCKETS` bound (the last: above all)."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    read_errors: int = 0
    read_timeouts: int = 0
    reads_skipped: int = 0  # not asked: the Store unreachable, or every read thread busy
    published: int = 0
    publish_drops: int = 0
    publish_errors: int = 0
    reconnects: int = 0
    read_seconds_sum: float = 0.0
    read_buckets: list[int] = field(default_factory=lambda: [0] * (len(READ_BUCKETS) + 1))

    def observe_read(self, seconds: float) -> None:
        self.read_seconds_sum += seconds
        for index, bound in enumerate(READ_BUCKETS):
            if seconds <= bound:
                self.read_buckets[index] += 1
                return
        self.read_buckets[-1] += 1


class RateLimitedWarning:
    """The first warning of a kind now; the next ones at most every `interval_s`, with the count skipped."""

    def __init__(self, interval_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[str, float] = {}
        self._skipped: collections.Counter[str] = collections.Counter()

    def __call__(self, kind: str, message: str, *args: Any) -> bool:
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval_s:
            self._skipped[kind] += 1
            return False
        skipped = self._skipped.pop(kind, 0)
        self._last[kind] = now
        log.warning(message + (f" ({skipped} more like it since)" if skipped else ""), *args)
        return True


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def probe(address: str, timeout_s: float = 1.0) -> bool:
    """Whether the master accepts a TCP connection."""
    try:
        with socket.create_connection(_host_port(address), timeout=timeout_s):
            return True
    except OSError:
        return False


def local_address_towards(address: str) -> str:
    """This host's address on the route to `address` (a UDP socket's connect sends nothing)."""
    host, port = _host_port(address)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family[0], socket.SOCK_DGRAM) as udp:
            udp.connect(family[4])
            return udp.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def mooncake_client_factory() -> Any:
    """A new `MooncakeDistributedStore`; ImportError naming the extra when Mooncake is not installed."""
    _quiet_glog()
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ImportError(f"{missing_message('mooncake', '--cache-store')} ({exc})") from None
    return MooncakeDistributedStore()


def _close_quietly(client: Any) -> None:
    with contextlib.suppress(Exception):
        client.close()


def _quiet_glog() -> None:
    """Mooncake logs every connection step at INFO; warnings and errors are what operators need (an explicit
    MC_LOG_LEVEL wins)."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")


def libraries_needed(settings: Settings) -> list[tuple[str, str]]:
    """The optional libraries `--cache-store` needs, and what to call it in the refusal: checked before the model
    loads (`runtime.check_libraries`), and again by `check_installed` when the connection is made."""
    return [("mooncake", "--cache-store (Mooncake Store's client)")] if settings.cache_store else []


def check_installed() -> None:
    """ImportError naming the extra when `--cache-store` is set and Mooncake's client is missing."""
    _quiet_glog()
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"{missing_message('mooncake', '--cache-store')} ({exc})") from None


class StoreConnection:
    """One Mooncake Store client for the whole server, kept connected in the background."""

    def __init__(self, config: StoreConfig, writer: str, factory: Callable[[], Any] = mooncake_client_factory,
                 warn: RateLimitedWarning | None = None) -> None:
        self.config = config
        self.writer = writer
        self.factory = factory
        self.stats = StoreStats()
        self.read_bucket_bounds = READ_BUCKETS
        self.warn = warn or RateLimitedWarning()
        self.state = "connecting"  # connecting, connected, lost, refused, closed
        self.refusal: str | None = None
        self._client: Any = None
        self._closed = threading.Event()
        self._first_attempt = threading.Event()
        self._reads = concurrent.futures.ThreadPoolExecutor(config.read_threads, thread_name_prefix="store-read")
        self._reads_busy = 0
        self._lock = threading.Lock()
        self._pending: collections.deque[tuple[list[tuple[str, bytes]], int]] = collections.deque()
        self._pending_bytes = 0
        self._wake = threading.Condition(self._lock)
        self._threads = [threading.Thread(target=self._keep_connected, name="store-connect", daemon=True),
                         threading.Thread(target=self._publish_loop, name="store-publish", daemon=True)]

    @property
    def up(self) -> bool:
        return self.state == "connected"

    @property
    def pending(self) -> tuple[int, int]:
        """(objects, bytes) waiting to be published."""
        with self._lock:
            return sum(len(objects) for objects, _ in self._pending), self._pending_bytes

    def start(self, wait_s: float = 10.0) -> None:
        """Start connecting; wait up to `wait_s` for the first try when the master answers the probe.
        `StoreRefused` when the Store's marker names a protocol this server cannot read."""
        for thread in self._threads:
            thread.start()
        self._first_attempt.wait(wait_s)
        if self.state == "refused":
            raise StoreRefused(self.refusal)

    def close(self) -> None:
        self._closed.set()
        with self._wake:
            self._wake.notify_all()
        self._reads.shutdown(wait=False, cancel_futures=True)
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=5)
        client, self._client = self._client, None
        self.state = "closed"
        if client is not None:
            # With the master gone, Mooncake's close waits about 10 s to unmount a lent segment: never let
            # that hold up the server's shutdown.
            closer = threading.Thread(target=_close_quietly, args=(client,), name="store-close", daemon=True)
            closer.start()
            closer.join(timeout=3.0)

    # --- reads -------------------------------------------------------------------------------------

    async def get(self, keys: Sequence[str], timeout_s: float | None = None) -> list[bytes | None]:
        """Each key's value, or None (absent, unreachable, or not back within the deadline)."""
        if not keys:
            return []
        timeout = self.config.read_timeout_s if timeout_s is None else timeout_s
        if not self.up or self._reads_busy >= self.config.read_threads or timeout <= 0:
            self.stats.reads_skipped += 1
            return [None] * len(keys)
        started = time.perf_counter()
        with self._lock:
            self._reads_busy += 1
        try:
            future = self._reads.submit(self._get_batch, list(keys))
        except RuntimeError:  # shut down
            with self._lock:
                self._reads_busy -= 1
            return [None] * len(keys)
        try:
            values = await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except asyncio.TimeoutError:
            self.stats.read_timeouts += 1
            self.warn("read-timeout", "Mooncake Store: a read took over %.0f ms; served without it", timeout * 1e3)
            return [None] * len(keys)
        except Exception as exc:  # noqa: BLE001 (the binding's errors: a miss, never a failed request)
            self.stats.read_errors += 1
            self.warn("read-error", "Mooncake Store: a read failed (%s); served without it", exc)
            return [None] * len(keys)
        self.stats.observe_read(time.perf_counter() - started)
        return values

    def _get_batch(self, keys: list[str]) -> list[bytes | None]:
        try:
            client = self._client
            if client is None:
                return [None] * len(keys)
            values = client.get_batch(keys) if len(keys) > 1 else [client.get(keys[0])]
            return [bytes(value) if value else None for value in values]
        finally:
            with self._lock:
                self._reads_busy -= 1

    # --- writes ------------------------------------------------------------------------------------

    def publish(self, objects: list[tuple[str, bytes | Callable[[], bytes]]], size: int | None = None) -> bool:
        """Queue objects to be put together (in order); False (dropped, counted) beyond the bound. A value may be a
        callable that makes its bytes in the publishing thread (then `size` says how many there will be)."""
        if size is None:
            size = sum(len(value) for _, value in objects)
        with self._wake:
            count = sum(len(queued) for queued, _ in self._pending)
            if (not self.up or count + len(objects) > self.config.publish_max_items
                    or self._pending_bytes + size > self.config.publish_max_bytes):
                self.stats.publish_drops += 1
                return False
            self._pending.append((objects, size))
            self._pending_bytes += size
            self._wake.notify()
        return True

    def _publish_loop(self) -> None:
        while not self._closed.is_set():
            with self._wake:
                while not self._pending and not self._closed.is_set():
                    self._wake.wait()
                if self._closed.is_set():
                    return
                objects, size = self._pending.popleft()
                self._pending_bytes -= size
            client = self._client
            if client is None or not self.up:
                self.stats.publish_drops += 1
                continue
            try:
                config = self._replicate_config()
                for key, value in objects:
                    result = client.put(key, value() if callable(value) else value, config)
                    if result < 0 and result != OBJECT_ALREADY_EXISTS:  # another pod's value stays: the same rows
                        raise RuntimeError(f"put returned {result}")
                self.stats.published += 1
            except Exception as exc:  # noqa: BLE001
                self.stats.publish_errors += 1
                self.warn("publish-error", "Mooncake Store: publishing an item failed (%s)", exc)

    def _replicate_config(self) -> Any:
        try:
            from mooncake.store import ObjectDataType, ReplicateConfig
        except ImportError:
            return None
        config = ReplicateConfig()
        config.data_type = ObjectDataType.TENSOR  # as vLLM's embedding client writes them
        return config

    # --- the connection ----------------------------------------------------------------------------

    def _keep_connected(self) -> None:
        backoff = 0.5
        address = self.config.master_server_address
        while not self._closed.is_set():
            if self._client is None:
                if not probe(address):
                    self.state = "connecting"
                    self.warn("unreachable", "Mooncake Store: the master at %s does not answer; serving from the "
                              "local cache and the encoder, retrying in %.1f s", address, backoff)
                    self._first_attempt.set()
                    self._closed.wait(backoff)
                    backoff = min(backoff * 2, 30.0)
                    continue
                try:
                    client = self._connect()
                    try:
                        self._check_marker(client)
                    except BaseException:
                        _close_quietly(client)
                        raise
                    self._client = client
                except StoreRefused as exc:
                    self.state, self.refusal = "refused", str(exc)
                    log.error("Mooncake Store: %s", exc)
                    self._first_attempt.set()
                    return
                except Exception as exc:  # noqa: BLE001
                    self.warn("connect", "Mooncake Store: connecting to %s failed (%s); retrying in %.1f s",
                              address, exc, backoff)
                    self._first_attempt.set()
                    self._closed.wait(backoff)
                    backoff = min(backoff * 2, 30.0)
                    continue
                self.state, backoff = "connected", 0.5
                log.info("Mooncake Store: connected to the master at %s (%s, metadata %s)", address,
                         self.config.protocol, self.config.metadata_server)
                self._first_attempt.set()
                continue
            answering = probe(address)
            if answering and self.state == "lost":
                if self._closed.wait(1.0):  # Mooncake's client re-registers on its next heartbeat; a close ends it
                    return
                try:
                    self._check_marker(self._client)
                except StoreRefused as exc:
                    self.state, self.refusal = "refused", str(exc)
                    log.error("Mooncake Store: %s; the shared tier is off", exc)
                    return
                except Exception:  # noqa: BLE001 (not back yet: next round)
                    pass
                else:
                    self.state = "connected"
                    self.stats.reconnects += 1
                    log.warning("Mooncake Store: the master at %s answers again", address)
            elif not answering:
                self.state = "lost"
                self.warn("lost", "Mooncake Store: lost the master at %s; serving from the local cache and the "
                          "encoder until it is back", address)
            self._closed.wait(1.0)

    def _connect(self) -> Any:
        config = self.config
        client = self.factory()
        hostname = config.local_hostname or local_address_towards(config.master_server_address)
        result = client.setup(hostname, config.metadata_server, config.global_segment_size,
                              config.local_buffer_size, config.protocol, config.device_name,
                              config.master_server_address)
        if result != 0:
            with contextlib.suppress(Exception):
                client.close()
            raise RuntimeError(f"setup returned {result}")
        return client

    def _check_marker(self, client: Any) -> None:
        """Read the Store's protocol marker; write ours where there is none; `StoreRefused` if unreadable."""
        value = client.get(store_format.PROTOCOL_MARKER_KEY)
        if value:
            protocol = store_format.marker_protocol(value)
            if protocol not in store_format.READABLE_PROTOCOLS:
                named = f"protocol {protocol!r}" if protocol else f"an unreadable marker {bytes(value)[:80]!r}"
                raise StoreRefused(f"the Store at {self.config.master_server_address} holds {named} under "
                                   f"{store_format.PROTOCOL_MARKER_KEY!r}; this server reads "
                                   f"{', '.join(sorted(store_format.READABLE_PROTOCOLS))} only: point --cache-store "
                                   f"at a Store of this protocol, or upgrade the server")
            return
        result = client.put(store_format.PROTOCOL_MARKER_KEY, store_format.marker_value(self.writer))
        if result < 0:  # e.g. -200: nobody lends the Store memory yet; items will not be stored either
            self.warn("marker", "Mooncake Store: writing the protocol marker returned %d (no memory lent to the "
                      "Store? run mooncake_client or give --cache-store-global-segment-size); publishing will "
                      "fail the same way until it has some", result)
