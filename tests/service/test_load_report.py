"""The service's load report (`EncoderService.load_report`, served as `GET /v1/load`) on a fake clock, the
`encoder_healthy` gauge from start-up on, and the health probe within small decode limits (docs/CONTRACT.md
section 2; docs/OPERATIONS.md, Health and Autoscaling)."""

from __future__ import annotations

import asyncio
import dataclasses
import io

import pytest
from PIL import Image

from encode_server.assembly import probe_sample
from encode_server.media.decoding import MediaLimits
from encode_server.models import ItemError, load_adapter
from tests.support.fakes import settle
from tests.support.service import HOLDING, body, started_service

pytestmark = pytest.mark.quick


@pytest.fixture(scope="module")
def adapter():
    return load_adapter("tiny-qwen2.5-vl", "cpu", "float32")


def healthy_gauge(service) -> float:
    return service.metrics.registry.get_sample_value("encoder_healthy")


async def test_the_report_shows_the_queue_on_the_fake_clock_and_the_gauge_follows_the_drain(adapter):
    async with started_service(HOLDING, adapter) as (service, clock):
        assert healthy_gauge(service) == 1.0  # from start-up, before anything asked /health
        idle = (await service.load_report()).as_json()
        assert idle["modalities"] == {"image": {"queued": 0, "rows": 0, "oldest_wait_s": 0.0},
                                      "video": {"queued": 0, "rows": 0, "oldest_wait_s": 0.0}}
        assert (idle["queued"], idle["pending"], idle["draining"], idle["estimated_wait_s"]) == (0, 0, False, 0.0)
        tasks = [asyncio.create_task(service.encode(body(name))) for name in ("a", "b")]  # held: min batch 1000
        for _ in range(100):
            await settle()
            if service.metrics.queue_depth._value.get() == 2:
                break
            await asyncio.sleep(0.01)  # decoding runs in real threads
        await clock.advance(1.25)
        report = (await service.load_report()).as_json()
        assert report["modalities"]["image"]["queued"] == 2 and report["queued"] == 2 and report["pending"] == 2
        assert report["modalities"]["image"]["oldest_wait_s"] == pytest.approx(1.25)
        assert report["modalities"]["image"]["rows"] == 2 * 4  # a 56x56 image is 4 rows of the tiny model
        assert report["batches_in_flight"] == 0 and report["estimated_wait_s"] is not None
        assert set(report["last_minute"]) == {"window_s", "busy_fraction", "items_per_s", "rows_per_s",
                                              "queue_wait_p99_s"}
        service.begin_drain()
        assert healthy_gauge(service) == 0.0  # at once, not at the next /health
        assert (await service.load_report()).draining
    # The service stopped with both still queued: they were answered 503.
    assert [getattr(result, "status", None) for result in await asyncio.gather(*tasks, return_exceptions=True)] \
        == [503, 503]


async def test_a_small_max_image_pixels_shrinks_the_probe_and_the_server_stays_healthy(adapter):
    limits = MediaLimits.from_settings(dataclasses.replace(HOLDING, max_image_pixels=1000), adapter)
    modality, data = probe_sample(adapter, limits)
    width, height = Image.open(io.BytesIO(data)).size
    assert modality == "image" and width * height <= 1000 and min(width, height) >= 1
    async with started_service(dataclasses.replace(HOLDING, max_image_pixels=1000), adapter) as (service, _):
        await service.encoder.probe(5.0)  # decode within the limit, the forward and the row check: raises on failure
        service.healthy()
        for _ in range(200):
            if not service.health.running:
                break
            await asyncio.sleep(0.01)
        assert service.healthy() == (True, "ok") and healthy_gauge(service) == 1.0


def test_a_model_that_cannot_take_a_probe_within_the_limit_is_refused_naming_the_setting(adapter):
    class PickyProcessor:
        """The tiny model's processor, refusing images under 8x8 as some families' processors do."""

        def sample_encoded(self):
            return adapter.processor.sample_encoded()

        def item_layout(self, modality, item):
            if min(item.size) < 8:
                raise ItemError(f"image of {item.size[0]}x{item.size[1]} is below the model's minimum of 8x8")
            return adapter.processor.item_layout(modality, item)

    class Picky:
        processor = PickyProcessor()

    limits = MediaLimits.from_settings(dataclasses.replace(HOLDING, max_image_pixels=30), adapter)
    with pytest.raises(ValueError, match=r"--max-image-pixels .*below the model's minimum.*raise --max-image-pixels"):
        probe_sample(Picky(), limits)
