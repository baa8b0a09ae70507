"""Every vLLM connector with the shared tier (`--cache-store`, a real `mooncake_master` on loopback): an item vLLM's
own client put in Mooncake Store under vLLM's key is answered 200 with those rows, handed to the consumer the
connector's way (the shared files, a push into the consumer's buffer, a NIXL read of the pool) and never encoded;
what is encoded is published under vLLM's key. The objects are read and written here as vLLM 0.33's
`mooncake_store_embedding` client does (`tests/cache/test_cache_store.py`)."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tests.support.helpers import InProcessServer, free_port, png_bytes
from tests.support.vllm_requests import CONSUMER_MODEL, data_url, image_part, proxy_body

pytest.importorskip("mooncake.store", reason="Mooncake is not installed: pip install -e '.[mooncake]'")
from tests.cache.test_cache_store import Master, peer, store_args, vllm_get, vllm_key, vllm_put, wait_for  # noqa: E402


@pytest.fixture(scope="module")
def pool():
    """One master and one peer lending the pool its memory, for every connector's server in turn."""
    master = Master().start()
    holder = peer(master)
    try:
        yield master, holder
    finally:
        holder.close()
        master.kill()


def forwards(server) -> float:
    return server.metric("encoder_batch_tokens_count", modality="image")


def check_store_both_ways(server, holder, send, received) -> None:
    """A Store hit (named by uuid) answers with vLLM's rows, handed over and not encoded; an item encoded here is
    published under vLLM's key with the rows handed over. `send(parts)` answers the chat request;
    `received(identifier, entry)` reads back what the consumer got."""
    width = httpx.get(server.url + "/server_info").json()["model"]["row_widths"]["image"]
    wait_for(lambda: forwards(server) >= 1, what="the start-up health probe's forward")
    before = forwards(server)
    rows = torch.randn(12, width)
    vllm_put(holder, vllm_key("from-vllm", CONSUMER_MODEL), rows)
    response = send([image_part(data_url(png_bytes(48, 48, seed=71)), uuid="from-vllm")])
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["encoder_cache"] == [{"identifier": "from-vllm", "tokens": 12, "hit": True}]
    assert answer["ec_transfer_params"]["from-vllm"]["item_indices"] == [0]
    assert torch.equal(received("from-vllm", answer["ec_transfer_params"]["from-vllm"]), rows)
    assert forwards(server) == before  # nothing encoded
    assert server.metric("encoder_cache_store_hits_total") == 1

    response = send([image_part(data_url(png_bytes(40, 56, seed=72)))])  # no uuid: vLLM's hash names it
    assert response.status_code == 200, response.text
    [item] = response.json()["encoder_cache"]
    assert not item["hit"] and forwards(server) == before + 1
    ours = received(item["identifier"], response.json()["ec_transfer_params"][item["identifier"]])
    key = vllm_key(item["identifier"], CONSUMER_MODEL)
    wait_for(lambda: holder.is_exist(key) == 1, what="the publish")
    value = vllm_get(holder, key, 24 + ours.numel() * 4)
    assert torch.equal(torch.frombuffer(bytearray(value[24:]), dtype=torch.float32).reshape(ours.shape), ours)


def test_ec_example_connector_with_the_store(pool, tmp_path):
    master, holder = pool
    config = json.dumps({"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
                         "ec_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    with InProcessServer(*store_args(master, "--ec-transfer-config", config, "--ec-model-id", CONSUMER_MODEL)) as srv:
        def send(parts):
            return httpx.post(f"{srv.url}/v1/chat/completions", json=proxy_body(*parts), timeout=60)

        def received(identifier, entry):
            return load_file(str(tmp_path / identifier / "encoder_cache.safetensors"))["ec_cache"]

        check_store_both_ways(srv, holder, send, received)


def test_ec_mooncake_connector_with_the_store(pool):
    pytest.importorskip("mooncake.engine")
    from tests.fronts.test_vllm_mooncake import transfer_config
    from tests.support.mooncake_consumer import ConsumerStandIn

    master, holder = pool
    with InProcessServer(*store_args(master, "--ec-transfer-config", transfer_config(), "--ec-model-id",
                                     CONSUMER_MODEL)) as srv, ConsumerStandIn(free_port()) as consumer:
        def send(parts):
            body = {**proxy_body(*parts), "ec_transfer_params": {"consumer_zmq": consumer.address}}
            return httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers={"x-request-id": uuid.uuid4().hex},
                              timeout=60)

        def received(identifier, entry):
            [landed] = consumer.received(entry["transfer_id"])
            return landed

        check_store_both_ways(srv, holder, send, received)


def test_ec_cpu_connector_with_the_store(pool):
    pytest.importorskip("nixl")
    from tests.fronts.test_vllm_cpu_p2p import Producer

    master, holder = pool
    with Producer(*store_args(master)) as producer, producer.consumer() as consumer:
        def send(parts):
            return producer.encode(parts)

        def received(identifier, entry):
            return consumer.read(entry, identifier, torch.float32)

        check_store_both_ways(producer.server, holder, send, received)
        assert producer.settled()
