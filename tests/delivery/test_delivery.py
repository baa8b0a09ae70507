"""Embedding delivery over ZMQ (docs/CONTRACT.md, sections 2 and 3): the wire, fan-out to the ranks of a
prefill node, registrations, parts from two encoders, restarts, and undeliverable destinations."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
import torch
import zmq

from encode_server.delivery.sglang_wire import SglangWire
from encode_server.delivery.wire import HEADER_KEYS, Header
from encode_server.models import ItemLayout
from encode_server.receiver import EmbeddingError, EmbeddingReceiver, WireFormatMismatch
from encode_server.records import EncodedPart, PartMeta
from tests.support.helpers import ROOT, InProcessServer, free_port, image_b64, push

SEND_TIMEOUT = 1.5


@pytest.fixture(scope="module")
def server():
    with InProcessServer("--send-timeout-s", str(SEND_TIMEOUT)) as process:
        yield process


def encode(server, **body) -> httpx.Response:
    body = {"modality": "image", "mm_items": [image_b64(56, 84, seed=1)], **body}
    return httpx.post(server.url + "/encode", json=body, timeout=60)


def inline_bytes(response: httpx.Response) -> bytes:
    return base64.b64decode(response.json()["embedding"])


# --- the wire, read with plain pyzmq ----------------------------------------------------------

def test_golden_wire_format_with_a_plain_pull_socket(server):
    context = zmq.Context.instance()
    pull = context.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    try:
        response = encode(server, req_id="golden", prefill_host="127.0.0.1", embedding_port=port,
                          return_embedding=True, num_parts=3, part_idx=1)
        assert response.status_code == 200, response.text
        assert pull.poll(5000)
        frames = pull.recv_multipart()
        assert len(frames) == 2
        header = json.loads(frames[0].decode("utf-8"))
        assert tuple(sorted(header)) == tuple(sorted(HEADER_KEYS))
        assert header == {"v": 1, "req_id": "golden", "part_idx": 1, "num_parts": 3, "modality": "image",
                          "dtype": "float32", "shape": [6, 128], "items": [{"tokens": 6, "grid_thw": [1, 6, 4]}],
                          "error": None}
        assert frames[1] == inline_bytes(response)
        assert len(frames[1]) == 6 * 128 * 4
    finally:
        pull.close(0)


def test_error_header_reaches_the_destination(server):
    with EmbeddingReceiver() as receiver:
        response = encode(server, req_id="broken", mm_items=["%%%"], prefill_host="127.0.0.1",
                          embedding_port=receiver.port)
        assert response.status_code == 400
        with pytest.raises(EmbeddingError) as caught:
            receiver.get("broken", timeout=5)
        assert caught.value.code == 400 and "mm_items[0]" in caught.value.message


# --- fan-out: two receiver processes standing for two TP ranks of one prefill node -------------

def start_receiver_process(tmp_path, name: str, req_id: str, port: int = 0):
    out = tmp_path / f"{name}.json"
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.receiver_process", str(out), req_id, str(port)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    endpoint = proc.stdout.readline().strip()
    assert endpoint.startswith("tcp://127.0.0.1:"), endpoint
    return proc, out, endpoint


def test_two_rank_processes_get_identical_bytes_through_registration(server, tmp_path):
    ranks = [start_receiver_process(tmp_path, f"rank{i}", "tp-req") for i in range(2)]
    try:
        for _, _, endpoint in ranks:
            registered = httpx.post(server.url + "/scheduler_receive_url", json={
                "req_id": "tp-req", "receive_url": endpoint, "receive_count": 2})
            assert registered.status_code == 200, registered.text
        assert registered.json()["registered"] == 2
        response = encode(server, req_id="tp-req", return_embedding=True)
        assert response.status_code == 200, response.text
        want = hashlib.sha256(inline_bytes(response)).hexdigest()
        for proc, out, _ in ranks:
            proc.wait(timeout=30)
            got = json.loads(out.read_text())
            assert got["sha256"] == want and got["shape"] == response.json()["embedding_shape"]
            assert got["items"] == response.json()["items"]
    finally:
        for proc, _, _ in ranks:
            proc.kill()


def test_fan_out_to_several_ports_of_one_host(server):
    receivers = [EmbeddingReceiver() for _ in range(3)]
    try:
        response = encode(server, req_id="fan", prefill_host="127.0.0.1",
                          embedding_port=[r.port for r in receivers], return_embedding=True)
        assert response.status_code == 200
        for receiver in receivers:
            assert receiver.get("fan", timeout=5).tensor.numpy().tobytes() == inline_bytes(response)
        assert response.json()["timings_ms"]["transfer"] > 0
    finally:
        for receiver in receivers:
            receiver.close()


def test_registration_arriving_after_the_embedding_still_delivers(server):
    with EmbeddingReceiver() as receiver:
        response = encode(server, req_id="late-reg")
        assert response.status_code == 200
        registered = httpx.post(server.url + "/scheduler_receive_url", json={
            "req_id": "late-reg", "receive_url": receiver.endpoint, "receive_count": 1})
        assert registered.status_code == 200
        assert receiver.get("late-reg", timeout=5).tensor.shape == (6, 128)


def test_incomplete_registrations_give_502_within_the_send_timeout(server):
    with EmbeddingReceiver() as receiver:
        httpx.post(server.url + "/scheduler_receive_url", json={
            "req_id": "half", "receive_url": receiver.endpoint, "receive_count": 2})
        started = time.monotonic()
        response = encode(server, req_id="half")
        assert response.status_code == 502 and "receive_count" in response.json()["message"]
        assert time.monotonic() - started < SEND_TIMEOUT + 2


@pytest.mark.parametrize("body,needle", [
    ({"req_id": "w", "receive_url": "tcp://0.0.0.0:5000"}, "wildcard"),
    ({"req_id": "w", "receive_url": "http://127.0.0.1:5000"}, "tcp://"),
    ({"req_id": "w", "receive_url": "tcp://127.0.0.1:99999"}, "port"),
    ({"receive_url": "tcp://127.0.0.1:5000"}, "req_id"),
    ({"req_id": "w", "receive_url": "tcp://127.0.0.1:5000", "receive_count": 0}, "receive_count"),
])
def test_bad_registrations_are_400(server, body, needle):
    response = httpx.post(server.url + "/scheduler_receive_url", json=body)
    assert response.status_code == 400 and needle in response.json()["message"]


def test_registration_count_clash_is_400(server):
    first = httpx.post(server.url + "/scheduler_receive_url", json={
        "req_id": "clash", "receive_url": "tcp://127.0.0.1:5001", "receive_count": 2})
    second = httpx.post(server.url + "/scheduler_receive_url", json={
        "req_id": "clash", "receive_url": "tcp://127.0.0.1:5002", "receive_count": 3})
    assert first.status_code == 200 and second.status_code == 400


def test_wildcard_and_half_given_destinations_are_400(server):
    assert encode(server, req_id="wild", prefill_host="0.0.0.0", embedding_port=5555).status_code == 400
    for legacy in ("0", "127.1", "2130706433"):
        refused = encode(server, req_id=f"legacy-{legacy}", prefill_host=legacy, embedding_port=5555)
        assert refused.status_code == 400 and "canonical" in refused.json()["message"]
    assert encode(server, req_id="nohost", embedding_port=5555).status_code == 400
    assert encode(server, req_id="noports", prefill_host="127.0.0.1", embedding_port=[]).status_code == 400


# --- parts from two encoders, restarts, dead destinations --------------------------------------

def test_parts_from_two_encoders_merge_in_part_order(server):
    with InProcessServer() as second, EmbeddingReceiver() as receiver:
        images = [image_b64(56, 56, seed=5), image_b64(84, 84, seed=6)]
        common = {"req_id": "parts", "num_parts": 2, "prefill_host": "127.0.0.1", "embedding_port": receiver.port,
                  "return_embedding": True}
        late = encode(second, part_idx=1, mm_items=[images[1]], **common)  # part 1 arrives first
        early = encode(server, part_idx=0, mm_items=[images[0]], **common)
        assert early.status_code == 200 and late.status_code == 200
        merged = receiver.get("parts", timeout=5)
        assert merged.num_parts == 2 and merged.tensor.shape == (4 + 9, 128)
        assert merged.tensor.numpy().tobytes() == inline_bytes(early) + inline_bytes(late)
        assert merged.items == early.json()["items"] + late.json()["items"]


def test_receiver_that_restarts_on_its_port_gets_later_embeddings(server):
    port = free_port()
    with EmbeddingReceiver(port=port) as receiver:
        assert encode(server, req_id="before", prefill_host="127.0.0.1", embedding_port=port).status_code == 200
        assert receiver.get("before", timeout=5).tensor.shape[0] == 6
    down = encode(server, req_id="while-down", prefill_host="127.0.0.1", embedding_port=port)
    assert down.status_code == 502
    with EmbeddingReceiver(port=port) as receiver:
        after = encode(server, req_id="after", prefill_host="127.0.0.1", embedding_port=port)
        assert after.status_code == 200, after.text
        assert receiver.get("after", timeout=5).tensor.shape[0] == 6
        with pytest.raises(TimeoutError):
            receiver.get("while-down", timeout=0.3)  # never queued for the dead peer


def test_dead_destination_is_502_and_does_not_hold_up_others(server):
    dead_port = free_port()

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as client:
            with EmbeddingReceiver() as receiver:
                dead = asyncio.ensure_future(client.post(server.url + "/encode", json={
                    "req_id": "to-dead", "modality": "image", "mm_items": [image_b64(56, 56)],
                    "prefill_host": "127.0.0.1", "embedding_port": dead_port}))
                await asyncio.sleep(0.2)
                started = time.monotonic()
                alive = await client.post(server.url + "/encode", json={
                    "req_id": "to-alive", "modality": "image", "mm_items": [image_b64(56, 56)],
                    "prefill_host": "127.0.0.1", "embedding_port": receiver.port})
                alive_s = time.monotonic() - started
                got = await receiver.aget("to-alive", timeout=5)
                return await dead, alive, alive_s, got

    dead, alive, alive_s, got = asyncio.run(scenario())
    assert dead.status_code == 502 and f"127.0.0.1:{dead_port}" in dead.json()["message"]
    assert alive.status_code == 200 and got.tensor.shape == (4, 128)
    assert alive_s < SEND_TIMEOUT, "a dead destination must not delay other requests"


# --- the receiver library on its own ---------------------------------------------------------

def header(req_id: str, shape=(2, 3), dtype="float32", part_idx=0, num_parts=1, error=None) -> bytes:
    return Header(req_id=req_id, part_idx=part_idx, num_parts=num_parts, modality="image", dtype=dtype,
                  shape=shape, items=[{"tokens": shape[0], "grid_thw": [1, 1, shape[0]]}], error=error).encode()


def test_receiver_returns_bfloat16_and_merges_parts():
    values = torch.arange(6, dtype=torch.float32).reshape(2, 3).to(torch.bfloat16)
    payload = values.view(torch.int16).numpy().tobytes()
    with EmbeddingReceiver() as receiver:
        push(receiver.port, [header("bf", dtype="bfloat16", part_idx=1, num_parts=2), payload],
             [header("bf", dtype="bfloat16", part_idx=0, num_parts=2), payload])
        got = receiver.get("bf", timeout=5)
        assert got.tensor.dtype == torch.bfloat16 and got.tensor.shape == (4, 3)
        assert torch.equal(got.tensor, torch.cat([values, values]))


def test_large_payloads_arrive_whole_and_writable_and_short_ones_are_dropped():
    """Payloads from 64 KiB on take the no-copy path: the tensor must still be exact, writable, and
    outlive the message; a payload shorter than its header says is dropped there too."""
    big = torch.randn(300, 128)  # 150 KiB
    bf16 = torch.randn(600, 64).to(torch.bfloat16)
    with EmbeddingReceiver() as receiver:
        push(receiver.port, [header("cut", shape=(300, 128)), big.numpy().tobytes()[:-4]],
             [header("big", shape=(300, 128)), big.numpy().tobytes()],
             [header("bf-big", shape=(600, 64), dtype="bfloat16"), bf16.view(torch.int16).numpy().tobytes()])
        got = receiver.get("big", timeout=5).tensor
        got_bf16 = receiver.get("bf-big", timeout=5).tensor
        with pytest.raises(TimeoutError):
            receiver.get("cut", timeout=0.1)
    assert torch.equal(got, big) and torch.equal(got_bf16, bf16) and got_bf16.dtype == torch.bfloat16
    got.mul_(2)  # writable, and still valid after the receiver closed
    assert torch.equal(got, big * 2)


def test_receiver_async_get_and_timeout():
    with EmbeddingReceiver() as receiver:
        async def scenario():
            waiter = asyncio.ensure_future(receiver.aget("soon", timeout=5))
            await asyncio.sleep(0.1)
            push(receiver.port, [header("soon"), np.ones((2, 3), "<f4").tobytes()])
            return await waiter

        assert asyncio.run(scenario()).tensor.sum().item() == 6.0
        with pytest.raises(TimeoutError):
            receiver.get("never", timeout=0.2)


def test_receiver_evicts_unclaimed_after_ttl_and_beyond_its_budget():
    with EmbeddingReceiver(ttl_s=0.3) as receiver:
        push(receiver.port, [header("stale"), np.zeros((2, 3), "<f4").tobytes()])
        time.sleep(0.8)
        with pytest.raises(TimeoutError):
            receiver.get("stale", timeout=0.1)
    with EmbeddingReceiver(max_bytes=100) as receiver:
        push(receiver.port, *([header(f"r{i}", shape=(4, 4)), np.zeros((4, 4), "<f4").tobytes()] for i in range(3)))
        assert receiver.get("r2", timeout=5).tensor.shape == (4, 4)  # the newest survives
        with pytest.raises(TimeoutError):
            receiver.get("r0", timeout=0.1)


def test_receiver_drops_malformed_messages_and_keeps_serving():
    with EmbeddingReceiver() as receiver:
        push(receiver.port, [b"not json", b""], [b'{"v": 2}', b""], [header("short"), b"\x00" * 3],
             [b"one frame only"], [header("fine"), np.zeros((2, 3), "<f4").tobytes()])
        assert receiver.get("fine", timeout=5).tensor.shape == (2, 3)
        with pytest.raises(TimeoutError):
            receiver.get("short", timeout=0.1)


def sglang_message(req_id: str, failed: bool = False) -> list[bytes]:
    """What an encoder started with --wire-format sglang sends: a pickled frame 0 (and the raw bytes)."""
    meta, wire = PartMeta(req_id, 0, 1, "image"), SglangWire()
    if failed:
        return [bytes(frame) for frame in wire.failure_frames(meta, 400, "bad image")]
    part = EncodedPart(embedding=torch.zeros(2, 3), layouts=(ItemLayout(2, (1, 2, 4)),), batch_size=1)
    return [bytes(frame) for frame in wire.success_frames(meta, part)]


def test_sglang_frames_fail_every_waiter_at_once_until_a_native_message_arrives():
    """A receiver fed SGLang's pickled frames (the encoder runs --wire-format sglang) cannot read the request
    ids: every pending get fails at once naming the mismatch and the fix, and so does every later one until a
    native message arrives. Requests already received whole are still handed out. Nothing is unpickled."""
    with EmbeddingReceiver() as receiver:
        push(receiver.port, [header("early"), np.ones((2, 3), "<f4").tobytes()])
        assert receiver.get("early", timeout=5) is not None  # claimed before the foreign frames
        # One connection from here on: messages of separate connections may arrive in either order, and "whole"
        # arriving after the foreign frames would be the native message that ends the mismatch.
        sender = zmq.Context.instance().socket(zmq.PUSH)
        sender.connect(f"tcp://127.0.0.1:{receiver.port}")
        sender.send_multipart([header("whole"), np.ones((2, 3), "<f4").tobytes()])
        outcome: dict = {}

        def wait() -> None:
            started = time.monotonic()
            try:
                receiver.get("pending", timeout=30)
            except Exception as exc:  # noqa: BLE001 (the test inspects what was raised)
                outcome["error"], outcome["after_s"] = exc, time.monotonic() - started

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.2)
        sender.send_multipart(sglang_message("pending"))
        waiter.join(timeout=10)
        error = outcome["error"]
        assert isinstance(error, WireFormatMismatch) and outcome["after_s"] < 5
        assert "--wire-format native" in str(error) and "SGLang's own receiver" in str(error)
        with pytest.raises(WireFormatMismatch):  # a later get fails too, at once
            receiver.get("later", timeout=30)
        assert receiver.get("whole", timeout=1).tensor.sum().item() == 6.0  # received before: still handed out
        sender.send_multipart(sglang_message("failed", failed=True))  # SGLang's one-frame failure message
        with pytest.raises(WireFormatMismatch):
            asyncio.run(receiver.aget("later", timeout=30))
        deadline = time.monotonic() + 5
        while receiver.foreign_messages < 2 and time.monotonic() < deadline:  # it may still be on its way
            time.sleep(0.01)
        assert receiver.foreign_messages == 2 and "--wire-format native" in receiver.mismatch
        sender.send_multipart([header("native"), np.zeros((2, 3), "<f4").tobytes()])
        sender.close(linger=2000)
        deadline = time.monotonic() + 5
        while receiver.mismatch is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert receiver.mismatch is None
        assert receiver.get("native", timeout=5).tensor.shape == (2, 3)  # back to normal
        with pytest.raises(TimeoutError):
            receiver.get("later", timeout=0.1)


def test_receiver_imports_without_fastapi():
    code = ("import sys; sys.modules['fastapi'] = None; sys.modules['uvicorn'] = None; "
            "from encode_server.receiver import EmbeddingReceiver; "
            "r = EmbeddingReceiver(); print(r.endpoint); r.close()")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("tcp://127.0.0.1:")


def test_blocking_get_wakes_from_another_thread():
    with EmbeddingReceiver() as receiver:
        timer = threading.Timer(0.2, push, args=(receiver.port, [header("t"), np.zeros((2, 3), "<f4").tobytes()]))
        timer.start()
        assert receiver.get("t", timeout=5).tensor.shape == (2, 3)
        timer.join()
