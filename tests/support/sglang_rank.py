"""One receiver rank of SGLang's `mooncake` encoder transfer backend, as SGLang 0.5.23's `WaitingRDMARequest`
behaves: a landing buffer registered with its own Mooncake TransferEngine, and a ZMQ PULL socket for the
`EmbeddingData` frame; `receive` runs its HTTP steps (`/scheduler_receive_meta_data`, `/send`)."""

from __future__ import annotations

import httpx
import torch
import zmq

from tests.support.sglang_frames import load


class Rank:
    """One SGLang receiver rank: a landing buffer registered with its own TransferEngine, and a PULL socket."""

    def __init__(self, buffer_bytes: int = 1 << 20) -> None:
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        assert self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        self.buffer = torch.zeros(buffer_bytes, dtype=torch.uint8)
        assert self.engine.register_memory(self.buffer.data_ptr(), buffer_bytes) == 0
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.RCVTIMEO, 10_000)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")

    @property
    def session(self) -> str:
        return f"127.0.0.1:{self.engine.get_rpc_port()}"

    def receive(self, url: str, req_id: str, part_idx: int = 0, receive_count: int = 1, offset: int = 0):
        """The receiver's steps for one part: pull the sizes, have the rows written at `offset`, take the frame."""
        sizes = httpx.post(f"{url}/scheduler_receive_meta_data", json={"req_id": req_id, "part_idx": part_idx},
                           timeout=60)
        assert sizes.status_code == 200, sizes.text
        meta = sizes.json()
        sent = httpx.post(f"{url}/send", json={**meta, "prefill_host": "127.0.0.1", "embedding_port": self.port,
                                                "session_id": self.session,
                                                "buffer_address": self.buffer.data_ptr() + offset,
                                                "receive_count": receive_count}, timeout=60)
        assert sent.status_code == 200, sent.text
        frames = self.socket.recv_multipart()
        assert len(frames) == 1  # the frame carries no tensor: the rows are in the buffer already
        header = load(frames[0])
        rows = self.buffer[offset:offset + meta["embedding_size"]].clone().view(torch.float32)
        return meta, header, rows.reshape(meta["embedding_len"], meta["embedding_dim"])

    def close(self) -> None:
        self.engine.unregister_memory(self.buffer.data_ptr())
        self.socket.close(linger=0)
        self.context.term()
