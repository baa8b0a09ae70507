"""The prefill side: receive embeddings from encoders over ZMQ (imports no FastAPI).

`EmbeddingReceiver` binds a PULL socket, collects the parts of each request as they arrive (from
one or several encoders), merges them in `part_idx` order, and hands back a torch tensor and its
metadata by `req_id`, blocking (`get`) or async (`aget`). An error header raises
`EmbeddingError`; waiting too long raises `TimeoutError`. Embeddings nobody claims are dropped
after `ttl_s`, and the oldest go first when more than `max_bytes` are held.

A message in SGLang's wire format (an encoder started with `--wire-format sglang`: frame 0 is a
pickle, which starts with byte 0x80; ours is a JSON object, `{`) is recognised by that first byte and
never unpickled. Its request id cannot be read, so the receiver fails every waiting `get`/`aget` at
once with `WireFormatMismatch`, naming the fix, and every later one too, until a native message
arrives again (requests already received whole are still handed out).

    receiver = EmbeddingReceiver()                 # binds tcp://127.0.0.1:<free port>
    ...post /encode with embedding_port=receiver.port, or register receiver.endpoint...
    result = receiver.get("req-1", timeout=30)     # result.tensor: [tokens, dim]
    result.main, result.deepstack                  # Qwen3-VL: [tokens, hidden] and k such views
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from encode_server.delivery.wire import Header, WireError, decode_header, is_wildcard_host
from encode_server.models.dtypes import DTYPES, raw_bytes

log = logging.getLogger("encode_server.receiver")

#: Payloads from this size on get a buffer of their own from ZMQ (larger than its 8 KiB receive batch, so
#: malloc-aligned) and become the returned tensor without a copy; smaller ones may sit at any offset of
#: ZMQ's shared receive buffer, so they are copied into a fresh (aligned) tensor.
_ZERO_COPY_BYTES = 64 << 10


#: The first byte of a pickle of protocol 2 or later (SGLang's frame 0); a native header starts with `{`.
PICKLE_START = 0x80

MISMATCH_MESSAGE = (
    "a message in SGLang's wire format (frame 0 is a pickle) reached this receiver, which reads the native format "
    "(a JSON header, docs/CONTRACT.md section 3): start the encoder with --wire-format native (the default), or "
    "receive with SGLang's own receiver (an unchanged SGLang prefill server); this receiver's requests fail until "
    "a native message arrives")


class WireFormatMismatch(RuntimeError):
    """Messages in SGLang's pickled wire format reach this native receiver: no request can be read from them."""


class EmbeddingError(RuntimeError):
    """The encoder reported that this request failed (the header's `error`)."""

    def __init__(self, req_id: str, code: Any, message: str) -> None:
        super().__init__(f"{req_id}: encoder error {code}: {message}")
        self.req_id = req_id
        self.code = code
        self.message = message


