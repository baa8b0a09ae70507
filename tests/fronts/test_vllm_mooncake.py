"""vLLM's `ECMooncakeConnector`, producer role (`--ec-transfer-config`), against a consumer speaking vLLM's
control protocol over a real Mooncake TransferEngine on loopback (`tests/support/mooncake_consumer.py`): rows land
bit-identical to the native `/encode` rows on every consumer rank, and nothing stays registered or
reserved after success, refusals, an expired reservation or a consumer that dies. vLLM's own consumer
code is driven by `tools/compat/vllm_compat.py`."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import subprocess
import sys
import time
import uuid

import httpx
import pytest
import torch

from encode_server.fronts.vllm.transfer_config import connector_config
from encode_server.ops.settings import load_settings
from encode_server.runtime import StartError, fronts_for
from tests.support.helpers import InProcessServer, free_port, png_bytes
from tests.support.optional import import_or_skip
from tests.support.paths import GOLDEN as GOLDEN_ROOT
from tests.support.paths import ROOT
from tests.support.vllm_requests import CONSUMER_MODEL, data_url, image_part, media_url, native_rows_of, proxy_body

import_or_skip("mooncake")
from tests.support.mooncake_consumer import ConsumerStandIn  # noqa: E402


def transfer_config(buffer_size: int = 1 << 30, timeout_s: float = 5.0) -> str:
    return json.dumps({"ec_connector": "ECMooncakeConnector", "ec_role": "ec_producer", "ec_buffer_device": "cpu",
                       "ec_buffer_size": buffer_size, "ec_connector_extra_config": {
                           "mooncake_protocol": "tcp", "control_timeout_s": timeout_s}})


def server(*extra: str, buffer_size: int = 1 << 30, timeout_s: float = 5.0) -> InProcessServer:
    return InProcessServer("--ec-transfer-config", transfer_config(buffer_size, timeout_s), "--ec-model-id",
                           CONSUMER_MODEL, *extra)


def push(srv, consumer: str, parts: list[dict], ids: list[str], request_id: str = "req") -> httpx.Response:
    body = {**proxy_body(*parts), "ec_transfer_params": {"consumer_zmq": consumer,
                                                          "ec_items": [{"transfer_id": i} for i in ids]}}
    return httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers={"x-request-id": request_id}, timeout=60)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def assert_nothing_held(srv) -> None:
    assert srv.metric("encoder_transport_registered_bytes", transport="ECMooncakeConnector") == 0
    assert srv.metric("encoder_transport_open_reservations", transport="ECMooncakeConnector") == 0


def test_images_and_video_land_bit_identical_on_every_consumer_rank_and_store_hits_are_pushed():
    """With the shared tier too (`--cache-store`): a Store hit is pushed, what is encoded published under vLLM's key."""
    clip = (GOLDEN_ROOT / "vllm-videos" / "clip.mp4").read_bytes()
    from encode_server.fronts.vllm.video import decode_vllm_video
    from tests.support.mooncake_store import check_vllm_connector_with_the_store, pool, store_args
    from tests.support.vllm_requests import frames_item

    first, second = png_bytes(64, 48, 3), png_bytes(40, 56, 4)
    with pool() as (master, holder), server(*store_args(master)) as srv, \
            ConsumerStandIn(free_port(), ranks=2) as consumer:
        parts = [image_part(data_url(first)), {"type": "video_url", "video_url": {"url": media_url(clip, "video/mp4")}},
                 image_part(data_url(second)), image_part(data_url(first))]  # the first image twice
        response = push(srv, consumer.address, parts, ["t0", "t1", "t2", "t3"])
        assert response.status_code == 200, response.text
        answer = response.json()
        params = answer["ec_transfer_params"]
        identifiers = [item["identifier"] for item in answer["encoder_cache"]]
        assert identifiers[0] == identifiers[3] and len(set(identifiers)) == 3
        assert params[identifiers[0]]["item_indices"] == [0, 3] and params[identifiers[1]]["item_indices"] == [1]
        assert params[identifiers[1]]["transfer_id"] == "t1" and params[identifiers[1]]["modality"] == "video"
        native = {"t0": native_rows_of(srv, "image", b64(first)), "t2": native_rows_of(srv, "image", b64(second)),
                  "t1": native_rows_of(srv, "video", frames_item(decode_vllm_video(clip, "qwen2_vl", 10**8, 100,
                                                                                   "x").frames))}
        native["t3"] = native["t0"]
        for transfer_id, rows in native.items():
            landed = consumer.received(transfer_id)
            assert len(landed) == 2  # both tensor-parallel ranks hold the whole item
            assert all(torch.equal(tensor, rows) for tensor in landed), transfer_id
        # The grid the consumer sizes each placeholder with, as vLLM's producer publishes it.
        grid = httpx.post(f"{srv.url}/encode", json={"req_id": "g", "modality": "image", "mm_items": [b64(first)]},
                          timeout=60).json()["items"][0]["grid_thw"]
        assert params[identifiers[0]]["metadata"] == {"image_grid_thw": grid}
        assert set(params[identifiers[1]]["metadata"]) == {"video_grid_thw"}
        assert srv.metric("encoder_transport_transfers_total", transport="ECMooncakeConnector") == 8
        assert srv.metric("encoder_transport_bytes_total", transport="ECMooncakeConnector") == \
            2 * sum(rows.nbytes for rows in native.values())
        assert_nothing_held(srv)
        info = httpx.get(f"{srv.url}/server_info").json()["transport"]["vllm"]
        assert info["connector"] == "ECMooncakeConnector" and info["protocol"] == "tcp"

        def send(parts):
            body = {**proxy_body(*parts), "ec_transfer_params": {"consumer_zmq": consumer.address}}
            return httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers={"x-request-id": uuid.uuid4().hex},
                              timeout=60)

        def received(identifier, entry):
            landed = consumer.received(entry["transfer_id"])
            assert len(landed) == 2 and torch.equal(landed[0], landed[1])
            return landed[0]

        check_vllm_connector_with_the_store(srv, holder, send, received, CONSUMER_MODEL)


