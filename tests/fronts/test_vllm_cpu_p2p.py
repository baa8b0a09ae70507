"""vLLM's `ECCPUConnector` in P2P mode, producer role (`--ec-transfer-config`), against a consumer speaking vLLM's
protocol with NIXL on loopback (`tests/support/nixl_consumer.py`): rows read bit-identical to the native `/encode` rows,
the NACKs vLLM defines, and every pin released on the consumer's notification, on a lapsed lease and for a
consumer that dies. vLLM's own consumer code is driven by `tools/compat/vllm_cpu_compat.py`."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import json
import mmap
import subprocess
import sys
import time

import httpx
import pytest
import torch

from encode_server.ops.settings import Settings
from tests.support.helpers import InProcessServer, free_port, png_bytes
from tests.support.optional import import_or_skip
from tests.support.paths import GOLDEN as GOLDEN_ROOT
from tests.support.paths import ROOT
from tests.support.vllm_requests import CONSUMER_MODEL, data_url, image_part, media_url, native_rows_of, proxy_body

import_or_skip("nixl")
from encode_server.fronts.vllm.connectors.cpu import compatibility_hash  # noqa: E402
from encode_server.fronts.vllm.transfer_config import connector_config  # noqa: E402
from tests.support.nixl_consumer import NixlConsumer  # noqa: E402

CONNECTOR = "ECCPUConnector"


def transfer_config(cpu_bytes: int = 64 << 20, lease_s: float = 30.0, hold_s: float = 60.0) -> str:
    return json.dumps({"ec_connector": CONNECTOR, "ec_role": "ec_producer", "ec_connector_extra_config": {
        "ec_enable_nixl": True, "ec_cpu_bytes": cpu_bytes, "producer_pin_lease_s": lease_s, "unread_hold_s": hold_s}})


class Producer:
    """The server with the connector, and what a consumer must know of it."""

    def __init__(self, *extra: str, cpu_bytes: int = 64 << 20, lease_s: float = 30.0, hold_s: float = 60.0) -> None:
        self.port = free_port()
        self.server = InProcessServer("--ec-transfer-config", transfer_config(cpu_bytes, lease_s, hold_s),
                                      "--ec-model-id", CONSUMER_MODEL, "--ec-side-channel-host", "127.0.0.1",
                                      "--ec-side-channel-port", str(self.port), *extra)

    def __enter__(self) -> Producer:
        self.server.__enter__()
        info = httpx.get(f"{self.server.url}/server_info").json()["transport"]["vllm"]
        self.block_size = info["block_size_bytes"]
        self.compat = compatibility_hash(*info["compatibility"])
        self.url = self.server.url
        return self

    def __exit__(self, *exc) -> None:
        self.server.__exit__(*exc)

    def metric(self, name: str) -> float:
        return self.server.metric(name, transport=CONNECTOR)

    def consumer(self) -> NixlConsumer:
        return NixlConsumer(self.block_size, self.compat)

    def encode(self, parts: list[dict], request_id: str = "req") -> httpx.Response:
        return httpx.post(f"{self.url}/v1/chat/completions", json=proxy_body(*parts),
                          headers={"x-request-id": request_id}, timeout=60)

    def settled(self, timeout_s: float = 5.0) -> bool:
        """Whether every pin is released (notifications arrive on the side channel's thread)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.metric("encoder_transport_open_reservations") == 0:
                return True
            time.sleep(0.02)
        return False


@contextlib.contextmanager
def direct_producer(cpu_bytes: int = 64 << 20, hidden: int = 128, lease_s: float = 30.0, hold_s: float = 60.0):
    """The connector's producer without a server or model (rows made by the test), its side channel on loopback."""
    from encode_server.fronts.vllm.connectors.cpu import ECCPUConnector
    from encode_server.fronts.vllm.transfer_config import parse_ec_transfer_config
    from encode_server.fronts.vllm.versions import VllmVersion

    config = parse_ec_transfer_config(transfer_config(cpu_bytes, lease_s, hold_s))
    port = free_port()
    producer = ECCPUConnector(config, "test", hidden, torch.float32, "m", VllmVersion("0.33.0"), "127.0.0.1", port)
    producer.port = port
    try:
        yield producer
    finally:
        producer.close()


def publish(producer, *items: tuple[str, torch.Tensor]) -> dict:
    """The producer's answer for items (identifier, rows), as the chat route gets it."""
    import asyncio

    from encode_server.fronts.vllm.connectors.base import ItemRows

    return asyncio.run(producer.hand_over([ItemRows(name, "image", rows, None) for name, rows in items], None, "r"))


def settled(producer, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while producer.open_reservations and time.monotonic() < deadline:
        time.sleep(0.01)
    return producer.open_reservations == 0 and producer.pool.pins == 0


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def announced(response: httpx.Response) -> list[tuple[str, dict]]:
    """(identifier, its ec_transfer_params entry) per item, by position."""
    assert response.status_code == 200, response.text
    answer = response.json()
    params = answer["ec_transfer_params"]
    return [(item["identifier"], params[item["identifier"]]) for item in answer["encoder_cache"]]


def test_images_video_and_a_repeat_are_read_bit_identical_then_nothing_is_held_and_store_hits_are_read():
    """With the shared tier too (`--cache-store`): a Store hit is read from the pool, what is encoded published under
    vLLM's key."""
    clip = (GOLDEN_ROOT / "vllm-videos" / "clip.mp4").read_bytes()
    from encode_server.fronts.vllm.video import decode_vllm_video
    from tests.support.mooncake_store import check_vllm_connector_with_the_store, pool, store_args
    from tests.support.vllm_requests import frames_item

    first, second = png_bytes(64, 48, 3), png_bytes(40, 56, 4)
    with pool() as (master, holder), Producer(*store_args(master)) as producer, producer.consumer() as consumer:
        hidden = httpx.get(f"{producer.url}/server_info").json()["model"]["hidden_size"]
        assert producer.block_size == hidden * 4  # one float32 row of the language model
        parts = [image_part(data_url(first)), {"type": "video_url", "video_url": {"url": media_url(clip, "video/mp4")}},
                 image_part(data_url(second)), image_part(data_url(first))]
        items = announced(producer.encode(parts))
        assert items[0][0] == items[3][0] and items[0][1]["item_indices"] == [0, 3]
        native = [native_rows_of(producer.server, "image", b64(first)),
                  native_rows_of(producer.server, "video", frames_item(decode_vllm_video(
                      clip, "qwen2_vl", 10**8, 100, "x").frames)),
                  native_rows_of(producer.server, "image", b64(second))]
        grid = httpx.post(f"{producer.url}/encode", json={"req_id": "g", "modality": "image",
                                                          "mm_items": [b64(first)]}, timeout=60).json()
        for (identifier, entry), rows in zip(items[:3], native):
            assert entry["peer_host"] == "127.0.0.1" and entry["peer_port"] == producer.port
            assert entry["shape"] == list(rows.shape)
            assert entry["size_bytes"] == -(-rows.nbytes // producer.block_size) * producer.block_size
            landed = consumer.read(entry, identifier, torch.float32)
            assert torch.equal(landed, rows), identifier
        assert items[0][1]["metadata"] == {"image_grid_thw": grid["items"][0]["grid_thw"]}
        assert set(items[1][1]["metadata"]) == {"video_grid_thw"} and items[1][1]["modality"] == "video"
        # The same item asked for again (a retried request, a second consumer) is read again, intact.
        again = announced(producer.encode([image_part(data_url(first))]))
        assert again[0][0] == items[0][0]
        assert torch.equal(consumer.read(again[0][1], again[0][0], torch.float32), native[0])
        assert producer.settled()
        assert producer.metric("encoder_transport_transfers_total") == 4
        assert producer.metric("encoder_transport_bytes_total") == \
            sum(entry["size_bytes"] for _, entry in items[:3]) + again[0][1]["size_bytes"]
        assert producer.metric("encoder_transport_held_bytes") == 0
        info = httpx.get(f"{producer.url}/server_info").json()["transport"]["vllm"]
        assert info["connector"] == CONNECTOR and info["registered_bytes"] == 64 << 20
        check_vllm_connector_with_the_store(producer.server, holder, producer.encode,
                                            lambda identifier, entry: consumer.read(entry, identifier, torch.float32),
                                            CONSUMER_MODEL)
        assert producer.settled()


def test_audio_is_read_bit_identical():
    clip = (GOLDEN_ROOT / "vllm-audio" / "mono16k.wav").read_bytes()
    from encode_server.fronts.vllm.audio import Resampler, decode_vllm_audio

    with Producer("--model", "tiny-qwen2-audio") as producer, producer.consumer() as consumer:
        part = {"type": "input_audio", "input_audio": {"data": b64(clip), "format": "wav"}}
        ((identifier, entry),) = announced(producer.encode([part]))
        resampler = Resampler()
        try:
            audio = decode_vllm_audio(clip, 16000, 60.0, "x", resampler)
        finally:
            resampler.close()
        rows = native_rows_of(producer.server, "audio", b64(audio.wav()))
        assert torch.equal(consumer.read(entry, identifier, torch.float32), rows)
        assert entry["metadata"] == {"audio_num_tokens": [rows.shape[0]]}
        assert producer.settled() and producer.metric("encoder_transport_held_bytes") == 0


@pytest.mark.quick
def test_the_nacks_vllm_defines():
    import threading

    import zmq

    rows = torch.arange(64 * 3, dtype=torch.float32).reshape(3, 64)
    with direct_producer() as producer, NixlConsumer(producer.block_size, producer.compat_hash) as consumer:
        host, port = "127.0.0.1", producer.port
        assert consumer.ask(host, port, "never-encoded") == {"type": "ack", "mm_hash": "never-encoded", "status": 1}
        entry = publish(producer, ("item", rows))["item"]
        assert consumer.ask(host, port, "item", compatibility_hash="0" * 64)["status"] == 2
        assert consumer.ask(host, port, "item", connector_version=1)["status"] == 3
        assert consumer.ask(host, port, "item", session_id="")["status"] == 4
        assert producer.open_reservations == 0  # no NACK pins anything
        # NOT_READY: an item whose rows are still being copied in (the copy held up here); asked again once copied.
        pool = producer.pool
        copying, release = threading.Event(), threading.Event()
        copy_in = pool._copy_in

        def slow_copy(entry, flat):
            copying.set()
            release.wait(10)
            copy_in(entry, flat)

        pool._copy_in = slow_copy
        writer = threading.Thread(target=pool.put, args=("being-written", rows * 2, 60.0))
        writer.start()
        assert copying.wait(10)
        assert consumer.ask(host, port, "being-written")["status"] == 5
        release.set()
        writer.join(10)
        pool._copy_in = copy_in
        assert torch.equal(consumer.read({"shape": [3, 64]}, "being-written", torch.float32,
                                         ack=consumer.ask(host, port, "being-written")), rows * 2)
        # A malformed request is dropped unanswered; the side channel goes on serving.
        context = zmq.Context()
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://{host}:{port}")
        dealer.send_multipart([b"", b"\xc1 not msgpack"])
        assert dealer.poll(300) == 0
        dealer.close(0)
        context.term()
        assert producer.malformed == 1
        assert torch.equal(consumer.read(entry, "item", torch.float32), rows)
        assert settled(producer)
        # Once a session has read, its acks leave the pool's descriptors out; a new session gets them.
        later = consumer.ask(host, port, "item")
        assert later["status"] == 0 and "mem_descriptor" not in later
        consumer.pull(later, "item")
        with NixlConsumer(producer.block_size, producer.compat_hash) as fresh:
            first = fresh.ask(host, port, "item")
            assert first["mem_descriptor"] == producer.pool.mem_descriptor
            fresh.pull(first, "item")
        assert settled(producer)


def test_concurrent_requests_are_read_bit_identical_and_leave_nothing_held():
    images = [png_bytes(16 + 4 * (index % 4), 16, 200 + index) for index in range(16)]
    # One request per forward: a fused forward's float32 sums differ from a lone one's in the last bits, and the
    # concurrent requests' rows are compared bit for bit with lone `/encode` rows.
    with Producer("--enable-dynamic-batching", "false", cpu_bytes=64 << 10) as producer, \
            producer.consumer() as consumer:
        def one(index: int) -> list[tuple[str, dict]]:
            return announced(producer.encode([image_part(data_url(images[index]))], f"r{index}"))

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(one, range(len(images))))
        natives = [native_rows_of(producer.server, "image", b64(data)) for data in images]
        for ((identifier, entry),), rows in zip(answers, natives):
            assert torch.equal(consumer.read(entry, identifier, torch.float32), rows)
        # The pool (64 KiB) is then mostly held by items read once: the next 40 items evict them.
        for start in range(0, 40, 10):
            batch = [png_bytes(20, 20, 500 + start + k) for k in range(10)]
            for identifier, entry in announced(producer.encode([image_part(data_url(data)) for data in batch])):
                assert consumer.read(entry, identifier, torch.float32).shape == (4, 128)
        assert producer.settled()
        assert producer.metric("encoder_transport_held_bytes") == 0
        assert producer.metric("encoder_transport_registered_bytes") == 64 << 10  # registered once, never more
        assert producer.metric("encoder_transport_transfers_total") == 56
        assert producer.metric("encoder_transport_failures_total") == 0


@pytest.mark.quick
def test_a_thousand_items_through_the_producer_leave_nothing_held():
    """The transport's bookkeeping over 1,000 items (no model: rows made here), each read by a consumer."""
    from encode_server.fronts.vllm.connectors.base import ItemRows

    generator = torch.Generator().manual_seed(0)
    with direct_producer(cpu_bytes=64 << 10, hidden=32) as producer:
        with NixlConsumer(producer.block_size, producer.compat_hash) as consumer:
            for start in range(0, 1000, 20):
                items = [ItemRows(f"item-{start + k}", "image", torch.randn(1 + (start + k) % 7, 32,
                                                                            generator=generator), None)
                         for k in range(20)]
                params = publish(producer, *((item.identifier, item.rows) for item in items))
                for item in items:
                    assert torch.equal(consumer.read(params[item.identifier], item.identifier, torch.float32),
                                       item.rows)
            assert settled(producer)
            assert producer.held_bytes == 0 and producer.stats.transfers == 1000 and producer.stats.failures == 0
            assert producer.registered_bytes == 64 << 10 and producer.pool.stored_bytes <= 64 << 10


def test_a_dead_consumer_a_short_read_and_a_lapsed_lease_release_their_pins_only():
    image, other = png_bytes(48, 32, 7), png_bytes(32, 48, 8)
    # A 3 s lease: long enough for a loaded machine's reads (the first one connects), short enough to wait out.
    with Producer(lease_s=3.0, hold_s=0.5) as producer, producer.consumer() as consumer:
        ((identifier, entry),) = announced(producer.encode([image_part(data_url(image))]))
        ((other_id, other_entry),) = announced(producer.encode([image_part(data_url(other))]))
        # A consumer process that dies once its read is granted, before it reads.
        dying = subprocess.run([sys.executable, "-m", "tests.support.nixl_consumer", "127.0.0.1", str(producer.port),
                                identifier, producer.compat, str(producer.block_size)], cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
        assert dying.stdout.strip().splitlines()[-1] == "acked 0" and dying.returncode == -9, dying.stderr[-500:]
        assert producer.metric("encoder_transport_open_reservations") == 1
        # Meanwhile another consumer reads both items.
        rows = native_rows_of(producer.server, "image", b64(image))
        assert torch.equal(consumer.read(entry, identifier, torch.float32), rows)
        assert torch.equal(consumer.read(other_entry, other_id, torch.float32),
                           native_rows_of(producer.server, "image", b64(other)))
        # A short block list: the consumer reads fewer blocks than acked. Its notification still ends the pin,
        # and what it got is the head of the rows.
        short = consumer.read(entry, identifier, torch.float32, blocks=2)
        assert short.numel() == 2 * producer.block_size // 4
        assert torch.equal(short, rows.reshape(-1)[:short.numel()])
        # A grant that is never read (the consumer asks, then never reads): its lease lapses.
        assert consumer.ask("127.0.0.1", producer.port, other_id)["status"] == 0
        assert producer.settled(10.0)
        assert producer.metric("encoder_transport_failures_total") == 2  # the dead consumer's and the unread grant
        time.sleep(0.6)  # the unread-item hold (0.5 s) has lapsed too
        assert producer.metric("encoder_transport_held_bytes") == 0


@pytest.mark.quick
def test_a_full_pool_is_a_503_with_retry_after():
    from encode_server.records import EncodeError

    item = torch.ones(4, 128)  # 4 blocks of 512 bytes
    with direct_producer(cpu_bytes=1 << 10) as producer:  # two blocks: less than one item
        with pytest.raises(EncodeError) as refused:
            publish(producer, ("big", item))
        assert refused.value.status == 503 and refused.value.headers["Retry-After"]
        assert "ec_cpu_bytes" in refused.value.message
    with direct_producer(cpu_bytes=6 << 10, hold_s=30.0) as producer:  # room for three items nobody has read yet
        for index in range(3):
            publish(producer, (f"i{index}", item * index))
        with pytest.raises(EncodeError) as refused:
            publish(producer, ("i3", item))
        assert refused.value.status == 503 and 1 <= int(refused.value.headers["Retry-After"]) <= 30
        assert producer.stats.refused == 1 and producer.held_bytes == 6 << 10
        # Once an item is read, its blocks may be reused: the fourth fits, evicting it.
        with NixlConsumer(producer.block_size, producer.compat_hash) as consumer:
            entry = publish(producer, ("i0", item * 0))["i0"]  # the same item again: no new blocks
            assert torch.equal(consumer.read(entry, "i0", torch.float32), item * 0)
            assert settled(producer)
        publish(producer, ("i3", item))
        assert producer.pool.entry("i0") is None and producer.pool.items == 3


@pytest.mark.quick
def test_configurations_the_connector_cannot_honour_are_refused_in_one_line():
    base = {"ec_connector": CONNECTOR, "ec_role": "ec_producer"}
    for config, needle in [
        (base, "ec_enable_nixl"),
        ({**base, "ec_connector_extra_config": {"ec_enable_nixl": "false", "ec_cpu_bytes": 10**6}}, "ec_enable_nixl"),
        ({**base, "ec_connector_extra_config": {"ec_enable_nixl": True}}, "ec_cpu_bytes"),
        ({**base, "ec_connector_extra_config": {"ec_enable_nixl": True, "ec_cpu_bytes": -1}}, "ec_cpu_bytes"),
        ({**base, "ec_role": "ec_both", "ec_connector_extra_config": {"ec_enable_nixl": True, "ec_cpu_bytes": 10**6}},
         "ec_role must be 'ec_producer'"),
        ({**base, "ec_connector_extra_config": {"ec_enable_nixl": "true", "ec_cpu_bytes": 10**6,
                                                "producer_pin_lease_s": 0}}, "producer_pin_lease_s"),
    ]:
        with pytest.raises(ValueError) as refused:
            connector_config(Settings(ec_transfer_config=json.dumps(config)))
        assert needle in str(refused.value) and "\n" not in str(refused.value), (needle, refused.value)
    good = json.dumps({**base, "ec_connector_extra_config": {"ec_enable_nixl": "true", "ec_cpu_bytes": "1e6"}})
    with pytest.raises(ValueError, match="wildcard"):
        connector_config(Settings(ec_transfer_config=good, ec_side_channel_host="0.0.0.0"))
    config = connector_config(Settings(ec_transfer_config=good))
    assert config.cpu_bytes == 10**6 and config.pin_lease_s == 30.0
    assert config.progress_thread is False


@pytest.mark.quick
def test_the_compatibility_hash_is_vllms():
    # vLLM 0.33's compute_ec_compatibility_hash: sha256 of the compact JSON of its four factors.
    import hashlib

    expected = hashlib.sha256(b'["0.33.0","Qwen/Qwen2.5-VL-3B-Instruct","torch.bfloat16",4096]').hexdigest()
    assert compatibility_hash("0.33.0", "Qwen/Qwen2.5-VL-3B-Instruct", "torch.bfloat16", 4096) == expected


@pytest.mark.quick
def test_a_server_without_nixl_names_the_install(monkeypatch):
    from encode_server.fronts.vllm import transfer_config

    monkeypatch.setattr(transfer_config, "installed", lambda library: False)
    with pytest.raises(ValueError, match=r"needs the nixl library.*pip install nixl") as refused:
        transfer_config.parse_ec_transfer_config({"ec_connector": CONNECTOR, "ec_role": "ec_producer",
                                                  "ec_connector_extra_config": {"ec_enable_nixl": True,
                                                                                "ec_cpu_bytes": 10**6}})
    assert "\n" not in str(refused.value)


def _resident_bytes_of(area: mmap.mmap) -> int:
    """The resident bytes of the mapping behind `area` (its line in /proc/self/smaps, whatever the process
    allocates or frees elsewhere meanwhile)."""
    import numpy as np

    address = np.frombuffer(area, dtype=np.uint8).ctypes.data
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("the mapping is not in /proc/self/smaps")


def test_the_pool_is_faulted_in_before_the_first_item():
    """The pool's pages are resident once made (as vLLM's producer pre-faults its region): an item's first copy
    would otherwise take a page fault per 4 KiB."""
    from encode_server.transport.nixl import prefault

    size = 64 << 20
    area = mmap.mmap(-1, size)
    before = _resident_bytes_of(area)  # its mapping may share a line with a neighbour's pages
    prefault(area)
    assert _resident_bytes_of(area) - before >= size * 0.9
