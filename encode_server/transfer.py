"""Deliver embeddings to prefill ranks over ZMQ (CONTRACT section 3).

`EmbeddingSender` keeps one PUSH socket per endpoint. Sockets are `ZMQ_IMMEDIATE`, so a message is
only ever queued to a peer that is connected, never piled up for a dead one, and a send that finds
no peer waits (on the socket's event, not by polling) at most `send_timeout_s` before the
destination is reported undeliverable. Payloads go zero-copy (`copy=False`) from the tensor's
memory; libzmq's I/O thread moves the bytes, off the event loop.

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
from dataclasses import dataclass, field

import torch
import zmq
import zmq.asyncio

from .wire import Header, is_wildcard_host

log = logging.getLogger("encode_server.transfer")

#: `tcp://host:port`, or SGLang's scheme-less `host:port` / `[v6]:port` (its `NetworkAddress.to_host_port_str`).
_ENDPOINT = re.compile(r"^(?:tcp://)?(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9._-]+):(?P<port>\d{1,5})$")


class DeliveryError(Exception):
    """Some destinations did not take the embedding; `failures` maps endpoint to reason."""

    def __init__(self, failures: dict[str, str]) -> None:
        super().__init__("; ".join(f"{endpoint}: {reason}" for endpoint, reason in failures.items()))
        self.failures = failures


def check_endpoint(url: str) -> str:
    """The `tcp://host:port` the encoder may connect to, from `tcp://host:port`, `host:port` or
    `[v6]:port` (SGLang registers without a scheme); ValueError otherwise."""
    match = _ENDPOINT.match(url.strip())
    if not match:
        raise ValueError(f"{url!r} is not a tcp://host:port, host:port or [v6]:port address")
    bracketed = match["host"].startswith("[")
    host = match["host"].strip("[]")
    if is_wildcard_host(host):
        raise ValueError(f"{url!r}: a wildcard address cannot be connected to; give the receiver's own address")
    if bracketed:
        try:
            address = ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{url!r}: {host!r} in brackets is not an IPv6 address") from None
        if address.is_unspecified or (address.ipv4_mapped is not None and address.ipv4_mapped.is_unspecified):
            raise ValueError(f"{url!r}: a wildcard address cannot be connected to; give the receiver's own address")
    elif re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:  # "0", "127.1", "2130706433": legacy forms the resolver would still accept
            raise ValueError(f"{url!r}: {host!r} is not a canonical IPv4 address") from None
    if not 1 <= int(match["port"]) <= 65535:
        raise ValueError(f"{url!r}: port out of range")
    return f"tcp://{match['host']}:{int(match['port'])}"


def endpoint_for(host: str, port: int) -> str:
    bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return check_endpoint(f"tcp://{bracketed}:{port}")


def payload_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (bfloat16 as its 16-bit pattern; the host is little-endian)."""
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return memoryview(tensor.numpy()).cast("B")


class EmbeddingSender:
    """One cached PUSH socket per endpoint, used only from the event loop."""

    def __init__(self, send_timeout_s: float, high_water_mark: int = 64) -> None:
        self.send_timeout_s = send_timeout_s
        self._high_water_mark = high_water_mark
        self._context = zmq.asyncio.Context()
        self._sockets: dict[str, zmq.asyncio.Socket] = {}

    def _socket(self, endpoint: str) -> zmq.asyncio.Socket:
        sock = self._sockets.get(endpoint)
        if sock is None:
            sock = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self._high_water_mark)
            sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
            if endpoint.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(endpoint)
            self._sockets[endpoint] = sock
        return sock

    async def send(self, endpoints: list[str], header: bytes, payload: memoryview | bytes) -> int:
        """Send to every endpoint at once; returns bytes sent, raises `DeliveryError` naming failures."""
        if len(endpoints) == 1:
            results = [await self._send_one(endpoints[0], header, payload)]
        else:
            results = await asyncio.gather(*(self._send_one(e, header, payload) for e in endpoints))
        failures = {endpoint: reason for endpoint, reason in zip(endpoints, results) if reason}
        if failures:
            raise DeliveryError(failures)
        return len(payload) * len(endpoints)

    async def _send_one(self, endpoint: str, header: bytes, payload: memoryview | bytes) -> str | None:
        try:
            sent = self._socket(endpoint).send_multipart([header, payload], copy=False)
            if not sent.done():  # no connected peer, or its queue is full: wait on the socket's event
                await asyncio.wait_for(sent, self.send_timeout_s)
            sent.result()
            return None
        except asyncio.TimeoutError:
            return f"no receiver took the embedding within {self.send_timeout_s:g} s"
        except zmq.ZMQError as exc:
            return f"ZMQ error: {exc}"

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(0)
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
