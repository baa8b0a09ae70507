"""The engine's processor threads: with two, two batches in flight prepare at the same time (camera images on a
CPU, where preparing is the longer stage); with one, they prepare in turn. A real tiny adapter, real threads."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from PIL import Image

from encode_server.engine import EncoderEngine
from encode_server.models import load_adapter
from encode_server.ops.metrics import ServerMetrics
from encode_server.records import EncodedPart, EncodeError, EncodeJob, PartMeta

pytestmark = pytest.mark.quick


@pytest.fixture(scope="module")
def adapter():
    return load_adapter("tiny-qwen2.5-vl", "cpu", "float32")


def job(adapter, req_id: str, shade: int) -> EncodeJob:
    image = Image.new("RGB", (56, 84), (shade, 255 - shade, 90))
    layout = adapter.processor.item_layout("image", image)
    return EncodeJob(meta=PartMeta(req_id=req_id, part_idx=0, num_parts=1, modality="image"), items=(image,),
                     layouts=(layout,), raw_items=(b"",))  # no pool here


class MeetingProcessor:
    """The adapter's processor, whose `preprocess` returns only once two calls are inside it at the same time
    (a barrier; it breaks after `timeout` seconds when the second never comes)."""

    def __init__(self, processor, timeout: float) -> None:
        self.inner = processor
        self.barrier = threading.Barrier(2, timeout=timeout)

    def preprocess(self, modality, items):
        self.barrier.wait()
        return self.inner.preprocess(modality, items)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("threads", [1, 2])
def test_two_processor_threads_prepare_two_batches_at_once(adapter, monkeypatch, threads):
    monkeypatch.setattr(adapter, "processor", MeetingProcessor(adapter.processor, timeout=1.0 if threads == 1 else 30))
    engine = EncoderEngine(adapter, ServerMetrics(), processor_threads=threads)
    assert engine.processor_threads == threads
    jobs = [job(adapter, "a", 10), job(adapter, "b", 200)]

    async def both():
        return await asyncio.gather(engine.encode("image", [jobs[0]]), engine.encode("image", [jobs[1]]))

    try:
        results = [result for batch in asyncio.run(both()) for result in batch]
    finally:
        engine.close()
    if threads == 1:  # in turn: the first batch waits at the barrier for a second that cannot come
        assert all(isinstance(result, EncodeError) and result.status == 500 for result in results)
        return
    assert all(isinstance(result, EncodedPart) for result in results)
    for result, one in zip(results, jobs):  # each batch's rows are its own image's
        expected = adapter.forward(adapter.processor.inner.preprocess("image", list(one.items)))
        torch.testing.assert_close(result.embedding, expected)


def test_two_threads_only_where_the_overlap_adapts_and_the_processor_takes_two_callers(adapter):
    from encode_server.assembly import processor_threads

    internvl = load_adapter("tiny-internvl", "cpu", "float32")
    assert adapter.processor.concurrent_calls and not internvl.processor.concurrent_calls
    assert processor_threads(True, adapter.processor) == 2  # Qwen's grid processor, on a CPU server
    assert processor_threads(False, adapter.processor) == 1  # a GPU, a pool, free cores: no adaptive overlap
    assert processor_threads(True, internvl.processor) == 1  # a processor not known to take two callers
