"""SGLang's `mooncake` encoder transfer backend (`--encoder-transfer-backend mooncake`), against receiver
ranks that follow SGLang 0.5.23's `WaitingRDMARequest` (pull `/scheduler_receive_meta_data`, register a
landing buffer with a real Mooncake TransferEngine, `/send`, take the `EmbeddingData` frame on a ZMQ
PULL socket), on loopback: rows land bit-identical to the native `/encode` rows in every rank's buffer,
sizes are published before the forward, and staged rows and registered bytes are freed after
`receive_count` sends, a timeout, or a failure. SGLang's own receiver is driven by
`tools/compat/sglang_transport_compat.py`."""

from __future__ import annotations

import base64
import concurrent.futures
import threading
import time

import httpx
import pytest
import torch

from tests.support.helpers import InProcessServer, decode_embedding, free_port, png_bytes
from tests.support.optional import import_or_skip
from tests.support.sglang_rank import Rank

import_or_skip("mooncake")


def server(*extra: str) -> InProcessServer:
    return InProcessServer("--encoder-transfer-backend", "mooncake", "--mooncake-protocol", "tcp",
                           "--send-timeout-s", "3", *extra)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def native(srv, modality: str, items: list) -> torch.Tensor:
    answer = httpx.post(f"{srv.url}/encode", json={"req_id": f"native-{time.monotonic_ns()}", "modality": modality,
                                                   "mm_items": items, "return_embedding": True}, timeout=60)
    assert answer.status_code == 200, answer.text
    return torch.from_numpy(decode_embedding(answer.json()).copy())


def held(srv) -> tuple[float, float]:
    return (srv.metric("encoder_transport_registered_bytes", transport="sglang-mooncake"),
            httpx.get(f"{srv.url}/server_info").json()["transport"]["sglang"]["staged_parts"])


def test_two_ranks_pull_sizes_before_the_rows_and_receive_them_bit_identical():
    images = [b64(png_bytes(64, 48, 1)), b64(png_bytes(40, 56, 2))]
    ranks = [Rank(), Rank()]
    try:
        # One request per forward here, so the staged rows and the lone native rows come from alike batches.
        with server("--enable-dynamic-batching", "false") as srv:
            expected = native(srv, "image", images)
            results = {}
            # The ranks ask for the sizes first: they wait until the encode publishes them.
            pulls = [threading.Thread(target=lambda r=r: results.__setitem__(
                r, ranks[r].receive(srv.url, "rid_local_part_0", receive_count=2))) for r in range(2)]
            for pull in pulls:
                pull.start()
            time.sleep(0.2)
            encoded = httpx.post(f"{srv.url}/encode", json={"req_id": "rid_local_part_0", "modality": "image",
                                                            "mm_items": images, "num_parts": 1, "part_idx": 0},
                                 timeout=60)
            assert encoded.status_code == 200, encoded.text
            answer = encoded.json()
            assert answer["embedding_len"] == expected.shape[0] and answer["embedding_dim"] == expected.shape[1]
            assert answer["embedding_size"] == expected.nbytes
            for pull in pulls:
                pull.join(30)
            for rank in range(2):
                meta, header, rows = results[rank]
                assert meta["embedding_size"] == expected.nbytes and meta["part_idx"] == 0
                assert torch.equal(rows, expected)
                assert header.req_id == "rid_local_part_0" and header.embedding is None
                assert header.shape == list(expected.shape) and header.grid_dim.tolist() == [
                    item["grid_thw"] for item in answer["items"]]
            assert held(srv) == (0, 0)  # both ranks took it: freed
            assert srv.metric("encoder_transport_transfers_total", transport="sglang-mooncake") == 2
            # A third /send for the released part: SGLang's answer, a 500 saying nothing is staged.
            late = httpx.post(f"{srv.url}/send", json={"req_id": "rid_local_part_0", "session_id": ranks[0].session,
                                                       "buffer_address": ranks[0].buffer.data_ptr(),
                                                       "prefill_host": "127.0.0.1", "embedding_port": ranks[0].port,
                                                       "receive_count": 2}, timeout=30)
            assert late.status_code == 500 and "no staged embedding" in late.text
            info = httpx.get(f"{srv.url}/server_info").json()["transport"]["sglang"]
            assert info["backend"] == "mooncake" and info["protocol"] == "tcp"
    finally:
        for rank in ranks:
            rank.close()