@dataclass
class ReceivedEmbedding:
    """A whole request: its parts merged in order, and what the encoder said about them."""

    req_id: str
    tensor: torch.Tensor
    modality: str
    dtype: str
    items: list[dict[str, Any]]
    num_parts: int
    #: Deepstack blocks after the main features in each row (the header's `deepstack`, 0 when absent).
    num_deepstack: int = 0

    @property
    def main(self) -> torch.Tensor:
        """The main features, `[tokens, hidden]` (a view; the whole tensor when there is no deepstack)."""
        return self._blocks()[0]

    @property
    def deepstack(self) -> list[torch.Tensor]:
        """The deepstack features, `num_deepstack` views of `[tokens, hidden]`, in layer order."""
        return list(self._blocks()[1:])

    def _blocks(self) -> tuple[torch.Tensor, ...]:
        if self.num_deepstack == 0:
            return (self.tensor,)
        return torch.split(self.tensor, self.tensor.shape[-1] // (1 + self.num_deepstack), dim=-1)


@dataclass
class _Pending:
    """Parts of one request received so far."""

    created: float
    num_parts: int
    parts: dict[int, tuple[Header, torch.Tensor]] = field(default_factory=dict)
    error: EmbeddingError | None = None
    nbytes: int = 0

    @property
    def complete(self) -> bool:
        return self.error is not None or len(self.parts) == self.num_parts


class EmbeddingReceiver:
    """A PULL socket and a background thread that assembles requests by `req_id`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, ttl_s: float = 120.0,
                 max_bytes: int = 4 << 30, context: zmq.Context | None = None) -> None:
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._context = context or zmq.Context.instance()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        if ":" in host:
            self._socket.setsockopt(zmq.IPV6, 1)
        bind_host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        if port == 0:
            self.port = self._socket.bind_to_random_port(f"tcp://{bind_host}")
        else:
            self._socket.bind(f"tcp://{bind_host}:{port}")
            self.port = port
        self.host = host
        self._stop_url = f"inproc://receiver-stop-{id(self)}"
        self._stop_pull = self._context.socket(zmq.PAIR)
        self._stop_pull.bind(self._stop_url)
        self._lock = threading.Condition()
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._held_bytes = 0
        self._closed = False
        #: Set while the last message that arrived was in SGLang's wire format; cleared by a native one.
        self._mismatch: str | None = None
        #: Messages in SGLang's wire format received so far (dropped unread).
        self.foreign_messages = 0
        self._thread = threading.Thread(target=self._run, name=f"embedding-receiver-{self.port}", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """A routable `tcp://host:port` for encoders (a wildcard bind advertises this host's address)."""
        host = self.host
        if is_wildcard_host(host):
            host = socket.gethostbyname(socket.gethostname())
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"tcp://{host}:{self.port}"

    @property
    def mismatch(self) -> str | None:
        """While messages in SGLang's wire format arrive here (requests then fail for it), what is wrong."""
        return self._mismatch

    # --- receiving ----------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._stop_pull, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(timeout=self._next_expiry_ms()))
                if self._stop_pull in ready:
                    return
                if self._socket in ready:
                    # Take everything already queued before polling again.
                    while self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        self._receive_one()
                self._evict()
        except zmq.ContextTerminated:
            return
        finally:
            self._socket.close(0)
            self._stop_pull.close(0)

    def _receive_one(self) -> None:
        """Read one message; a large payload becomes the returned tensor without a copy."""
        frames = self._socket.recv_multipart(copy=False)
        first = frames[0].buffer
        if len(first) and first[0] == PICKLE_START:  # SGLang's frame 0; never unpickled
            self._foreign()
            return
        if len(frames) != 2:
            log.warning("dropping a message of %d frames (expected 2)", len(frames))
            return
        try:
            header = decode_header(frames[0].bytes)
        except WireError as exc:
            log.warning("dropping a message with a bad header: %s", exc)
            return
        payload = frames[1].buffer
        if len(payload) != header.payload_bytes:
            log.warning("dropping %s part %d: %d payload bytes, header says %d",
                        header.req_id, header.part_idx, len(payload), header.payload_bytes)
            return
        tensor = None
        if header.error is None:
            if len(payload) >= _ZERO_COPY_BYTES:
                # A view of ZMQ's own message buffer, which the tensor keeps alive.
                tensor = torch.frombuffer(payload, dtype=DTYPES[header.dtype]).view(header.shape)
            else:
                tensor = torch.empty(header.shape, dtype=DTYPES[header.dtype])
                raw_bytes(tensor)[:] = payload
        self._accept(header, tensor)

    def _foreign(self) -> None:
        """A message in SGLang's wire format: fail the waiting requests (their ids are inside the pickle)."""
        with self._lock:
            self.foreign_messages += 1
            if self._mismatch is None:
                log.error("%s", MISMATCH_MESSAGE)
            self._mismatch = MISMATCH_MESSAGE
            self._lock.notify_all()

    def _next_expiry_ms(self) -> int | None:
        with self._lock:
            if not self._pending:
                return None
            oldest = next(iter(self._pending.values())).created
        return max(0, int((oldest + self.ttl_s - time.monotonic()) * 1000) + 1)

    def _accept(self, header: Header, tensor: torch.Tensor | None) -> None:
        with self._lock:
            if self._mismatch is not None:
                log.info("native messages arrive again: requests are no longer failed for the wire format")
                self._mismatch = None
            pending = self._pending.get(header.req_id)
            if pending is None:
                pending = self._pending[header.req_id] = _Pending(time.monotonic(), header.num_parts)
            if header.error is not None:
                error = header.error if isinstance(header.error, dict) else {"message": str(header.error)}
                pending.error = EmbeddingError(header.req_id, error.get("code"), str(error.get("message")))
            elif header.part_idx not in pending.parts and tensor is not None:
                pending.parts[header.part_idx] = (header, tensor)
                pending.nbytes += header.payload_bytes
                self._held_bytes += header.payload_bytes
            self._lock.notify_all()

    def _evict(self) -> None:
        """Drop unclaimed requests past their time-to-live, then the oldest beyond the byte budget."""
        horizon = time.monotonic() - self.ttl_s
        with self._lock:
            # `_pending` is in arrival order, so the expired ones are at its front.
            while self._pending and next(iter(self._pending.values())).created < horizon:
                self._drop(next(iter(self._pending)))
            while self._held_bytes > self.max_bytes and self._pending:
                self._drop(next(iter(self._pending)))

    def _drop(self, req_id: str) -> None:
        pending = self._pending.pop(req_id)
        self._held_bytes -= pending.nbytes

    # --- claiming -----------------------------------------------------------------------------

    def get(self, req_id: str, timeout: float | None = None) -> ReceivedEmbedding:
        """Wait for every part of `req_id`; raises `EmbeddingError`, `TimeoutError`, or `WireFormatMismatch` while
        the messages arriving are in SGLang's wire format (see the module's docstring)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._evict()  # past its time-to-live is gone, even if the receiving thread has not woken yet
        with self._lock:
            while True:
                pending = self._pending.get(req_id)
                if pending is not None and pending.complete:
                    self._drop(req_id)
                    break
                if self._closed:
                    raise RuntimeError("receiver is closed")
                if self._mismatch is not None:
                    raise WireFormatMismatch(self._mismatch)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no complete embedding for {req_id!r} within {timeout} s")
                self._lock.wait(remaining)
        if pending.error is not None:
            raise pending.error
        parts = [pending.parts[index] for index in range(pending.num_parts)]
        tensors = [tensor for _, tensor in parts]
        first = parts[0][0]
        if any(header.deepstack != first.deepstack for header, _ in parts):
            raise EmbeddingError(req_id, "wire", "the parts disagree on the number of deepstack blocks: "
                                 f"{[header.deepstack for header, _ in parts]}")
        return ReceivedEmbedding(
            req_id=req_id, tensor=torch.cat(tensors) if len(tensors) > 1 else tensors[0], modality=first.modality,
            dtype=first.dtype, items=[item for header, _ in parts for item in header.items],
            num_parts=pending.num_parts, num_deepstack=first.deepstack,
        )

    async def aget(self, req_id: str, timeout: float | None = None) -> ReceivedEmbedding:
        """`get` without blocking the event loop."""
        return await asyncio.to_thread(self.get, req_id, timeout)

    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        stop = self._context.socket(zmq.PAIR)
        stop.connect(self._stop_url)
        stop.send(b"")
        self._thread.join(timeout=5)
        stop.close(0)

    def __enter__(self) -> EmbeddingReceiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
