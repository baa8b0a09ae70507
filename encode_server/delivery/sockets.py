"""The ZMQ socket layer of delivery: endpoint checks and one PUSH socket per destination.

`EmbeddingSender` keeps one PUSH socket per endpoint. Sockets are `ZMQ_IMMEDIATE`, so a message is
only ever queued to a peer that is connected, never piled up for a dead one. A send is a
non-blocking `send_multipart` straight from the event loop (no future, no thread hand-off); only
one that finds no peer or a full queue waits (on the socket's event, not by polling), at most
`send_timeout_s`, before the destination is reported undeliverable. Payloads go zero-copy
(`copy=False`) from the tensor's memory; libzmq's I/O thread moves the bytes, off the event loop.

What the frames hold (the wire format) and where they go (destinations, registrations) is
`delivery/destinations.py`'s business; this module only moves frames.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import re
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from encode_server.delivery.wire import is_wildcard_host

log = logging.getLogger("encode_server.delivery.sockets")

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


@functools.lru_cache(maxsize=1024)  # a prefill rank's address comes back with every request it sends
def endpoint_for(host: str, port: int) -> str:
    bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return check_endpoint(f"tcp://{bracketed}:{port}")


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

    async def send(self, endpoints: list[str], frames: Sequence[bytes | memoryview]) -> int:
        """Send one multipart message to every endpoint at once; returns the payload bytes sent (the last
        frame's, times the endpoints), raises `DeliveryError` naming the endpoints that did not take it.

        Payloads are not copied: libzmq's I/O thread reads them from the caller's memory, and pyzmq
        holds a reference until libzmq is done, so the tensor behind them stays alive that long.
        """
        frames = list(frames)
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
        return len(frames[-1]) * len(endpoints)

    async def _send_waiting(self, endpoint: str, frames: list) -> str | None:
        try:
            await self._socket(endpoint).send_when_writable(frames, self.send_timeout_s)
            return None
        except asyncio.TimeoutError:
            return (f"no receiver took the embedding within {self.send_timeout_s:g} s (--send-timeout-s): "
                    "is a receiver bound there and reachable from the encoder?")
        except zmq.ZMQError as exc:
            return f"ZMQ error: {exc}"

    def close(self) -> None:
        for push in self._sockets.values():
            push.close()
        self._sockets.clear()
        self._context.term()