def test_video_audio_and_concurrent_parts_land_bit_identical_and_nothing_stays():
    from tests.support.paths import GOLDEN as GOLDEN_ROOT

    clip = b64((GOLDEN_ROOT / "vllm-videos" / "clip.mp4").read_bytes())
    rank = Rank(4 << 20)
    try:
        with server("--enable-dynamic-batching", "false") as srv:
            expected = native(srv, "video", [clip])
            threading.Timer(0.1, lambda: httpx.post(f"{srv.url}/encode", json={
                "req_id": "v_local_part_0", "modality": "video", "mm_items": [clip]}, timeout=60)).start()
            _, header, rows = rank.receive(srv.url, "v_local_part_0")
            assert torch.equal(rows, expected) and int(header.modality) == 2
            images = [b64(png_bytes(24 + 8 * (index % 3), 32, 10 + index)) for index in range(12)]
            natives = [native(srv, "image", [image]) for image in images]

            def one(index: int):
                req_id = f"c{index}_local_part_0"
                with concurrent.futures.ThreadPoolExecutor(1) as encoder:
                    encoder.submit(httpx.post, f"{srv.url}/encode", json={
                        "req_id": req_id, "modality": "image", "mm_items": [images[index]]}, timeout=60)
                    return rank.receive(srv.url, req_id, offset=index * 65536)[2]

            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                landed = list(pool.map(one, range(len(images))))
            assert all(torch.equal(rows, want) for rows, want in zip(landed, natives))
            assert held(srv) == (0, 0)
        with server("--model", "tiny-qwen2-audio") as srv:
            wave = (GOLDEN_ROOT / "vllm-audio" / "mono16k.wav").read_bytes()
            expected = native(srv, "audio", [b64(wave)])
            threading.Timer(0.1, lambda: httpx.post(f"{srv.url}/encode", json={
                "req_id": "a_local_part_0", "modality": "audio", "mm_items": [b64(wave)]}, timeout=60)).start()
            _, header, rows = rank.receive(srv.url, "a_local_part_0")
            assert torch.equal(rows, expected) and int(header.modality) == 3
            assert held(srv) == (0, 0)
    finally:
        rank.close()


