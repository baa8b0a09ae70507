"""`--grpc-port`: SGLang's gRPC encoder service (docs/CONTRACT.md section 3b) on a real server on loopback,
called with grpcio and the generated stubs of `smg-grpc-proto`, plain pyzmq PULL sockets standing in for
SGLang's tokenizer and scheduler ranks. The rows must be, byte for byte, those `/encode` returns for the same
items: an image, an audio clip and a video (the modality told from the items, as SGLang's request names none).
SGLang's own gRPC receiving code is exercised by tools/compat/sglang_grpc_compat.py (not in CI: it needs SGLang).
"""

from __future__ import annotations

import base64
import threading

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto import sglang_encoder_pb2 as pb
from smg_grpc_proto import sglang_encoder_pb2_grpc as pb_grpc

from encode_server.fronts.sglang.item_modality import item_modality, part_modality
from tests.support.helpers import InProcessServer, Pull, free_port, image_b64
from tests.support.paths import GOLDEN as GOLDEN_ROOT
from tests.support.sglang_frames import load
from tests.support.tiny_parts import wav_b64, waveform

SGLANG_MODALITY = {"image": 1, "video": 2, "audio": 3}


@pytest.fixture(scope="module")
def server():
    with InProcessServer("--model", "tiny-qwen2.5-omni", "--wire-format", "sglang", "--send-timeout-s", "1.5",
                         "--grpc-port", str(free_port())) as process:
        process.grpc = httpx.get(process.url + "/server_info").json()["transport"]["grpc"]["address"]
        yield process


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc) as channel:
        yield pb_grpc.SglangEncoderStub(channel), channel


def items_of(modality: str) -> list[str]:
    if modality == "image":
        return [image_b64(56, 84, seed=3)]
    if modality == "audio":
        return [wav_b64(waveform(1.0, 16000, seed=4), 16000)]
    return [base64.b64encode((GOLDEN_ROOT / "vllm-videos" / "clip.mp4").read_bytes()).decode()]


def inline_rows(server, modality: str, items: list[str], headers: dict | None = None) -> tuple[bytes, dict]:
    body = httpx.post(server.url + "/encode", json={"req_id": f"http-{modality}", "modality": modality,
                                                    "mm_items": items, "return_embedding": True}, timeout=60,
                      headers=headers).json()
    return base64.b64decode(body["embedding"]), body


@pytest.mark.parametrize("modality", ["image", "audio", "video"])
def test_encode_to_the_tokenizer_gives_encodes_rows_bit_identical(server, stub, modality):
    """`zmq_to_tokenizer`: one embedding port; the pushed rows are `/encode`'s, the frame says the modality."""
    items = items_of(modality)
    expected, body = inline_rows(server, modality, items)
    pull = Pull()
    try:
        answer = stub[0].Encode(pb.EncodeRequest(mm_items=items, req_id=f"tok-{modality}", num_parts=1, part_idx=0,
                                                 prefill_host="127.0.0.1", embedding_port=[pull.port]), timeout=60)
        frames = pull.receive()
    finally:
        pull.close()
    assert frames[1] == expected
    obj = load(frames[0])
    assert obj.modality == SGLANG_MODALITY[modality] and list(obj.shape) == body["embedding_shape"]
    rows, width = body["embedding_shape"]
    assert (answer.embedding_len, answer.embedding_dim, answer.embedding_size) == (rows, width, len(expected))


def test_encode_then_scheduler_receive_url_delivers_to_every_rank(server, stub):
    """`zmq_to_scheduler`: no port in Encode; two ranks register (one before, one after), each gets the rows."""
    encoder = stub[0]
    items = items_of("image")
    expected, _ = inline_rows(server, "image", items)
    ranks = [Pull(), Pull()]
    try:
        encoder.SchedulerReceiveUrl(pb.SchedulerReceiveUrlRequest(
            req_id="sched-1", receive_url=f"127.0.0.1:{ranks[0].port}", receive_count=2), timeout=10)
        call = encoder.Encode.future(pb.EncodeRequest(mm_items=items, req_id="sched-1", num_parts=1,
                                                      prefill_host="127.0.0.1"), timeout=60)
        encoder.SchedulerReceiveUrl(pb.SchedulerReceiveUrlRequest(
            req_id="sched-1", receive_url=f"127.0.0.1:{ranks[1].port}", receive_count=2), timeout=10)
        frames = [rank.receive() for rank in ranks]
        assert call.result().embedding_len > 0
    finally:
        for rank in ranks:
            rank.close()
    assert [received[1] for received in frames] == [expected, expected]
    fronts = httpx.get(server.url + "/server_info").json()["fronts"]
    assert fronts["grpc"]["200"] >= 2 and fronts["http"]["200"] >= 1
    assert server.metric("encoder_front_requests_total", front="grpc", status="200") >= 2


