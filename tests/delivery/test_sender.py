"""`EmbeddingSender` on its own, in-process over loopback: the non-blocking fast path, waiting for a
peer or for room under the high-water mark, the bounded send timeout, and zero-copy lifetimes."""

from __future__ import annotations

import asyncio
import gc
import socket
import time

import pytest
import torch
import zmq

from encode_server.delivery.sockets import DeliveryError, EmbeddingSender
from encode_server.models.dtypes import raw_bytes as payload_view

pytestmark = pytest.mark.quick


def pull_socket(rcvhwm: int = 1000) -> tuple[zmq.Socket, str]:
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.RCVHWM, rcvhwm)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    return pull, f"tcp://127.0.0.1:{port}"


async def receive(pull: zmq.Socket, count: int, timeout_s: float = 10.0) -> list[list[bytes]]:
    """Read `count` messages without blocking the loop (the sender shares it)."""
    messages, deadline = [], time.monotonic() + timeout_s
    while len(messages) < count:
        assert time.monotonic() < deadline, f"only {len(messages)} of {count} messages arrived"
        if pull.poll(0):
            messages.append(pull.recv_multipart())
        else:
            await asyncio.sleep(0.001)
    return messages


def test_connected_peer_gets_header_and_payload_bytes():
    pull, endpoint = pull_socket()
    sender = EmbeddingSender(send_timeout_s=5)
    tensor = torch.arange(4 * 300 * 1024, dtype=torch.float32).reshape(-1, 1024)  # 4.7 MB: zero-copy

    async def scenario():
        sent = await sender.send([endpoint], [b'{"h":1}', payload_view(tensor)])
        return sent, await receive(pull, 1)

    try:
        sent, [[header, payload]] = asyncio.run(scenario())
    finally:
        sender.close()
        pull.close(0)
    assert sent == tensor.numel() * 4 and header == b'{"h":1}' and payload == tensor.numpy().tobytes()


def test_no_peer_fails_after_the_send_timeout_and_not_before():
    # A bound socket that does not listen holds the port: connections are refused, no other socket can take
    # it, and the sender's own connection cannot pick it as its source port (a freed port in the ephemeral
    # range can be connected to itself by TCP's simultaneous open, and the send then "succeeds").
    reservation = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    reservation.bind(("127.0.0.1", 0))
    endpoint = f"tcp://127.0.0.1:{reservation.getsockname()[1]}"
    sender = EmbeddingSender(send_timeout_s=0.4)

    async def scenario():
        started = time.monotonic()
        with pytest.raises(DeliveryError) as caught:
            await sender.send([endpoint], [b"h", b"x" * 100])
        return time.monotonic() - started, caught.value

    try:
        elapsed, error = asyncio.run(scenario())
    finally:
        sender.close()
        reservation.close()
    assert 0.4 <= elapsed < 2.0
    assert endpoint in error.failures and "within 0.4 s" in error.failures[endpoint]


def test_a_send_waiting_for_its_peer_goes_out_once_the_peer_binds():
    # The port is held by a bound socket that does not listen (connections are refused), so that no other
    # test's socket, in this process or another worker, can take it while the send waits.
    reservation = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    reservation.bind(("127.0.0.1", 0))
    endpoint = f"tcp://127.0.0.1:{reservation.getsockname()[1]}"
    sender = EmbeddingSender(send_timeout_s=10)

    async def scenario():
        sending = asyncio.ensure_future(sender.send([endpoint], [b"late", b"y" * (1 << 20)]))
        await asyncio.sleep(0.3)
        assert not sending.done()  # waiting, not failed, not busy-looping the send
        late = zmq.Context.instance().socket(zmq.PULL)
        late.setsockopt(zmq.LINGER, 0)
        reservation.close()
        late.bind(endpoint)
        try:
            await asyncio.wait_for(sending, 8)
            return await receive(late, 1)
        finally:
            late.close(0)

    try:
        [[header, payload]] = asyncio.run(scenario())
    finally:
        sender.close()
    assert header == b"late" and len(payload) == 1 << 20


def test_many_sends_beyond_the_high_water_mark_all_arrive_as_the_peer_drains():
    """Edge-triggered wake-ups: each waiting send must go out when room appears, none may hang."""
    pull, endpoint = pull_socket(rcvhwm=1)
    sender = EmbeddingSender(send_timeout_s=10, high_water_mark=1)
    count = 60

    async def scenario():
        sends = [asyncio.ensure_future(sender.send([endpoint], [str(i).encode(), b"z" * (256 << 10)]))
                 for i in range(count)]
        await asyncio.sleep(0.2)
        waiting = sum(not send.done() for send in sends)
        messages = await receive(pull, count)
        await asyncio.wait_for(asyncio.gather(*sends), 5)
        return waiting, messages

    try:
        waiting, messages = asyncio.run(scenario())
    finally:
        sender.close()
        pull.close(0)
    assert waiting > count // 2  # most had to wait for room: the slow path was exercised
    assert sorted(int(header) for header, _ in messages) == list(range(count))


def test_fan_out_reports_only_the_dead_destination():
    alive, alive_endpoint = pull_socket()
    dead, dead_endpoint = pull_socket()
    dead.close(0)
    sender = EmbeddingSender(send_timeout_s=0.3)

    async def scenario():
        with pytest.raises(DeliveryError) as caught:
            await sender.send([alive_endpoint, dead_endpoint], [b"h", b"p" * 1000])
        return caught.value, await receive(alive, 1)

    try:
        error, [[_, payload]] = asyncio.run(scenario())
    finally:
        sender.close()
        alive.close(0)
    assert list(error.failures) == [dead_endpoint] and payload == b"p" * 1000


def test_the_payload_outlives_the_callers_references_until_sent():
    pull, endpoint = pull_socket(rcvhwm=1)
    sender = EmbeddingSender(send_timeout_s=5, high_water_mark=1)
    expected = []

    async def scenario():
        for seed in range(8):  # queued deeper than the peer reads: libzmq holds the buffers for a while
            batch = torch.full((64, 1024), float(seed))  # the batch tensor; each send is a view of it
            expected.append(batch[8:40].numpy().tobytes())
            await sender.send([endpoint], [str(seed).encode(), payload_view(batch[8:40])])
            del batch
        gc.collect()
        torch.full((1 << 22,), -1.0)  # reuse freed memory if anything was released early
        return await receive(pull, 8)

    try:
        messages = asyncio.run(scenario())
    finally:
        sender.close()
        pull.close(0)
    assert [payload for _, payload in messages] == expected