def test_failures_timeouts_and_bounds_free_everything():
    image = b64(png_bytes(64, 48, 5))
    rank = Rank()
    try:
        with server("--mooncake-registered-bytes", "16") as srv:
            assert httpx.post(f"{srv.url}/encode", json={"req_id": "big", "modality": "image", "mm_items": [image]},
                              timeout=60).status_code == 200
            meta = httpx.post(f"{srv.url}/scheduler_receive_meta_data", json={"req_id": "big", "part_idx": 0},
                              timeout=30).json()
            refused = httpx.post(f"{srv.url}/send", json={**meta, "session_id": rank.session,
                                                          "buffer_address": rank.buffer.data_ptr(),
                                                          "prefill_host": "127.0.0.1", "embedding_port": rank.port,
                                                          "receive_count": 1}, timeout=30)
            assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
            assert held(srv)[0] == 0
        with server() as srv:
            # A bad item: the pull gets the encode's error, not a hang.
            bad = httpx.post(f"{srv.url}/encode", json={"req_id": "bad", "modality": "image",
                                                        "mm_items": [b64(b"not an image")]}, timeout=60)
            assert bad.status_code == 400
            pulled = httpx.post(f"{srv.url}/scheduler_receive_meta_data", json={"req_id": "bad", "part_idx": 0},
                                timeout=30)
            assert pulled.status_code == 400 and "mm_items[0]" in pulled.text
            # Staged rows that no receiver takes are freed after --send-timeout-s.
            assert httpx.post(f"{srv.url}/encode", json={"req_id": "orphan", "modality": "image",
                                                         "mm_items": [image]}, timeout=60).status_code == 200
            assert held(srv)[1] == 1
            deadline = time.monotonic() + 15
            while held(srv)[1] and time.monotonic() < deadline:
                time.sleep(0.2)
            assert held(srv) == (0, 0)
            # A receiver whose TransferEngine is gone: its /send fails (502), the next one is served.
            assert httpx.post(f"{srv.url}/encode", json={"req_id": "gone", "modality": "image",
                                                         "mm_items": [image]}, timeout=60).status_code == 200
            meta = httpx.post(f"{srv.url}/scheduler_receive_meta_data", json={"req_id": "gone", "part_idx": 0},
                              timeout=30).json()
            dead = httpx.post(f"{srv.url}/send", json={**meta, "session_id": f"127.0.0.1:{free_port()}",
                                                       "buffer_address": 4096, "prefill_host": "127.0.0.1",
                                                       "embedding_port": rank.port, "receive_count": 1}, timeout=30)
            assert dead.status_code == 502, dead.text
            assert held(srv) == (0, 0)  # a failed send releases the part, as SGLang's encoder does
            for body, needle in [({"req_id": "gone"}, "session_id"), ([], "JSON object")]:
                answer = httpx.post(f"{srv.url}/send", json=body, timeout=30)
                assert answer.status_code == 400 and needle in answer.text, answer.text
    finally:
        rank.close()


def test_without_the_backend_the_endpoints_say_how_to_turn_it_on():
    with InProcessServer() as srv:
        for path in ("/scheduler_receive_meta_data", "/send"):
            answer = httpx.post(f"{srv.url}{path}", json={"req_id": "x", "part_idx": 0}, timeout=30)
            assert answer.status_code == 404 and "--encoder-transfer-backend mooncake" in answer.text
        assert httpx.get(f"{srv.url}/server_info").json()["transport"]["sglang"]["backend"] == "zmq_to_scheduler"


@pytest.mark.quick
def test_settings_refuse_what_the_backend_cannot_honour_in_one_line(monkeypatch):
    from encode_server.ops import libraries
    from encode_server.ops.settings import Settings, load_settings
    from encode_server.runtime import StartError, check_libraries

    with pytest.raises(ValueError, match="--mooncake-host"):
        Settings(encoder_transfer_backend="mooncake", host="0.0.0.0")
    assert Settings(encoder_transfer_backend="mooncake", host="0.0.0.0", mooncake_host="10.0.0.7").transfer_host \
        == "10.0.0.7"
    assert Settings(encoder_transfer_backend="mooncake", host="0.0.0.0",
                    advertise_url="http://enc-3:30000").transfer_host == "enc-3"
    assert load_settings([], {"MOONCAKE_PROTOCOL": "tcp"}).mooncake_protocol == "tcp"  # SGLang's variable
    with pytest.raises(SystemExit):
        load_settings(["--encoder-transfer-backend", "nixl"])
    monkeypatch.setattr(libraries, "installed", lambda library: False)
    asked = Settings(encoder_transfer_backend="mooncake")  # the settings check values; the front asks at start-up
    with pytest.raises(StartError, match=r"--encoder-transfer-backend mooncake needs the mooncake library.*"
                                         r"pip install mooncake-transfer-engine-non-cuda.*libibverbs1") as refused:
        check_libraries(asked)
    assert "\n" not in str(refused.value)
    assert Settings().encoder_transfer_backend == "zmq_to_scheduler"  # nothing asks for the library by default
