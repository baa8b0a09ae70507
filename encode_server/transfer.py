"""Deliver embeddings to prefill ranks over ZMQ (CONTRACT section 3).

`EmbeddingSender` keeps one PUSH socket per endpoint. Sockets are `ZMQ_IMMEDIATE`, so a message is
only ever queued to a peer that is connected, never piled up for a dead one. A send is a
non-blocking `send_multipart` straight from the event loop (no future, no thread hand-off); only
one that finds no peer or a full queue waits (on the socket's event, not by polling), at most
`send_timeout_s`, before the destination is reported undeliverable. Payloads go zero-copy
(`copy=False`) from the tensor's memory; libzmq's I/O thread moves the bytes, off the event loop.

`Registrations` holds the receivers that asked for a request through `/scheduler_receive_url`;
delivery waits until `receive_count` distinct ones are in. An embedding finished before anyone
registered is parked for `send_timeout_s`, and goes out as soon as the registrations complete.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import zmq

from .wire import Header, is_wildcard_host

log = logging.getLogger("encode_server.transfer")

_ENDPOINT = re.compile(r"^tcp://(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9._-]+):(?P<port>\d{1,5})$")


class DeliveryError(Exception):
    """Some destinations did not take the embedding; `failures` maps endpoint to reason."""

    def __init__(self, failures: dict[str, str]) -> None:
        super().__init__("; ".join(f"{endpoint}: {reason}" for endpoint, reason in failures.items()))
        self.failures = failures


def check_endpoint(url: str) -> str:
    """A `tcp://host:port` the encoder may connect to; ValueError otherwise."""
    match = _ENDPOINT.match(url.strip())
    if not match:
        raise ValueError(f"{url!r} is not a tcp://host:port address")
    host = match["host"].strip("[]")
    if is_wildcard_host(host):
        raise ValueError(f"{url!r}: a wildcard address cannot be connected to; give the receiver's own address")
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:  # "0", "127.1", "2130706433": legacy forms the resolver would still accept
            raise ValueError(f"{url!r}: {host!r} is not a canonical IPv4 address") from None
    if not 1 <= int(match["port"]) <= 65535:
        raise ValueError(f"{url!r}: port out of range")
    return url.strip()


def endpoint_for(host: str, port: int) -> str:
    bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return check_endpoint(f"tcp://{bracketed}:{port}")


def payload_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (bfloat16 as its 16-bit pattern; the host is little-endian)."""
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return memoryview(tensor.numpy()).cast("B")


class _PushSocket:
    """One endpoint's PUSH socket, and the sends waiting for it to accept a message.

    A send first tries `NOBLOCK` straight from the event loop: no future, no thread, no loop
    callback. Only when the socket would block (no connected peer, or its queue at the high-water
    mark) does the send wait for the socket to become writable, on libzmq's notification descriptor
    (edge-triggered: `EVENTS` is read again after every change), until its deadline.
    """

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self._waiters: deque[asyncio.Future] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None

    def send_now(self, frames: list) -> bool:
        """Hand the message to libzmq if it takes it now and no earlier send is waiting."""
        return not self._waiters and self._try_send(frames)

    def _try_send(self, frames: list) -> bool:
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        if self._waiters:  # a send may have consumed the descriptor's edge: look at the state again
            self._wake_if_writable()
        return True

    async def send_when_writable(self, frames: list, timeout_s: float) -> None:
        """Send one message, waiting at most `timeout_s` for the socket to take it (TimeoutError)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            await self._writable(loop, deadline - loop.time())
            if self._try_send(frames):
                return

    async def _writable(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise asyncio.TimeoutError
        waiter = loop.create_future()
        self._waiters.append(waiter)
        if self._loop is None:
            self._loop = loop
            loop.add_reader(self.sock.FD, self._wake_if_writable)
        try:
            self._wake_if_writable()  # the state may have changed before the reader was in place
            await asyncio.wait_for(waiter, timeout_s)
        finally:
            self._waiters.remove(waiter)
            if not self._waiters and self._loop is not None:
                self._loop.remove_reader(self.sock.FD)
                self._loop = None

    def _wake_if_writable(self) -> None:
        if self.sock.closed or not self.sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
            return
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.sock.FD)
        self._loop = None
        for waiter in self._waiters:
            if not waiter.done():
                waiter.cancel()
        self.sock.close(0)


class EmbeddingSender:
    """One cached PUSH socket per endpoint, used only from the event loop."""

    def __init__(self, send_timeout_s: float, high_water_mark: int = 64) -> None:
        self.send_timeout_s = send_timeout_s
        self._high_water_mark = high_water_mark
        self._context = zmq.Context()
        self._sockets: dict[str, _PushSocket] = {}

    def _socket(self, endpoint: str) -> _PushSocket:
        push = self._sockets.get(endpoint)
        if push is None:
            sock = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self._high_water_mark)
            sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
            if endpoint.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(endpoint)
            push = self._sockets[endpoint] = _PushSocket(sock)
        return push

    async def send(self, endpoints: list[str], header: bytes, payload: memoryview | bytes) -> int:
        """Send to every endpoint at once; returns bytes sent, raises `DeliveryError` naming failures.

        The payload is not copied: libzmq's I/O thread reads it from the caller's memory, and pyzmq
        holds a reference to it until libzmq is done, so the tensor behind it stays alive that long.
        """
        frames = [header, payload]
        failures: dict[str, str] = {}
        waiting: list[str] = []
        for endpoint in endpoints:
            try:
                if not self._socket(endpoint).send_now(frames):
                    waiting.append(endpoint)
            except zmq.ZMQError as exc:
                failures[endpoint] = f"ZMQ error: {exc}"
        if waiting:
            reasons = await asyncio.gather(*(self._send_waiting(endpoint, frames) for endpoint in waiting))
            failures.update((endpoint, reason) for endpoint, reason in zip(waiting, reasons) if reason)
        if failures:
            raise DeliveryError(failures)
        return len(payload) * len(endpoints)

    async def _send_waiting(self, endpoint: str, frames: list) -> str | None:
        try:
            await self._socket(endpoint).send_when_writable(frames, self.send_timeout_s)
            return None
        except asyncio.TimeoutError:
            return f"no receiver took the embedding within {self.send_timeout_s:g} s"
        except zmq.ZMQError as exc:
            return f"ZMQ error: {exc}"

    def close(self) -> None:
        for push in self._sockets.values():
            push.close()
        self._sockets.clear()
        self._context.term()


@dataclass
class _Registration:
    """Receivers that asked for one request's embedding."""

    count: int | None  # None until a receiver says how many to expect
    created: float
    urls: list[str] = field(default_factory=list)
    complete: asyncio.Event = field(default_factory=asyncio.Event)
    parked: dict[int, tuple[bytes, memoryview, torch.Tensor]] = field(default_factory=dict)


