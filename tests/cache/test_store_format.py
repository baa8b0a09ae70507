"""The shared tier's pieces without a Store: vLLM 0.33's key and value layout (written out here from vLLM's
`mooncake_store_embedding` source, not from ours), corrupt objects refused, the protocol marker, and the
connection's bounds: a read past its deadline or with every read thread busy is a miss, publishing beyond
its bound drops (counted), warnings are rate-limited, and the settings refuse what cannot work."""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

from encode_server.cache import store_format
from encode_server.cache.store_client import RateLimitedWarning, StoreConfig, StoreConnection
from encode_server.cache.store_format import CorruptObject, Namespace
from encode_server.models import ItemLayout
from encode_server.ops.settings import load_settings
from tests.support import paths
from tests.support.helpers import ROOT

pytestmark = pytest.mark.quick


def test_the_namespace_and_key_are_vllms():
    # vLLM: f"{prefix}embedding@model:{m}@revision:{rev or 'default'}@encoder:{hash}@dtype:{dtype}@protocol:v3",
    # key f"{namespace}@id:{identifier}"; MultiModalConfig().compute_hash() in vLLM 0.33.0 is the md5 of its printed
    # factors [attention backend, tp mode, attention dtype, fp8 scale path, device normalize] at their defaults.
    # The key below is what vLLM 0.33.0's build_embedding_namespace and make_embedding_key printed for
    # embedding_cache_prefix "pool-a", embedding_model_identity "Qwen/Qwen2.5-VL-3B-Instruct", revision r1, bf16.
    assert store_format.VLLM_DEFAULT_ENCODER_HASH == "8658476b2a0fa47e54f56cb92e3f1162" == \
        hashlib.md5(b"[None, 'weights', None, None, True]").hexdigest()
    namespace = Namespace("embedding", "Qwen/Qwen2.5-VL-3B-Instruct", "r1", store_format.VLLM_DEFAULT_ENCODER_HASH,
                          torch.bfloat16, prefix="pool-a")
    assert namespace.key("abc") == ("pool-a@embedding@model:Qwen/Qwen2.5-VL-3B-Instruct@revision:r1"
                                    "@encoder:8658476b2a0fa47e54f56cb92e3f1162@dtype:torch.bfloat16"
                                    "@protocol:v3@id:abc")
    assert str(Namespace("embedding", "m", "", "e", torch.float32)).startswith("embedding@model:m@revision:default@")
    assert str(Namespace("embedding", "m", "r1", "e", torch.float16)) == \
        "embedding@model:m@revision:r1@encoder:e@dtype:torch.float16@protocol:v3"


@pytest.mark.parametrize(("dtype", "code"), [(torch.float32, 0), (torch.float16, 11), (torch.bfloat16, 12)])
def test_values_are_the_header_then_the_rows(dtype, code):
    rows = torch.randn(5, 8).to(dtype)
    value = store_format.encode_value(rows)
    assert struct.unpack_from("<IIQQ", value) == (0x4D4F4F4E, code, 5, 8)
    if dtype == torch.float32:  # what vLLM 0.33.0's _encode_mooncake_tensor_metadata wrote for a [16, 128] tensor
        assert store_format.encode_value(torch.zeros(16, 128))[:24].hex() == \
            "4e4f4f4d0000000010000000000000008000000000000000"
    assert value[24:] == rows.view(torch.uint8).numpy().tobytes() and len(value) == 24 + 5 * 8 * dtype.itemsize
    assert torch.equal(store_format.decode_value(value, dtype, 8), rows)


def test_corrupt_values_are_refused():
    value = store_format.encode_value(torch.ones(3, 4))
    bad = {
        "short": value[:10],
        "truncated": value[:-1],
        "longer": value + b"\0",
        "magic": struct.pack("<IIQQ", 1, 0, 3, 4) + value[24:],
        "dtype": struct.pack("<IIQQ", 0x4D4F4F4E, 12, 3, 4) + value[24:],
        "unknown dtype": struct.pack("<IIQQ", 0x4D4F4F4E, 7, 3, 4) + value[24:],
        "width": struct.pack("<IIQQ", 0x4D4F4F4E, 0, 6, 2) + value[24:],
        "no rows": struct.pack("<IIQQ", 0x4D4F4F4E, 0, 0, 4),
    }
    for what, data in bad.items():
        with pytest.raises(CorruptObject):
            store_format.decode_value(data, torch.float32, 4)
        assert what


