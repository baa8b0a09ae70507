"""The service in-process (no HTTP server, no subprocess): admission's 409 / 503 / 504 / 400 / 413
paths, disconnects and the hard timeout, on the real built-in encoder and a fake scheduler clock, so
the rules are asserted without sleeping (docs/CONTRACT.md, sections 2 and 4); and the hand-over seam
(`delivery.handover`): the service tells the one hand-over it was built with each part's layouts before the
forward (only when one job holds all of the part's items), hands it the rows with the destinations the request
named, adds the fields it returns to the response, and tells it of failures."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io

import orjson
import pytest
import torch
from PIL import Image

from encode_server.assembly import build_service
from encode_server.delivery.handover import Destinations, HandedOver, Handover
from encode_server.fronts.native.routes import CLIENT_CLOSED, answer_encode
from encode_server.models import load_adapter
from encode_server.ops.settings import Settings
from encode_server.records import EncodedPart, EncodeError, LayoutsKnown
from encode_server.service import EncoderService
from tests.support.fakes import settle, until
from tests.support.helpers import image_b64
from tests.support.service import HOLDING, body, image_of, started_service

pytestmark = pytest.mark.quick


#: The embedding cache as a server has it by default.
DEFAULT_CACHE = Settings().cache_bytes

CACHE_MODES = [pytest.param(0, id="cache-off"), pytest.param(DEFAULT_CACHE, id="cache-default")]


@pytest.fixture(scope="module")
def adapter():
    return load_adapter("tiny-qwen2.5-vl", "cpu", "float32")


@pytest.fixture(params=CACHE_MODES)
async def holding(adapter, request):
    async with started_service(dataclasses.replace(HOLDING, cache_bytes=request.param), adapter) as started:
        yield started


def forwards(service: EncoderService) -> float:
    return service.metrics.registry.get_sample_value("encoder_batch_size_count", {"modality": "image"}) or 0.0


def decoded(service: EncoderService, name: str):
    """An image a producer decoded itself, with its layout."""
    from encode_server.media.decoding import decode_image
    from encode_server.media.loader import LoadedItem

    image = decode_image(base64.b64decode(image_of(name)), 10**8, name)
    return LoadedItem(image, service.adapter.processor.item_layout("image", image))


def requests(service: EncoderService, status: str) -> float:
    value = service.metrics.registry.get_sample_value("encoder_requests_total", {"modality": "image", "status": status})
    return value or 0.0


async def test_a_lone_request_waits_max_wait_then_the_hard_timeout_releases_it(holding):
    service, clock = holding
    answer = asyncio.ensure_future(service.encode(body("lonely")))
    await until(lambda: service.scheduler.queue_depth == 1)
    await clock.advance(2.99)
    assert not answer.done()
    await clock.advance(0.01)
    response = await answer
    assert response["timings_ms"]["queue"] >= 2900 and response["batch_size"] == 1


async def test_an_unknown_field_is_ignored_and_said_once_per_name(holding, caplog, monkeypatch):
    from encode_server.admission import gate

    monkeypatch.setattr(gate, "_warned_fields", set())
    service, _ = holding
    with caplog.at_level("WARNING", logger="encode_server.admission.gate"):
        request, _, _ = service.admission.validate(body("unknown-1", max_tokens=5))
        service.admission.validate(body("unknown-2", max_tokens=7))
    assert request.req_id == "unknown-1"
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1, warnings
    assert "ignored the field 'max_tokens'" in warnings[0] and "req_id=unknown-1" in warnings[0]
    assert "mm_items" in warnings[0]  # what /encode does read


async def test_duplicate_in_flight_request_is_409_and_the_first_still_succeeds(holding):
    service, clock = holding
    first_body = body("dup", part_idx=0, num_parts=2)
    first = asyncio.ensure_future(service.encode(first_body))
    await until(lambda: service.pending == 1)
    with pytest.raises(EncodeError) as duplicate:
        await service.encode(first_body)
    assert duplicate.value.status == 409 and "dup" in duplicate.value.message and duplicate.value.req_id == "dup"
    other_part = asyncio.ensure_future(service.encode({**first_body, "part_idx": 1, "mm_items": [image_of("dup-1")]}))
    await until(lambda: service.scheduler.queue_depth == 2)
    await clock.advance(3.0)
    assert (await first)["part_idx"] == 0 and (await other_part)["part_idx"] == 1


async def test_overload_is_503_with_retry_after(holding):
    service, clock = holding
    held = [asyncio.ensure_future(service.encode(body(f"held-{i}"))) for i in range(3)]
    await until(lambda: service.pending == 3)
    with pytest.raises(EncodeError) as refused:
        await service.encode(body("one-too-many"))
    assert refused.value.status == 503 and refused.value.headers.get("Retry-After") == "1"
    assert refused.value.req_id == "one-too-many"
    await until(lambda: service.scheduler.queue_depth == 3)
    await clock.advance(3.0)
    assert all(response["batch_size"] == 3 for response in await asyncio.gather(*held))


async def test_rows_for_a_producer_go_through_the_same_admission_and_batches(holding):
    service, clock = holding
    held = [asyncio.ensure_future(service.encode(body(f"held-{i}"))) for i in range(2)]
    rows = asyncio.ensure_future(service.encode_identified("rows", "image", ["rows"], [decoded(service, "rows")]))
    await until(lambda: service.pending == 3)
    with pytest.raises(EncodeError) as refused:
        await service.encode_identified("one-too-many", "image", ["x"], [decoded(service, "one-too-many")])
    assert refused.value.status == 503 and refused.value.req_id == "one-too-many"
    await until(lambda: service.scheduler.queue_depth == 3)
    await clock.advance(3.0)
    [item] = await rows
    assert item.rows.shape[0] == item.layout.tokens
    assert all(response["batch_size"] == 3 for response in await asyncio.gather(*held))
    assert requests(service, "200") == 3 and service.pending == 0


async def test_drain_listeners_are_told_once_as_draining_begins(adapter):
    async with started_service(HOLDING, adapter) as (service, _):
        told = []
        service.on_drain(lambda: told.append(service.admission.draining))
        assert told == []
        service.begin_drain()
        service.give_up("a second signal")  # drains again: the listeners are not told twice
        assert told == [True]


async def test_deadline_is_504_and_the_request_never_reaches_the_encoder(holding):
    service, clock = holding
    before = forwards(service)
    with pytest.raises(EncodeError) as late:
        await service.encode(body("late", timeout_s=0.3))
    assert late.value.status == 504 and late.value.req_id == "late"
    await clock.advance(3.0)  # past the point where the held batch would have been dispatched
    await settle()
    assert forwards(service) == before
    assert requests(service, "504") == 1
    assert service.pending == 0 and service.scheduler.queue_depth == 0


async def test_a_deadline_inside_the_batching_window_is_served_before_it(holding):
    """Promoted before its deadline (less the margin) on an idle encoder, never 504, cache on or off."""
    service, clock = holding
    answer = asyncio.ensure_future(service.encode(body("hurried", timeout_s=1.0)))
    await until(lambda: service.scheduler.queue_depth == 1)
    await clock.advance(0.5)
    assert not answer.done()  # not urgent yet: it waits for company like any other
    await clock.advance(0.45)
    response = await answer
    assert response["batch_size"] == 1 and 900 <= response["timings_ms"]["queue"] < 1000


async def test_a_more_urgent_request_joining_a_queued_encode_moves_it_forward(adapter):
    """The same image twice (on purpose: the second request joins the first one's encode in the cache): the
    encode takes the deadline of the more urgent one, and both get their rows from one forward."""
    async with started_service(dataclasses.replace(HOLDING, cache_bytes=DEFAULT_CACHE), adapter) as (service, clock):
        before = forwards(service)
        patient = asyncio.ensure_future(service.encode(body("patient")))
        await until(lambda: service.scheduler.queue_depth == 1)
        hurried = asyncio.ensure_future(service.encode({**body("hurried"), "mm_items": [image_of("patient")],
                                                        "timeout_s": 1.0}))
        await until(lambda: service.cache.stats.joined == 1)
        await clock.advance(0.95)
        first, second = await asyncio.gather(patient, hurried)
    assert first["items"][0]["cached"] is False and second["items"][0]["cached"] is True
    assert first["timings_ms"]["queue"] >= 900 and forwards(service) - before == 1


async def test_when_the_urgent_waiter_leaves_the_encode_falls_back_to_the_others(adapter):
    async with started_service(dataclasses.replace(HOLDING, cache_bytes=DEFAULT_CACHE), adapter) as (service, clock):
        before = forwards(service)
        patient = asyncio.ensure_future(service.encode(body("patient")))
        await until(lambda: service.scheduler.queue_depth == 1)
        hurried = asyncio.ensure_future(service.encode({**body("hurried"), "mm_items": [image_of("patient")],
                                                        "timeout_s": 1.0}))
        await until(lambda: service.cache.stats.joined == 1)
        hurried.cancel()
        await settle()
        await clock.advance(0.95)  # past the point where the hurried one would have been promoted
        assert forwards(service) == before and not patient.done()
        await clock.advance(2.05)  # the hard timeout releases the patient one
        response = await patient
    assert response["batch_size"] == 1 and forwards(service) - before == 1


async def test_timeout_above_the_server_limit_is_400(holding):
    service, _ = holding
    with pytest.raises(EncodeError) as greedy:
        await service.encode(body("greedy", timeout_s=999))
    assert greedy.value.status == 400 and "timeout_s" in greedy.value.message


async def chunks_of(raw: bytes):
    yield raw


async def never_hang_up() -> None:
    await asyncio.Event().wait()


async def test_oversized_body_is_413_and_the_server_stays_healthy(holding):
    service, _ = holding
    raw = orjson.dumps(body("big", mm_items=["A" * 300_000]))
    status, error, _ = await answer_encode(service, HOLDING.max_request_bytes, str(len(raw)), chunks_of(raw),
                                           never_hang_up)
    assert status == 413 and "limit" in error["message"]
    status, error, _ = await answer_encode(service, HOLDING.max_request_bytes, None, chunks_of(raw), never_hang_up)
    assert status == 413  # counted while streaming, without a Content-Length
    assert service.healthy()[0]


async def test_disconnected_client_is_dropped_before_the_encoder(holding):
    service, clock = holding
    before = forwards(service)
    gone = asyncio.Event()

    async def hangup() -> None:
        await gone.wait()

    raw = orjson.dumps(body("gone"))
    exchange = asyncio.ensure_future(answer_encode(service, HOLDING.max_request_bytes, None, chunks_of(raw), hangup))
    await until(lambda: service.scheduler.queue_depth == 1)
    gone.set()
    status, error, _ = await exchange
    assert status == CLIENT_CLOSED and error["req_id"] == "gone"
    await clock.advance(3.0)
    await settle()
    assert forwards(service) == before
    assert requests(service, "cancelled") == 1
    assert service.pending == 0  # the req_id is free again once its caller is gone


async def test_the_embedding_is_what_the_encoder_computes_for_the_item_alone(adapter):
    service = build_service(dataclasses.replace(HOLDING, max_wait_ms=0, min_batch_size=1), adapter)
    await service.start()
    try:
        response = await service.encode(body("alone", return_embedding=True))
    finally:
        await service.stop()
    rows = torch.frombuffer(bytearray(base64.b64decode(response["embedding"])), dtype=torch.float32)
    image = Image.open(io.BytesIO(base64.b64decode(image_of("alone")))).convert("RGB")
    expected = adapter.forward(adapter.processor.preprocess("image", [image]))
    assert response["embedding_shape"] == list(expected.shape)
    assert torch.equal(rows.reshape(expected.shape), expected)
    assert response["items"] == [{"tokens": 4, "grid_thw": [1, 4, 4]}]


async def test_batching_off_runs_one_request_per_forward(adapter):
    service = build_service(Settings(enable_dynamic_batching=False), adapter)
    await service.start()
    try:
        before = forwards(service)
        responses = await asyncio.gather(*(service.encode(
            {"req_id": f"off-{i}", "modality": "image", "mm_items": [image_b64(56, 56, seed=i)]}) for i in range(12)))
    finally:
        await service.stop()
    assert all(response["batch_size"] == 1 for response in responses)
    assert forwards(service) - before == 12


async def test_deepstack_rows_are_announced_in_the_response_and_the_zmq_header():
    from encode_server.receiver import EmbeddingReceiver

    adapter = load_adapter("tiny-qwen3-vl", "cpu", "float32")
    k = adapter.info.deepstack
    assert k > 0
    service = build_service(Settings(model="tiny-qwen3-vl"), adapter)
    await service.start()
    try:
        with EmbeddingReceiver() as receiver:
            response = await service.encode(body("deep", return_embedding=True, prefill_host="127.0.0.1",
                                                 embedding_port=receiver.port))
            received = await receiver.aget("deep", timeout=10)
    finally:
        await service.stop()
    assert response["deepstack"] == k
    assert response["embedding_shape"][1] == adapter.info.hidden_size * (1 + k)
    rows = torch.frombuffer(bytearray(base64.b64decode(response["embedding"])), dtype=torch.float32)
    assert torch.equal(received.tensor.flatten(), rows)
    assert received.main.shape == (response["embedding_shape"][0], adapter.info.hidden_size)
    assert len(received.deepstack) == k
    assert torch.equal(received.deepstack[-1], received.tensor[:, -adapter.info.hidden_size:])


# --- the hand-over seam (`delivery.handover`) ---------------------------------------------------

class Recording(Handover):
    """A hand-over that stages nothing and records what the service told it, in order."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def layouts_known(self, to: Destinations) -> LayoutsKnown | None:
        if to.inline:
            return None
        return lambda layouts: self.events.append(("layouts", to.meta.req_id, [layout.tokens for layout in layouts]))

    async def hand_over(self, to: Destinations, part: EncodedPart) -> HandedOver:
        self.events.append(("rows", to.meta.req_id, int(part.embedding.shape[0]), to.endpoints, to.inline,
                            to.registered))
        return HandedOver(fields={"handed_over_by": "recording"})

    def failed(self, to: Destinations, error: EncodeError) -> None:
        self.events.append(("failed", to.meta.req_id, error.status))


@pytest.mark.parametrize("cache_bytes", [0, 1 << 24], ids=["cache-off", "cache-on"])
async def test_the_service_hands_every_part_to_the_handover_it_was_built_with(adapter, cache_bytes):
    handover = Recording()
    prompt = dataclasses.replace(HOLDING, max_wait_ms=0, min_batch_size=1, cache_bytes=cache_bytes)
    service = build_service(prompt, adapter, handover=handover)
    await service.start()
    try:
        staged = await service.encode(body("staged", prefill_host="127.0.0.1"))  # receivers that register
        assert staged["handed_over_by"] == "recording" and staged["items"][0]["tokens"] == 4
        assert handover.events == [("layouts", "staged", [4]), ("rows", "staged", 4, (), False, True)]
        handover.events.clear()

        inline = await service.encode(body("inline", return_embedding=True))
        assert "embedding" in inline and inline["handed_over_by"] == "recording"
        assert handover.events == [("rows", "inline", 4, (), True, False)]  # nobody waits for the layouts
        handover.events.clear()

        again = {"req_id": "again", "modality": "image", "mm_items": [image_of("staged")]}
        await service.encode(again)
        hit = [("rows", "again", 4, (), False, False)]  # a hit: no job, so no layouts before it
        assert handover.events == (hit if cache_bytes else [("layouts", "again", [4]), *hit])
        handover.events.clear()

        with pytest.raises(EncodeError) as bad:
            await service.encode({"req_id": "bad", "modality": "image", "mm_items": ["bm90IGFuIGltYWdl"]})
        assert bad.value.status == 400
        assert handover.events == [("failed", "bad", 400)]
    finally:
        await service.stop()
