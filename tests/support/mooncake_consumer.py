"""A stand-in for vLLM's `ECMooncakeConnector` consumer, for tests that cannot install vLLM: its documented
control protocol (JSON over ZMQ REP, one socket per tensor-parallel rank: `peers`, `reserve`/`reserve_batch`,
`complete`/`complete_batch`, `cancel`, `status`) over a real Mooncake TransferEngine and a registered
landing pool per rank, on loopback. What it received is kept per rank and transfer id.

Faults on demand: `ttl_s` (a reservation not completed by then expires, as vLLM's do after 300 s),
`full` (every reservation is refused as vLLM's consumer refuses one when its pool is full), and
`python -m tests.support.mooncake_consumer PORT --die-after-reserve` (answers the first reservation, then the
process exits before any write can land).

vLLM's own consumer (scheduler and worker roles) is driven by `tools/compat/vllm_compat.py`.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass

import torch
import zmq


@dataclass
class Reservation:
    transfer_id: str
    mm_hash: str
    reservation_id: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    expires_at: float
    state: str = "writing"  # writing, ready, cancelled, expired


class Rank:
    """One consumer rank: a landing pool registered with its own TransferEngine, and a REP control socket."""

    def __init__(self, consumer: ConsumerStandIn, port: int | None, pool_bytes: int) -> None:
        from mooncake.engine import TransferEngine

        self.consumer = consumer
        self.port = port  # None: a port the system picks when the rank binds
        self.engine = TransferEngine()
        assert self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        self.pool = torch.zeros(pool_bytes, dtype=torch.uint8)
        assert self.engine.register_memory(self.pool.data_ptr(), pool_bytes) == 0
        self.next_offset = 0
        self.reservations: dict[str, Reservation] = {}
        self.received: dict[str, torch.Tensor] = {}
        self.lock = threading.Lock()

    @property
    def session(self) -> str:
        return f"127.0.0.1:{self.engine.get_rpc_port()}"

    def expire(self) -> None:
        now = time.monotonic()
        for record in self.reservations.values():
            if record.state == "writing" and now >= record.expires_at:
                record.state = "expired"

    def reserve(self, item: dict) -> dict:
        dtype = getattr(torch, str(item["dtype"]))
        shape = tuple(int(value) for value in item["shape"])
        nbytes = int(item["nbytes"])
        if math.prod(shape) * dtype.itemsize != nbytes:
            raise ValueError("shape and dtype do not match nbytes")
        if self.consumer.full:
            raise RuntimeError("EC consumer buffer pool is full")
        transfer_id = str(item["transfer_id"])
        with self.lock:
            self.expire()
            existing = self.reservations.get(transfer_id)
            if existing is not None and existing.state in ("writing", "ready"):
                record = existing
            else:
                if self.next_offset + nbytes > self.pool.numel():
                    self.next_offset = 0  # a ring: tests never hold more than the pool at once
                    if nbytes > self.pool.numel():
                        raise RuntimeError("EC consumer buffer pool is full")
                record = Reservation(transfer_id, str(item["mm_hash"]), uuid.uuid4().hex, self.next_offset, nbytes,
                                     shape, str(item["dtype"]), time.monotonic() + self.consumer.ttl_s)
                self.next_offset += nbytes
                self.reservations[transfer_id] = record
        return {"reservation_id": record.reservation_id, "dst_session": self.session,
                "dst_ptr": self.pool.data_ptr() + record.offset, "nbytes": nbytes,
                "write": record.state == "writing", "ready": record.state == "ready", "cached": False}

    def complete(self, item: dict) -> dict:
        with self.lock:
            self.expire()
            record = self.reservations.get(str(item["transfer_id"]))
            if record is None or record.reservation_id != str(item["reservation_id"]) or record.state != "writing":
                return {"completed": False, "became_ready": False}
            record.state = "ready"
            raw = self.pool[record.offset:record.offset + record.nbytes].clone()
            self.received[record.transfer_id] = raw.view(getattr(torch, record.dtype)).reshape(record.shape)
            return {"completed": True, "became_ready": True}

    def cancel(self, request: dict) -> dict:
        with self.lock:
            record = self.reservations.get(str(request["transfer_id"]))
            if record is None or record.state in ("cancelled", "expired"):
                return {"cancelled": record is not None}
            record.state = "cancelled"
            self.consumer.cancels.append(record.transfer_id)
            return {"cancelled": True}

    def handle(self, request: dict):
        op = request.get("op")
        if op == "peers":
            return {"ports": [rank.port for rank in self.consumer.ranks]}
        if op in ("reserve", "reserve_batch"):
            items = request["items"] if op == "reserve_batch" else [request]
            results = []
            for item in items:
                try:
                    results.append({"ok": True, "result": self.reserve(item)})
                except Exception as exc:  # noqa: BLE001 - answered as the consumer answers
                    results.append({"ok": False, "error": str(exc)})
            if op == "reserve":
                if not results[0]["ok"]:
                    raise RuntimeError(results[0]["error"])
                return results[0]["result"]
            return {"items": results}
        if op in ("complete", "complete_batch"):
            items = request["items"] if op == "complete_batch" else [request]
            results = [self.complete(item) for item in items]
            return {"items": results} if op == "complete_batch" else results[0]
        if op == "cancel":
            return self.cancel(request)
        if op == "status":
            record = self.reservations.get(str(request["transfer_id"]))
            return None if record is None else {"mm_hash": record.mm_hash, "ready": record.state == "ready"}
        raise ValueError(f"unknown control op: {op!r}")

    def serve(self, context: zmq.Context, stop: threading.Event, bound: threading.Event) -> None:
        socket = context.socket(zmq.REP)
        socket.setsockopt(zmq.RCVTIMEO, 50)
        socket.setsockopt(zmq.LINGER, 0)
        if self.port is None:
            self.port = socket.bind_to_random_port("tcp://127.0.0.1")
        else:
            socket.bind(f"tcp://127.0.0.1:{self.port}")
        bound.set()
        try:
            while not stop.is_set():
                try:
                    request = socket.recv_json()
                except zmq.Again:
                    continue
                self.consumer.requests.append(request.get("op"))
                try:
                    socket.send_json({"ok": True, "result": self.handle(request)})
                except Exception as exc:  # noqa: BLE001
                    socket.send_json({"ok": False, "error": str(exc)})
                if self.consumer.die_after_reserve and request.get("op", "").startswith("reserve"):
                    time.sleep(0.02)  # the answer leaves; nothing after it is answered or lands
                    os._exit(0)
        finally:
            socket.close(linger=0)

    def close(self) -> None:
        self.engine.unregister_memory(self.pool.data_ptr())


class ConsumerStandIn:
    """`ranks` consumer ranks on loopback, a context manager: rank 0 (the control address the producer is given)
    on `port`, the others on ports the system picks as they bind (`peers` names them all). Not `port + 1`:
    another test worker may hold it, as a loaded run once found."""

    def __init__(self, port: int, ranks: int = 1, pool_bytes: int = 64 << 20, ttl_s: float = 300.0,
                 die_after_reserve: bool = False) -> None:
        self.ttl_s = ttl_s
        self.full = False
        self.die_after_reserve = die_after_reserve
        self.requests: list[str] = []
        self.cancels: list[str] = []
        self.ranks = [Rank(self, port if index == 0 else None, pool_bytes) for index in range(ranks)]
        self.address = f"tcp://127.0.0.1:{port}"
        self._context = zmq.Context()
        self._stop = threading.Event()
        self._threads = []

    def __enter__(self) -> ConsumerStandIn:
        for rank in self.ranks:
            bound = threading.Event()
            thread = threading.Thread(target=rank.serve, args=(self._context, self._stop, bound), daemon=True)
            thread.start()
            assert bound.wait(10)
            self._threads.append(thread)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        for rank in self.ranks:
            rank.close()
        self._context.term()

    def received(self, transfer_id: str) -> list[torch.Tensor]:
        """What each rank holds for `transfer_id` (every rank gets the whole item, as vLLM's TP ranks do)."""
        return [rank.received[transfer_id] for rank in self.ranks if transfer_id in rank.received]


if __name__ == "__main__":
    with ConsumerStandIn(int(sys.argv[1]), die_after_reserve="--die-after-reserve" in sys.argv) as consumer:
        print("ready", flush=True)
        while True:
            time.sleep(1)