class Registrations:
    """`/scheduler_receive_url` state: who wants which `req_id`, and embeddings waiting for them."""

    def __init__(self, sender: EmbeddingSender, ttl_s: float, max_parked_bytes: int = 512 << 20) -> None:
        self.sender = sender
        self.ttl_s = ttl_s
        self.max_parked_bytes = max_parked_bytes
        self.parked_bytes = 0
        self._by_req: dict[str, _Registration] = {}
        self._tasks: set[asyncio.Task] = set()

    def _entry(self, req_id: str, count: int | None) -> _Registration:
        entry = self._by_req.get(req_id)
        if entry is None:
            entry = self._by_req[req_id] = _Registration(count=count, created=time.monotonic())
            asyncio.get_running_loop().call_later(self.ttl_s, self._expire, req_id, entry)
        return entry

    def _expire(self, req_id: str, entry: _Registration) -> None:
        if self._by_req.get(req_id) is entry:
            del self._by_req[req_id]
            self._unpark(entry)

    def _unpark(self, entry: _Registration) -> None:
        self.parked_bytes -= sum(len(payload) for _, payload, _ in entry.parked.values())
        entry.parked.clear()

    def register(self, req_id: str, url: str, count: int) -> int:
        """Add a receiver; returns how many distinct ones are registered. ValueError on a count clash."""
        entry = self._entry(req_id, count)
        if entry.count is None:
            entry.count = count
        if entry.count != count:
            raise ValueError(f"receive_count {count} differs from the {entry.count} registered before for {req_id!r}")
        if url not in entry.urls:
            entry.urls.append(url)
        if len(entry.urls) >= entry.count and not entry.complete.is_set():
            entry.complete.set()
            for header, payload, _ in entry.parked.values():
                task = asyncio.get_running_loop().create_task(self._deliver_parked(req_id, entry, header, payload))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            self._unpark(entry)
        return len(entry.urls)

    async def _deliver_parked(self, req_id: str, entry: _Registration, header: bytes, payload: memoryview) -> None:
        try:
            await self.sender.send(list(entry.urls), header, payload)
        except DeliveryError as exc:
            log.warning("late delivery of %s failed: %s", req_id, exc)

    def wanted(self, req_id: str) -> bool:
        """Whether a receiver has registered for `req_id` (parked embeddings alone do not count)."""
        entry = self._by_req.get(req_id)
        return entry is not None and bool(entry.urls)

    def known_receivers(self, req_id: str) -> list[str]:
        entry = self._by_req.get(req_id)
        return list(entry.urls) if entry else []

    async def receivers(self, req_id: str, timeout: float) -> list[str]:
        """The registered receivers once `receive_count` are in; TimeoutError after `timeout`."""
        entry = self._by_req[req_id]
        await asyncio.wait_for(entry.complete.wait(), timeout)
        return list(entry.urls)

    def park(self, req_id: str, part_idx: int, header: Header, tensor: torch.Tensor) -> None:
        """Keep an embedding nobody registered for yet, until registrations complete or the TTL passes."""
        payload = payload_view(tensor)
        if self.parked_bytes + len(payload) > self.max_parked_bytes:
            log.warning("not keeping %s for late registration: %d bytes already parked", req_id, self.parked_bytes)
            return
        entry = self._entry(req_id, count=None)
        entry.parked[part_idx] = (header.encode(), payload, tensor)
        self.parked_bytes += len(payload)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
