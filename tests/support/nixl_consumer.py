"""A stand-in for vLLM's `ECCPUConnector` consumer (P2P mode), speaking its protocol with NIXL itself.

What vLLM 0.33's `ConsumerSession` and `NixlDataTransport` do, in the order they do it: a NIXL agent
with a registered region of blocks of the producer's block size and a prepared local descriptor list;
per read an `XferReq` (msgpack `{"type": "req", "mm_hash", "compatibility_hash", "session_id"}`, the
connector version left out as msgspec leaves a default out) from a DEALER socket; on an `OK` ack the
producer's agent is added (once per metadata), its per-block descriptors prepared, and one READ of the
acked block indices into local blocks posted with the notification `"{session_id}:{mm_hash}"`; the
rows are the first `rows * width` elements of the local blocks. vLLM's own consumer code is driven by
`tools/compat/vllm_cpu_compat.py`.

Run as a process (`python -m tests.support.nixl_consumer HOST PORT MM_HASH HASH BLOCK_SIZE`) it asks for one item
and kills itself once the ack is in, before reading: a consumer that dies mid-transfer (it needs no NIXL
agent for that, so it starts none, nor imports torch).
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import signal
import sys
import time
import uuid
from typing import TYPE_CHECKING

import msgpack
import numpy as np
import zmq

if TYPE_CHECKING:
    import torch


def consumer_compatibility_hash(vllm_version: str, model: str, dtype: str, block_size: int) -> str:
    """The hash a vLLM consumer sends with each read, computed on the consumer's side from its own factors
    (vLLM's `compute_ec_compatibility_hash`: sha256 of the compact JSON list), as the real consumer does rather
    than asking the producer."""
    return hashlib.sha256(json.dumps([vllm_version, model, dtype, block_size],
                                     separators=(",", ":")).encode("utf-8")).hexdigest()


class NixlConsumer:
    def __init__(self, block_size: int, compatibility_hash: str, num_blocks: int = 4096, agent: bool = True) -> None:
        self.block_size, self.num_blocks = block_size, num_blocks
        self.compatibility_hash = compatibility_hash
        self.session_id = str(uuid.uuid4())
        self._context = zmq.Context()
        self._dealers: dict[tuple[str, int], zmq.Socket] = {}
        if not agent:  # asks only (a consumer that dies before it reads needs no NIXL)
            return
        from nixl._api import nixl_agent, nixl_agent_config

        from encode_server.transport.nixl import block_descriptors, quiet_ucx_exit

        quiet_ucx_exit()
        self.agent = nixl_agent(f"consumer-{self.session_id}", nixl_agent_config(backends=["UCX"]))
        self._map = mmap.mmap(-1, num_blocks * block_size)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        base = self._bytes.ctypes.data
        self._registration = self.agent.get_reg_descs([(base, num_blocks * block_size, 0, "")], "DRAM")
        self.agent.register_memory(self._registration, backends=["UCX"])
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self.agent.get_xfer_descs(
            block_descriptors(base, num_blocks, block_size), "DRAM"))
        self._peers: dict[bytes, tuple[str, object]] = {}  # producer metadata -> (agent name, its prepared dlist)
        self._next_block = 0

    def ask(self, host: str, port: int, mm_hash: str, **fields) -> dict:
        """One XferReq and its XferAck (`fields` override the request's, to inject faults)."""
        dealer = self._dealers.get((host, port))
        if dealer is None:
            dealer = self._context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVTIMEO, 10_000)
            dealer.connect(f"tcp://{host}:{port}")
            self._dealers[(host, port)] = dealer
        request = {"type": "req", "mm_hash": mm_hash, "compatibility_hash": self.compatibility_hash,
                   "session_id": self.session_id, **fields}
        dealer.send_multipart([b"", msgpack.packb(request)])
        empty, payload = dealer.recv_multipart()
        assert empty == b""
        return msgpack.unpackb(payload, raw=False)

    def read(self, entry: dict, mm_hash: str, dtype: torch.dtype, ack: dict | None = None,
             blocks: int | None = None) -> torch.Tensor | dict:
        """Read the item an `ec_transfer_params` entry announces; its rows, or the NACK ack. `blocks` reads only
        that many of the acked blocks (a short block list) and gives their elements, flat."""
        import torch

        ack = ack or self.ask(entry["peer_host"], int(entry["peer_port"]), mm_hash)
        if ack["status"] != 0:
            return ack
        local = self.pull(ack, mm_hash, blocks)
        count = len(local)
        start = local[0] * self.block_size
        flat = torch.from_numpy(self._bytes[start:start + count * self.block_size].copy()).view(dtype)
        if blocks is not None:
            return flat
        rows, width = entry["shape"]
        return flat[:rows * width].reshape(rows, width)

    def pull(self, ack: dict, mm_hash: str, blocks: int | None = None) -> list[int]:
        """The READ an OK ack grants, with its notification, into consecutive local blocks; those blocks."""
        source = list(ack["src_block_indices"])[:blocks]
        count = len(source)
        if self._next_block + count > self.num_blocks:
            self._next_block = 0
        local = list(range(self._next_block, self._next_block + count))
        self._next_block += count
        peer = self._peers.get(ack["agent_metadata"])
        if peer is None:
            name = self.agent.add_remote_agent(ack["agent_metadata"])
            remote = self.agent.prep_xfer_dlist(name, self.agent.get_xfer_descs(
                [tuple(desc) for desc in msgpack.unpackb(ack["mem_descriptor"])], "DRAM"))
            peer = self._peers[ack["agent_metadata"]] = (name, remote)
        handle = self.agent.make_prepped_xfer("READ", self._local, local, peer[1], source,
                                              notif_msg=f"{self.session_id}:{mm_hash}".encode())
        self.agent.transfer(handle)
        deadline = time.monotonic() + 20
        while (state := self.agent.check_xfer_state(handle)) == "PROC":
            if time.monotonic() > deadline:
                raise TimeoutError(f"the NIXL read of {mm_hash} did not complete")
            time.sleep(0.0001)
        self.agent.release_xfer_handle(handle)
        assert state == "DONE", state
        return local

    def close(self) -> None:
        for dealer in self._dealers.values():
            dealer.close(0)
        self._context.term()
        for name, remote in self._peers.values():
            self.agent.release_dlist_handle(remote)
            self.agent.remove_remote_agent(name)
        self.agent.release_dlist_handle(self._local)
        self.agent.deregister_memory(self._registration, backends=["UCX"])

    def __enter__(self) -> NixlConsumer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def blocks_of(size_bytes: int, block_size: int) -> int:
    return max(1, math.ceil(size_bytes / block_size))


if __name__ == "__main__":
    host, port, mm_hash, compat, block_size = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    consumer = NixlConsumer(block_size, compat, agent=False)
    answer = consumer.ask(host, port, mm_hash)
    print(f"acked {answer['status']}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # dies holding the producer's pin, before the read
