"""A client of vLLM's `ECMooncakeConnector` consumer control socket: JSON over ZMQ REQ.

Each consumer tensor-parallel rank answers on its own REP socket (vLLM 0.33,
`ec_connector/mooncake/control.py`, `ConsumerControlServer`): a request is `{"op": ..., ...}`, an
answer `{"ok": true, "result": ...}` or `{"ok": false, "error": "..."}`. The ops a producer sends:
`peers` (the ports of every rank, asked of the address the proxy names), `reserve_batch`,
`complete_batch` and `cancel`. Every exchange is bounded by `timeout_s` (vLLM's `control_timeout_s`):
a consumer that is gone fails the exchange, never blocks it. A REQ socket whose exchange failed is
closed (its state is lost); the others are kept per address for the next request of the same thread.
"""

from __future__ import annotations

import threading
from typing import Any

import zmq


class ControlError(RuntimeError):
    """The consumer answered `ok: false`, or did not answer in time."""

    def __init__(self, message: str, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


class ControlClient:
    """Blocking exchanges with consumers' control sockets; one REQ socket per thread and address."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_ms = max(1, int(timeout_s * 1000))
        self._context = zmq.Context()
        self._local = threading.local()
        self._closed = False

    def _socket(self, address: str) -> zmq.Socket:
        sockets: dict[str, zmq.Socket] = self._local.__dict__.setdefault("sockets", {})
        socket = sockets.get(address)
        if socket is None:
            socket = self._context.socket(zmq.REQ)
            socket.setsockopt(zmq.IPV6, 1)
            socket.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
            socket.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
            sockets[address] = socket
        return socket

    def _discard(self, address: str) -> None:
        socket = self._local.__dict__.get("sockets", {}).pop(address, None)
        if socket is not None:
            socket.close(linger=0)

    def request(self, address: str, payload: dict[str, Any]) -> Any:
        """One exchange; the answer's `result`. `ControlError` on `ok: false` or no answer in time."""
        if self._closed:
            raise ControlError("the control client is closed")
        socket = self._socket(address)
        try:
            socket.send_json(payload)
            answer = socket.recv_json()
        except zmq.Again:
            self._discard(address)
            raise ControlError(f"the EC consumer at {address} did not answer {payload.get('op')!r} within "
                               f"{self.timeout_ms / 1000:g} s", unreachable=True) from None
        except (zmq.ZMQError, ValueError) as exc:
            self._discard(address)
            raise ControlError(f"the control exchange with the EC consumer at {address} failed: {exc}",
                               unreachable=True) from None
        if not isinstance(answer, dict) or not answer.get("ok"):
            error = answer.get("error") if isinstance(answer, dict) else answer
            raise ControlError(f"the EC consumer at {address} refused {payload.get('op')!r}: {error}")
        return answer.get("result")

    def shards(self, address: str) -> list[str]:
        """The control address of every rank of the consumer named by `address` (its rank 0)."""
        reply = self.request(address, {"op": "peers"})
        ports = reply.get("ports") if isinstance(reply, dict) else None
        if not isinstance(ports, list) or not ports:
            raise ControlError(f"the EC consumer at {address} reported no ranks: {reply!r}")
        prefix = address.rsplit(":", 1)[0]
        return [f"{prefix}:{int(port)}" for port in ports]

    def close(self) -> None:
        self._closed = True
        self._context.destroy(linger=0)