def test_layouts_round_trip_and_garbage_is_corrupt():
    layout = ItemLayout(6, (2, 2, 6), mel_frames=None, receiver_grid=(1, 2), clip_frames=(0.0, 2.0),
                        video_timestamps=(0.5, 1.5))
    back = store_format.decode_layout(store_format.encode_layout(layout), ItemLayout)
    assert back == layout and back.receiver_grid == (1, 2) and back.video_timestamps == (0.5, 1.5)
    for garbage in (b"not json", b"[1, 2]", b'{"tokens": 3}'):
        with pytest.raises(CorruptObject):
            store_format.decode_layout(garbage, ItemLayout)


def test_the_protocol_marker():
    assert store_format.marker_protocol(store_format.marker_value("x")) == "v3"
    assert store_format.marker_protocol(b'{"protocol": "v9"}') == "v9"
    assert store_format.marker_protocol(b"\x00garbage") is None


class SlowClient:
    """A store client whose reads take `delay` seconds and whose puts are recorded."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.puts: list[str] = []
        self.release = threading.Event()

    def get_batch(self, keys):
        self.release.wait(self.delay)
        return [b"" for _ in keys]

    def get(self, key):
        return self.get_batch([key])[0]

    def put(self, key, value, *args):
        self.puts.append(key)
        return 0


def connected(client, **config) -> StoreConnection:
    connection = StoreConnection(StoreConfig("127.0.0.1:9", **config), "test")
    connection._client, connection.state = client, "connected"  # as after a successful connect
    return connection


def test_a_slow_read_is_a_miss_within_the_deadline_and_busy_threads_skip():
    client = SlowClient(delay=5.0)
    connection = connected(client, read_timeout_s=0.05, read_threads=1)

    async def scenario():
        started = time.perf_counter()
        assert await connection.get(["a"]) == [None]
        waited = time.perf_counter() - started
        assert await connection.get(["b"]) == [None]  # the one read thread is still busy: not even asked
        return waited

    waited = asyncio.run(scenario())
    assert waited < 1.0
    assert connection.stats.read_timeouts == 1 and connection.stats.reads_skipped == 1
    client.release.set()
    connection.close()


def test_publishing_beyond_the_bound_drops_and_counts():
    connection = connected(SlowClient(), publish_max_items=2, publish_max_bytes=1000)
    # Not started: nothing drains the queue, so the bound is what decides.
    assert connection.publish([("a", b"x" * 10)]) and connection.publish([("b", b"x" * 10)])
    assert not connection.publish([("c", b"x")])  # a third item
    assert connection.stats.publish_drops == 1 and connection.pending == (2, 20)
    connection._pending.clear()
    connection._pending_bytes = 0
    assert not connection.publish([("d", b"x" * 1001)])  # too many bytes
    assert connection.stats.publish_drops == 2
    connection.state = "lost"
    assert not connection.publish([("e", b"x")]) and connection.stats.publish_drops == 3


def test_a_tier_checks_the_bound_before_copying_and_copies_in_the_publisher(monkeypatch):
    from encode_server.cache.store_tier import StoreTier

    client = SlowClient()
    connection = connected(client, publish_max_items=8, publish_max_bytes=24 + 4 * 8 * 2)
    tier = StoreTier(connection, Namespace("embedding", "m", "default", "e", torch.float16), {"image": 8})
    copies = []
    encode = store_format.encode_value
    monkeypatch.setattr(store_format, "encode_value", lambda rows: copies.append(rows) or encode(rows))
    rows = torch.randn(4, 8)
    assert tier.publish("one", rows) and copies == []  # queued, nothing copied on the caller's thread
    assert not tier.publish("two", torch.randn(5, 8)) and copies == []  # beyond the bound: dropped, never copied
    assert connection.stats.publish_drops == 1
    [(objects, size)] = connection._pending
    assert size == 24 + 4 * 8 * 2 and objects[0][1]() == encode(rows.to(torch.float16)) and len(copies) == 1


def test_the_publisher_puts_the_layout_before_the_rows():
    client = SlowClient()
    connection = connected(client)
    connection._threads[1].start()  # only the publisher
    assert connection.publish([("k@layout:1", b"{}"), ("k@id:1", b"rows")])
    deadline = time.monotonic() + 5
    while connection.stats.published < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.puts == ["k@layout:1", "k@id:1"]
    connection._closed.set()
    with connection._wake:
        connection._wake.notify_all()


def test_warnings_are_rate_limited(caplog):
    now = [0.0]
    warn = RateLimitedWarning(interval_s=30, clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="encode_server.cache.store"):
        assert warn("lost", "lost %s", "m")
        assert not warn("lost", "lost %s", "m")
        assert warn("other", "other")
        now[0] = 31.0
        assert warn("lost", "lost %s", "m")
    assert [record.getMessage() for record in caplog.records] == ["lost m", "other",
                                                                  "lost m (1 more like it since)"]


def test_settings_refuse_what_cannot_work(monkeypatch):
    with pytest.raises(SystemExit):
        load_settings(["--cache-store", "http://host:50051"], {})
    with pytest.raises(SystemExit):
        load_settings(["--cache-store", "mooncake://host:50051", "--cache-bytes", "0"], {})
    assert load_settings(["--cache-store", "mooncake://host:50051"], {}).cache_store == "mooncake://host:50051"
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mooncake" else real(name, *a))
    from encode_server.cache.store_client import libraries_needed
    from encode_server.ops.libraries import MissingLibrary, require
    from encode_server.ops.settings import Settings

    settings = Settings(cache_store="mooncake://host:50051")  # values only: no library is probed here
    assert libraries_needed(Settings()) == []  # nothing asked for, nothing needed
    # What `runtime.check_libraries` does with the tier's need at start-up, before the model loads:
    with pytest.raises(MissingLibrary, match=r"^--cache-store \(Mooncake Store's client\) needs the mooncake "
                                             r"library.*pip install mooncake-transfer-engine-non-cuda.*libibverbs1"):
        for library, wanted_by in libraries_needed(settings):
            require(library, wanted_by)


def test_the_dashboard_reads_only_series_the_tier_exports():
    import json
    import re

    from prometheus_client import CollectorRegistry, generate_latest

    from encode_server.ops.metrics import StoreCollector

    connection = connected(SlowClient())
    connection.stats.observe_read(0.003)
    registry = CollectorRegistry()
    registry.register(StoreCollector(connection))
    exported = generate_latest(registry).decode()
    dashboard = paths.ROOT / "deploy" / "grafana" / "encode-server.json"
    used = set(re.findall(r"encoder_cache_store_[a-z_]+", dashboard.read_text()))
    assert {"encoder_cache_store_hits_total", "encoder_cache_store_read_seconds_bucket",
            "encoder_cache_store_publish_drops_total"} <= used
    for name in used:
        assert re.search(rf"^{name}[{{ ]", exported, re.MULTILINE), name
    assert 'encoder_cache_store_read_seconds_bucket{le="0.005"} 1.0' in exported
    assert json.loads(dashboard.read_text())["panels"]


def test_the_pool_simulation_counts_what_a_shared_tier_saves(tmp_path):
    """`benchmarks/store_pool_sim.py` as it runs: 4 pods, round-robin, over 3 items that each pod's cache holds.
    Per pod, each encodes every item once, and pod 0 all three again after its restart; with a shared tier each
    item is encoded once in the pool, and the restarted pod finds everything there. (Seed 0's stream gives
    every pod every item before and after the restart.)"""
    out = tmp_path / "sim.json"
    done = subprocess.run([sys.executable, "benchmarks/store_pool_sim.py", "--pods", "4", "--requests", "400",
                           "--items", "3", "--local", "8", "--store", "100", "--window", "50", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    per_pod, shared = row["per_pod"], row["shared"]
    assert per_pod["encodes_per_1000"] * 400 / 1000 == 4 * 3 + 3
    assert shared["encodes_per_1000"] * 400 / 1000 == 3
    assert shared["restarted_pod_hit_rate"] == 1.0 and per_pod["restarted_pod_hit_rate"] < 1.0
