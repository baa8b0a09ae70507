"""The ZMQ socket layer of delivery: endpoint checks and one PUSH socket per destination.

`EmbeddingSender` keeps one PUSH socket per endpoint. Sockets are `ZMQ_IMMEDIATE`, so a message is
only ever queued to a peer that is connected, never piled up for a dead one, and a send that finds
no peer waits (on the socket's event, not by polling) at most `send_timeout_s` before the
destination is reported undeliverable. Payloads go zero-copy (`copy=False`) from the tensor's
memory; libzmq's I/O thread moves the bytes, off the event loop.

What the frames hold (the wire format) and where they go (destinations, registrations) is
`delivery.py`'s business; this module only moves frames.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
from collections.abc import Sequence

import zmq
import zmq.asyncio

from .wire import is_wildcard_host

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

    async def send(self, endpoints: list[str], frames: Sequence[bytes | memoryview]) -> int:
        """Send one multipart message to every endpoint at once; returns the bytes sent, raises
        `DeliveryError` naming the endpoints that did not take it."""
        if len(endpoints) == 1:
            results = [await self._send_one(endpoints[0], frames)]
        else:
            results = await asyncio.gather(*(self._send_one(e, frames) for e in endpoints))
        failures = {endpoint: reason for endpoint, reason in zip(endpoints, results) if reason}
        if failures:
            raise DeliveryError(failures)
        return sum(len(frame) for frame in frames) * len(endpoints)

    async def _send_one(self, endpoint: str, frames: Sequence[bytes | memoryview]) -> str | None:
        try:
            sent = self._socket(endpoint).send_multipart(frames, copy=False)
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