def test_audio_lands_bit_identical():
    clip = (GOLDEN_ROOT / "vllm-audio" / "mono16k.wav").read_bytes()
    from encode_server.fronts.vllm.audio import Resampler, decode_vllm_audio

    with server("--model", "tiny-qwen2-audio") as srv, ConsumerStandIn(free_port()) as consumer:
        part = {"type": "input_audio", "input_audio": {"data": b64(clip), "format": "wav"}}
        response = push(srv, consumer.address, [part], ["a0"])
        assert response.status_code == 200, response.text
        resampler = Resampler()
        try:
            audio = decode_vllm_audio(clip, 16000, 60.0, "x", resampler)
        finally:
            resampler.close()
        rows = native_rows_of(srv, "audio", b64(audio.wav()))
        (landed,) = consumer.received("a0")
        assert torch.equal(landed, rows)
        (entry,) = response.json()["ec_transfer_params"].values()
        assert entry["metadata"] == {"audio_num_tokens": [rows.shape[0]]}
        assert_nothing_held(srv)


def test_many_items_concurrently_leave_nothing_registered_or_reserved():
    images = [png_bytes(32 + 4 * (index % 5), 32, index) for index in range(60)]
    with server() as srv, ConsumerStandIn(free_port()) as consumer:
        def one(index: int) -> int:
            return push(srv, consumer.address, [image_part(data_url(images[index]))], [f"m{index}"],
                        f"r{index}").status_code

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert set(pool.map(one, range(len(images)))) == {200}
        assert all(len(consumer.received(f"m{index}")) == 1 for index in range(len(images)))
        assert srv.metric("encoder_transport_transfers_total", transport="ECMooncakeConnector") == len(images)
        assert_nothing_held(srv)
        # A retried request (the same transfer id, the same item) is answered without a second push; the same
        # transfer id naming another item is a conflict.
        reserves = consumer.requests.count("reserve_batch")
        assert push(srv, consumer.address, [image_part(data_url(images[0]))], ["m0"]).status_code == 200
        assert consumer.requests.count("reserve_batch") == reserves
        conflict = push(srv, consumer.address, [image_part(data_url(images[1]))], ["m0"])
        assert conflict.status_code == 409 and "m0" in conflict.json()["error"]["message"], conflict.text
        assert_nothing_held(srv)