def test_bad_item_is_invalid_argument_with_the_http_message(server, stub):
    bad = base64.b64encode(b"\x89PNG\r\n\x1a\n not an image").decode()
    http = httpx.post(server.url + "/encode", json={"req_id": "bad-http", "modality": "image", "mm_items": [bad]})
    assert http.status_code == 400
    with pytest.raises(grpc.RpcError) as caught:
        stub[0].Encode(pb.EncodeRequest(mm_items=[bad], req_id="bad-http", num_parts=1), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == http.json()["message"]
    assert ("http-status", "400") in caught.value.trailing_metadata()
    with pytest.raises(grpc.RpcError) as caught:  # the schema's own 400s too (here: part_idx past num_parts)
        stub[0].Encode(pb.EncodeRequest(mm_items=[image_b64(56, 56)], req_id="x", num_parts=1, part_idx=3))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "part_idx" in caught.value.details()


def test_deadline_is_the_requests_and_its_ranks_hear_of_it(server, stub):
    """Nobody registers: the call's 0.4 s deadline ends it (DEADLINE_EXCEEDED, our message), well before the
    1.5 s send timeout; a rank that registers late is told of the failure."""
    with pytest.raises(grpc.RpcError) as caught:
        stub[0].Encode(pb.EncodeRequest(mm_items=items_of("image"), req_id="late-1", num_parts=1,
                                        prefill_host="127.0.0.1"), timeout=0.4)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "timed out" in caught.value.details()
    rank = Pull()
    try:
        stub[0].SchedulerReceiveUrl(pb.SchedulerReceiveUrlRequest(
            req_id="late-1", receive_url=f"127.0.0.1:{rank.port}", receive_count=1), timeout=10)
        obj = load(rank.receive(5)[0])
    finally:
        rank.close()
    assert obj.error_code == 504 and "timed out" in obj.error_msg


def test_send_without_the_mooncake_backend_is_not_found(stub):
    with pytest.raises(grpc.RpcError) as caught:
        stub[0].Send(pb.SendRequest(req_id="s", prefill_host="127.0.0.1", embedding_port=1, session_id="x"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND and "--encoder-transfer-backend mooncake" in \
        caught.value.details()


def test_health_and_reflection_answer_as_sglangs(stub):
    channel = stub[1]
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", "sglang.grpc.encoder.SglangEncoder"):
        assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == \
            health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as caught:
        health.Check(health_pb2.HealthCheckRequest(service="nope"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    answer = next(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert {service.name for service in answer.list_services_response.service} == {
        "sglang.grpc.encoder.SglangEncoder", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}


def test_concurrent_calls_are_batched_like_http(server, stub):
    """Eight calls at once share forwards, as /encode requests do (the same scheduler)."""
    results: list = []

    def call(index: int) -> None:
        pull = Pull()
        try:
            stub[0].Encode(pb.EncodeRequest(mm_items=[image_b64(56, 56, seed=10 + index)], req_id=f"many-{index}",
                                            num_parts=1, prefill_host="127.0.0.1", embedding_port=[pull.port]),
                           timeout=60)
            results.append(load(pull.receive()[0]).shape)
        finally:
            pull.close()

    threads = [threading.Thread(target=call, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 8


def test_item_modality_from_data_urls_names_and_bytes():
    wav = wav_b64(waveform(0.1, 16000, seed=1), 16000)
    assert item_modality(wav) == "audio" and item_modality("data:audio/wav;base64," + wav) == "audio"
    assert item_modality("data:video/mp4;base64,AAAA") == "video"
    assert item_modality("https://example.test/a/clip.webm?x=1") == "video"
    assert item_modality("file:///media/a.flac") == "audio" and item_modality("/media/cat.jpg") == "image"
    assert item_modality(image_b64(8, 8)) == "image" and item_modality("https://example.test/page") == "image"
    with pytest.raises(ValueError, match="share a modality"):
        part_modality([wav, image_b64(8, 8)])
    assert part_modality([wav], "VIDEO") == "video"


def test_mooncake_encode_answers_the_sizes_and_send_writes_the_rows():
    """`--encoder-transfer-backend mooncake` over gRPC: Encode stages the rows and answers their sizes; Send has
    them written into a rank's registered buffer (a real TransferEngine) and its frame pushed; a second Send of
    the released part is INTERNAL with /send's message. With --api-key, a call without the key is
    UNAUTHENTICATED; health stays open."""
    from tests.support.optional import import_or_skip

    import_or_skip("mooncake")
    from tests.support.sglang_rank import Rank

    rank = Rank()
    try:
        with InProcessServer("--encoder-transfer-backend", "mooncake", "--mooncake-protocol", "tcp",
                             "--enable-dynamic-batching", "false", "--grpc-port", str(free_port()),
                             "--api-key", "sesame") as srv:
            key = {"Authorization": "Bearer sesame"}
            items = [image_b64(64, 48, seed=5)]
            expected, _ = inline_rows(srv, "image", items, key)
            address = httpx.get(srv.url + "/server_info", headers=key).json()["transport"]["grpc"]["address"]
            with grpc.insecure_channel(address) as channel:
                encoder = pb_grpc.SglangEncoderStub(channel)
                request = pb.EncodeRequest(mm_items=items, req_id="moon_local_part_0", num_parts=1)
                with pytest.raises(grpc.RpcError) as refused:
                    encoder.Encode(request, timeout=60)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "missing API key" in refused.value.details()
                assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status == \
                    health_pb2.HealthCheckResponse.SERVING
                sizes = encoder.Encode(request, timeout=60, metadata=[("authorization", "Bearer sesame")])
                assert sizes.embedding_size == len(expected) and sizes.embedding_len * sizes.embedding_dim * 4 == \
                    len(expected)
                send = pb.SendRequest(req_id="moon_local_part_0", prefill_host="127.0.0.1", embedding_port=rank.port,
                                      session_id=rank.session, buffer_address=rank.buffer.data_ptr())
                encoder.Send(send, timeout=30, metadata=[("authorization", "Bearer sesame")])
                header = load(rank.socket.recv_multipart()[0])
                with pytest.raises(grpc.RpcError) as caught:
                    encoder.Send(send, timeout=30, metadata=[("authorization", "Bearer sesame")])
            landed = rank.buffer[:sizes.embedding_size].clone().numpy().tobytes()
    finally:
        rank.close()
    assert landed == expected and header.embedding is None and header.shape == [sizes.embedding_len,
                                                                                 sizes.embedding_dim]
    assert caught.value.code() == grpc.StatusCode.INTERNAL and "no staged embedding" in caught.value.details()


def test_a_missing_extra_is_refused_in_one_line_naming_the_install(monkeypatch):
    from encode_server.ops import libraries
    from encode_server.ops.settings import Settings
    from encode_server.runtime import StartError, check_libraries

    monkeypatch.setitem(libraries.LIBRARIES, "grpc", ("grpc no_such_module_here", "grpc", "'encode-server[grpc]'"))
    with pytest.raises(StartError) as refused:
        check_libraries(Settings(grpc_port=50051))  # before the model loads
    assert "\n" not in str(refused.value) and "pip install 'encode-server[grpc]'" in str(refused.value)
    assert str(refused.value).startswith("--grpc-port")
    check_libraries(Settings())  # without --grpc-port the server starts without the extra


def test_a_busy_grpc_port_is_refused_naming_the_flag():
    import asyncio
    import socket
    import types

    from encode_server.fronts.sglang.grpc_front import GrpcStartError, SglangGrpcFront
    from encode_server.http.listen import ListenError, check_free
    from encode_server.ops.settings import Settings

    with socket.socket() as occupant:
        occupant.bind(("127.0.0.1", 0))
        occupant.listen()
        port = occupant.getsockname()[1]
        with pytest.raises(ListenError, match=r"choose another port with --grpc-port \(or ENCODER_GRPC_PORT\)"):
            check_free("127.0.0.1", port, "--grpc-port")  # before the model loads
        front = SglangGrpcFront(Settings(grpc_port=port))  # and if it was taken while the model loaded
        with pytest.raises(GrpcStartError, match="--grpc-port"):
            asyncio.run(front.start(types.SimpleNamespace(on_drain=lambda listener: None)))


def test_health_watch_says_not_serving_once_draining_begins():
    import asyncio
    import types

    from encode_server.fronts.sglang.grpc_service import EncoderHealth

    listeners: list = []
    verdict = {"now": (True, "")}
    service = types.SimpleNamespace(on_drain=listeners.append, healthy=lambda: verdict["now"])

    async def watch() -> list[int]:
        health = EncoderHealth(service)
        stream = health.Watch(health_pb2.HealthCheckRequest(service=""), None)
        seen = [(await stream.__anext__()).status]
        verdict["now"] = (False, "draining: the server is shutting down")
        for listener in listeners:  # what EncoderService.begin_drain does
            listener()
        seen.append((await stream.__anext__()).status)
        seen.append((await health.Check(health_pb2.HealthCheckRequest(service=""), None)).status)
        return seen

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert asyncio.run(watch()) == [serving, not_serving, not_serving]