def test_refusals_expiry_and_a_dead_consumer_fail_only_their_items_and_release_everything():
    image = png_bytes(64, 48, 9)
    with server(buffer_size=16, timeout_s=2.0) as small:  # one item's rows are larger than the whole bound
        with ConsumerStandIn(free_port()) as consumer:
            response = push(small, consumer.address, [image_part(data_url(image))], ["x"])
            assert response.status_code == 503 and response.headers["retry-after"], response.text
            assert "ec_buffer_size" in response.json()["error"]["message"]
            assert "reserve_batch" not in consumer.requests  # refused before anything was reserved
            assert_nothing_held(small)
    with server(timeout_s=2.0) as srv:
        with ConsumerStandIn(free_port(), ttl_s=300.0) as consumer:
            consumer.full = True  # the consumer's pool is full: a retryable 503, nothing reserved stays
            response = push(srv, consumer.address, [image_part(data_url(image))], ["full"])
            assert response.status_code == 503 and response.headers["retry-after"] == "1", response.text
            assert "buffer pool is full" in response.json()["error"]["message"]
            consumer.full = False
            consumer.ttl_s = 0.0  # every reservation has expired by the time the write completes
            response = push(srv, consumer.address, [image_part(data_url(image))], ["late"])
            assert response.status_code == 502 and "expired" in response.json()["error"]["message"], response.text
            assert_nothing_held(srv)
        # A consumer process that dies right after reserving: its request fails, within the control timeout.
        port = free_port()
        dying = subprocess.Popen([sys.executable, "-m", "tests.support.mooncake_consumer", str(port),
                                  "--die-after-reserve"],
                                 cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert dying.stdout.readline().strip() == "ready"
            started = time.monotonic()
            response = push(srv, f"tcp://127.0.0.1:{port}", [image_part(data_url(image))], ["dies"])
            assert response.status_code == 502, response.text
            assert time.monotonic() - started < 10
        finally:
            dying.kill()
            dying.wait()
        assert_nothing_held(srv)
        # The next consumer is served as if nothing happened.
        with ConsumerStandIn(free_port()) as consumer:
            assert push(srv, consumer.address, [image_part(data_url(image))], ["after"]).status_code == 200
            assert len(consumer.received("after")) == 1
        failures = srv.metric("encoder_transport_failures_total", transport="ECMooncakeConnector")
        assert failures >= 3
        assert_nothing_held(srv)
        for params, needle in [(None, "consumer_zmq"), ({"consumer_zmq": "http://x:1"}, "tcp://host:port"),
                               ({"consumer_zmq": "tcp://127.0.0.1:1", "ec_items": [{"transfer_id": "a"},
                                                                                   {"transfer_id": "a"}]},
                                "its own transfer_id")]:
            body = {**proxy_body(image_part(data_url(image)), image_part(data_url(png_bytes(8, 8)))),
                    "ec_transfer_params": params}
            response = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == 400 and needle in response.json()["error"]["message"], response.text


@pytest.mark.quick
def test_configurations_the_server_cannot_honour_are_refused_in_one_line():
    base = {"ec_connector": "ECMooncakeConnector", "ec_role": "ec_producer"}
    for config, needle in [
        ("not json", "not JSON"),
        ({**base, "ec_connector": "ECCPUConnector"}, "ECCPUConnector"),
        ({**base, "ec_connector": "NixlConnector"}, "ec_connector must be"),
        ({**base, "ec_role": "ec_consumer"}, "ec_role must be 'ec_producer'"),
        ({**base, "ec_buffer_device": "cuda"}, "ec_buffer_device 'cpu'"),
        ({**base, "ec_buffer_size": 0}, "ec_buffer_size must be a positive"),
        ({**base, "ec_connector_extra_config": {"mooncake_protocol": "ib"}}, "rdma or tcp"),
        ({**base, "ec_connector_extra_config": {"cross_encoder_cache": True}}, "cross_encoder_cache"),
        ({"ec_connector": "ECExampleConnector", "ec_role": "ec_producer"}, "shared_storage_path"),
    ]:
        text = config if isinstance(config, str) else json.dumps(config)
        if not isinstance(config, dict):  # not even a JSON object: refused with the other bad values
            with pytest.raises(SystemExit):
                load_settings(["--ec-transfer-config", text])
            continue
        settings = load_settings(["--ec-transfer-config", text])
        with pytest.raises(StartError):  # by the vLLM front, before the model loads
            fronts_for(settings)
        with pytest.raises(ValueError) as refused:
            connector_config(settings)
        assert needle in str(refused.value) and "\n" not in str(refused.value), (needle, refused.value)
    # The same JSON from the environment; ECExampleConnector's folder is --ec-storage's.
    settings = load_settings([], {"ENCODER_EC_TRANSFER_CONFIG": json.dumps({
        "ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
        "ec_connector_extra_config": {"shared_storage_path": "/tmp/ec"}})})
    assert connector_config(settings).storage_path == "/tmp/ec"
    settings = load_settings([], {"ENCODER_EC_TRANSFER_CONFIG": json.dumps(base)})
    assert connector_config(settings).protocol == "rdma" and connector_config(settings).buffer_size == 10**9


@pytest.mark.quick
def test_a_server_without_mooncake_names_the_install(monkeypatch):
    from encode_server.ops import libraries

    monkeypatch.setattr(libraries, "installed", lambda library: False)
    from encode_server.fronts.vllm import transfer_config

    monkeypatch.setattr(transfer_config, "installed", lambda library: False)
    with pytest.raises(ValueError, match=r"pip install mooncake-transfer-engine-non-cuda.*libibverbs1") as refused:
        transfer_config.parse_ec_transfer_config({"ec_connector": "ECMooncakeConnector", "ec_role": "ec_producer"})
    assert "encode-server[" not in str(refused.value)  # no index has a package of that name
    # Without a transfer config nothing asks for the library.
    assert connector_config(load_settings([])) is None
