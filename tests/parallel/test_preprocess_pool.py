"""Preprocessing in worker processes: the adapter's picklable copy, `collate`, and `PreprocessPool`.

The pool tests share one pool of two spawned workers (starting one costs seconds: each worker
imports torch and transformers). Its adapter is tiny-qwen2.5-vl's, sabotaged for two widths of image
only inside the workers: 77 pixels wide kills the worker's process, 78 wide hangs it. References are
computed in this process with the unsabotaged adapter.
"""

from __future__ import annotations

import asyncio
import io
import multiprocessing
import os
import pickle
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from PIL import Image

from encode_server.media.decoding import MediaLimits, decode_bytes, decode_frames
from encode_server.models import EncoderAdapter, PreparedBatch, Processor, load_adapter
from encode_server.ops.settings import Settings
from encode_server.preprocessing.pool import ItemFailure, PreprocessPool, default_preprocess_workers
from encode_server.preprocessing.shared_tensors import SHM_DIR, SlotReader, SlotWriter, export_tensors, import_tensors

CRASH_WIDTH, HANG_WIDTH = 77, 78
LIMITS = MediaLimits.from_settings(Settings(), None)


def image(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def encoded(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image(width, height, seed).save(buffer, fmt)
    return buffer.getvalue()


def wav(samples: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(samples) * 0.1).astype(np.float32)


def assert_same(expected: PreparedBatch, got: PreparedBatch) -> None:
    assert got.modality == expected.modality
    assert got.layouts == expected.layouts
    assert list(got.inputs) == list(expected.inputs)
    for key, value in expected.inputs.items():
        assert got.inputs[key].dtype == value.dtype, key
        assert torch.equal(got.inputs[key], value), key  # bit for bit


@pytest.fixture(scope="module")
def adapters() -> dict[str, EncoderAdapter]:
    return {name: load_adapter(name, "cpu", "float32") for name in ("tiny-qwen2.5-vl", "tiny-internvl",
                                                                    "tiny-qwen2-audio", "tiny-qwen3-vl", "tiny-glm4v")}


CASES = {  # (modality, items): sizes that differ, so that grids and tile counts differ
    "qwen-image": ("tiny-qwen2.5-vl", "image", lambda: [image(56, 56, 1), image(300, 120, 2), image(90, 500, 3)]),
    "qwen-video": ("tiny-qwen2.5-vl", "video", lambda: [[image(64, 64, 4)] * 3, [image(112, 56, s) for s in (5, 6)]]),
    "internvl": ("tiny-internvl", "image", lambda: [image(64, 64, 7), image(400, 100, 8), image(100, 300, 9)]),
    "audio": ("tiny-qwen2-audio", "audio", lambda: [wav(1600, 1), wav(16000, 2), wav(40000, 3)]),
    "qwen3-image": ("tiny-qwen3-vl", "image", lambda: [image(64, 64, 10), image(300, 120, 11)]),
    "qwen3-video": ("tiny-qwen3-vl", "video", lambda: [[image(96, 64, s) for s in (12, 13, 14)]]),
    "glm4v-image": ("tiny-glm4v", "image", lambda: [image(64, 64, 15), image(120, 300, 16)]),
    "glm4v-video": ("tiny-glm4v", "video", lambda: [[image(84, 56, s) for s in (17, 18)]]),
}


# --- the adapter's additions -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-internvl", "tiny-qwen2-audio", "tiny-qwen3-vl",
                                  "tiny-glm4v"])
def test_the_processor_pickles_without_the_model_and_preprocesses_alike(adapters, name):
    adapter = adapters[name]
    copy = adapter.processor
    assert not [key for key, value in vars(copy).items() if isinstance(value, torch.nn.Module)]
    assert [key for key, value in vars(adapter).items() if isinstance(value, torch.nn.Module)]  # untouched
    data = pickle.dumps(copy)
    assert len(data) < 1_000_000  # no weights went along
    restored = pickle.loads(data)
    for model, modality, make in CASES.values():
        if model == name:
            items = make()
            assert_same(adapter.processor.preprocess(modality, items), restored.preprocess(modality, items))
            assert [restored.item_layout(modality, item) for item in items] == \
                [adapter.processor.item_layout(modality, item) for item in items]


@pytest.mark.parametrize("case", list(CASES))
def test_collate_of_per_item_results_equals_one_preprocess(adapters, case):
    model, modality, make = CASES[case]
    adapter, items = adapters[model], make()
    whole = adapter.processor.preprocess(modality, items)
    assert_same(whole, adapter.processor.collate([adapter.processor.preprocess(modality, [item]) for item in items]))


def test_collate_refuses_mismatched_batches(adapters):
    qwen = adapters["tiny-qwen2.5-vl"]
    with pytest.raises(ValueError):
        qwen.processor.collate([])
    audio = adapters["tiny-qwen2-audio"]
    with pytest.raises(ValueError):
        qwen.processor.collate([qwen.processor.preprocess("image", [image(56, 56)]),
                                audio.processor.preprocess("audio", [wav(1600)])])


# --- shared memory and the default worker count -----------------------------------------------------

def test_tensors_travel_through_shared_memory_and_the_block_is_unlinked(tmp_path):
    tensors = {"a": torch.randn(5, 7), "b": torch.arange(3, dtype=torch.long), "empty": torch.zeros(0, 4),
               "half": torch.randn(4, 3).to(torch.bfloat16), "strided": torch.randn(6, 4).t()}
    path = SHM_DIR / f"encode-preprocess-test-{os.getpid()}"
    shared = export_tensors(tensors, path)
    assert path.exists() and shared.size % 64 == 0
    back = import_tensors(shared)
    assert not path.exists()  # the name is gone at once; the mapping lives on in the views
    for key, value in tensors.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key
    assert import_tensors(export_tensors({"e": torch.zeros(0)}, path))["e"].shape == (0,)
    assert not path.exists()


def test_a_slot_is_reused_once_released_and_never_overwritten_before():
    prefix = str(SHM_DIR / f"encode-preprocess-test-{os.getpid()}-slots")
    writer, reader = SlotWriter(prefix, max_slots=2, max_bytes=8 << 20), SlotReader()
    try:
        first = {"x": torch.randn(100, 50), "grid": torch.tensor([[1, 2, 3]])}
        shared = writer.write(first)
        assert shared.slot is not None and shared.size % (1 << 20) == 0
        held = reader.read(shared)
        assert not Path(shared.path).exists()  # mapped once, name gone
        second = writer.write({"x": torch.randn(100, 50), "grid": torch.tensor([[4, 5, 6]])})
        assert second.slot != shared.slot  # the first slot is busy: a second one
        assert writer.write({"x": torch.randn(10, 5)}) is None  # both busy, no third: a one-off block instead
        assert torch.equal(held["x"], first["x"]) and torch.equal(held["grid"], first["grid"])
        writer.release([shared.slot])
        third = {"x": torch.randn(80, 50), "grid": torch.tensor([[7, 8, 9]])}
        again = writer.write(third)
        assert (again.slot, again.path) == (shared.slot, shared.path)  # the same slot, the same mapping
        got = reader.read(again)
        assert torch.equal(got["x"], third["x"]) and torch.equal(got["grid"], third["grid"])
        writer.release([shared.slot, second.slot])
        large = torch.randn(1000, 1000)
        bigger = writer.write({"x": large})  # 4 MB: a free slot too small is replaced by a bigger one
        assert bigger is not None and bigger.path not in (shared.path, second.path)
        assert torch.equal(reader.read(bigger)["x"], large)
        assert torch.equal(got["x"], third["x"])  # views of a replaced slot's mapping stay valid
        assert writer.write({"x": torch.randn(3000, 1000)}) is None  # 12 MB: over the byte budget
        assert writer.held_bytes() <= 8 << 20
    finally:
        writer.close()
    assert not list(SHM_DIR.glob(Path(prefix).name + "*"))


def test_rows_written_into_a_reserved_slot_are_sent_without_a_copy():
    prefix = str(SHM_DIR / f"encode-preprocess-test-{os.getpid()}-reserve")
    writer, reader = SlotWriter(prefix, max_slots=2, max_bytes=8 << 20), SlotReader()
    try:
        rows = writer.reserve(300 * 40 * 4).view(torch.float32).view(300, 40)
        rows.copy_(torch.arange(12000, dtype=torch.float32).view(300, 40))  # a processor writing its output
        grid = torch.tensor([[1, 15, 20]])
        shared = writer.write({"pixel_values": rows, "grid_thw": grid})
        assert writer.bytes_copied == grid.numel() * 8  # only the small grid was copied
        got = reader.read(shared)
        assert torch.equal(got["pixel_values"], torch.arange(12000, dtype=torch.float32).view(300, 40))
        assert torch.equal(got["grid_thw"], grid)
        writer.release([shared.slot])
        # A tensor inside the reserved slot but not where `write` would put it (a slice of the processor's
        # output) must not be overwritten while it is read: another slot is used, by copying.
        rows = writer.reserve(300 * 40 * 4).view(torch.float32).view(300, 40)
        rows.copy_(torch.ones(300, 40))
        expected = torch.ones(299, 40)
        before = writer.bytes_copied
        moved = writer.write({"grid_thw": grid, "pixel_values": rows[1:]})
        assert moved.slot != shared.slot and writer.bytes_copied == before + grid.numel() * 8 + expected.numel() * 4
        assert torch.equal(reader.read(moved)["pixel_values"], expected)
    finally:
        writer.close()
    assert not list(SHM_DIR.glob(Path(prefix).name + "*"))


def test_a_workers_task_puts_only_its_first_pixel_rows_in_the_slot():
    """Two outputs of one task never share the reserved slot: the second gets a tensor of its own."""
    from encode_server.preprocessing.worker import _one_slot

    prefix = str(SHM_DIR / f"encode-preprocess-test-{os.getpid()}-oneslot")
    writer = SlotWriter(prefix, max_slots=2, max_bytes=8 << 20)
    try:
        allocate = _one_slot(writer)
        first, second = allocate((100, 40)), allocate((100, 40))
        first.fill_(1.0)
        second.fill_(2.0)
        assert torch.equal(first, torch.ones(100, 40)) and torch.equal(second, torch.full((100, 40), 2.0))
        shared = writer.write({"pixel_values": first})
        assert writer.bytes_copied == 0 and shared.slot is not None  # the first was in the slot already
        del first
    finally:
        writer.close()


def test_the_table_lookup_processor_writes_where_it_is_told(adapters):
    from processors.base import pixels_allocated_by

    qwen = adapters["tiny-qwen2.5-vl"]
    image = Image.fromarray(np.random.default_rng(5).integers(0, 256, (90, 120, 3), dtype=np.uint8))
    expected = qwen.processor.preprocess("image", [image]).inputs["pixel_values"]
    given: list[torch.Tensor] = []

    def allocate(shape):
        given.append(torch.full(shape, float("nan")))
        return given[-1]

    with pixels_allocated_by(allocate):
        pixels = qwen.processor.preprocess("image", [image]).inputs["pixel_values"]
    assert len(given) == 1 and pixels.data_ptr() == given[0].data_ptr()
    assert torch.equal(pixels, expected)


def test_pool_reuses_released_slots_and_keeps_held_items_intact(adapters):
    qwen = adapters["tiny-qwen2.5-vl"]
    pool = PreprocessPool(qwen, LIMITS, workers=1)
    pool.start()
    try:
        held_images = [encoded(140, 84, 90), encoded(56, 56, 91, "JPEG")]
        held = prepared_only(pool.submit("image", held_images).result(timeout=120))  # never released
        for round_ in range(6):
            images = [encoded(56 + 28 * ((round_ + i) % 4), 56 + 28 * i, 100 + 10 * round_ + i) for i in range(3)]
            results = prepared_only(pool.submit("image", images).result(timeout=120))
            assert_same(reference(qwen, "image", images), qwen.processor.collate(results))
            pool.release(results)
            pool.release(results)  # twice is harmless
        assert_same(reference(qwen, "image", held_images), qwen.processor.collate(held))  # not overwritten meanwhile
        stats = pool.stats()[0]
        assert stats["items"] == 20 and stats["slot_items"] == 20  # every item in a slot, none one-off
    finally:
        pool.close()


def test_items_of_cancelled_or_failed_requests_give_their_slots_back(adapters):
    """Nobody reads the items of a cancelled batch, nor the good items of a request with a bad one: their
    slots must go back, or a worker would run out of slots (8) and fall back to one-off blocks for good."""
    qwen = adapters["tiny-qwen2.5-vl"]
    pool = PreprocessPool(qwen, LIMITS, workers=1)
    pool.start()
    try:
        async def cancelled(index: int) -> None:
            items = [encoded(640, 480, 200 + index, "JPEG"), encoded(112, 56, 300 + index)]
            try:  # cancelled while an item is with the worker, or before; if it finished first, used
                pool.release(await asyncio.wait_for(pool.prepare("image", items), 0.005 * index))
            except asyncio.TimeoutError:
                pass

        async def good_and_bad(index: int) -> None:
            results = await pool.prepare("image", [encoded(56, 84, 400 + index), b"not an image"])
            assert isinstance(results[1], ItemFailure)
            pool.release(results)  # what the engine does with a job that failed

        for index in range(10):
            asyncio.run(cancelled(index))
            asyncio.run(good_and_bad(index))
        before = pool.stats()[0]
        images = [encoded(84, 56, 500 + i) for i in range(3)]
        results = prepared_only(pool.submit("image", images).result(timeout=120))
        assert_same(reference(qwen, "image", images), qwen.processor.collate(results))
        after = pool.stats()[0]
        assert after["slot_items"] - before["slot_items"] == 3  # slots were free: none leaked
    finally:
        pool.close()


def test_blocks_of_a_dead_server_are_removed():
    from encode_server.preprocessing.shared_tensors import remove_stale_blocks

    dead = multiprocessing.get_context("spawn").Process(target=os.getpid)
    dead.start()
    dead.join()
    stale = SHM_DIR / f"encode-preprocess-{dead.pid}-abc-w0g1-0"
    live = SHM_DIR / f"encode-preprocess-{os.getpid()}-abc-w0g1-0"
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    try:
        assert remove_stale_blocks() >= 1
        assert not stale.exists() and live.exists()
    finally:
        stale.unlink(missing_ok=True)
        live.unlink(missing_ok=True)


def test_default_worker_count():
    assert default_preprocess_workers(1) == 0  # one core: in-process, as before
    assert default_preprocess_workers(2) == 2
    assert default_preprocess_workers(16) == 15
    assert default_preprocess_workers() >= 0


# --- the pool ------------------------------------------------------------------------------------------

class SabotagedProcessor(Processor):
    """tiny-qwen2.5-vl's processor, but an image CRASH_WIDTH wide kills the process, HANG_WIDTH hangs it."""

    def __init__(self, inner: Processor) -> None:
        self.inner = inner
        self.modalities, self.sampling_rate = inner.modalities, inner.sampling_rate

    def item_layout(self, modality, item):
        return self.inner.item_layout(modality, item)

    def preprocess(self, modality, items):
        for item in items:
            width = (item[0] if isinstance(item, list) else item).size[0]
            if width == CRASH_WIDTH:
                os.kill(os.getpid(), signal.SIGKILL)
            if width == HANG_WIDTH:
                time.sleep(600)
        return self.inner.preprocess(modality, items)

    def sample_item(self):
        return self.inner.sample_item()


class Sabotaged(EncoderAdapter):
    """tiny-qwen2.5-vl with a `SabotagedProcessor`."""

    def __init__(self, inner: EncoderAdapter) -> None:
        self.inner = inner
        self.info, self.device, self.dtype = inner.info, inner.device, inner.dtype
        self.processor = SabotagedProcessor(inner.processor)

    def forward(self, batch):
        return self.inner.forward(batch)


@pytest.fixture(scope="module")
def pool(adapters):
    # The item timeout is what the hanging item costs the run; the items here are prepared in milliseconds.
    pool = PreprocessPool(Sabotaged(adapters["tiny-qwen2.5-vl"]), LIMITS, workers=2, item_timeout_s=4.0)
    pool.start()
    yield pool
    pool.close()


def reference(adapter: EncoderAdapter, modality: str, raw_items: list) -> PreparedBatch:
    decoded = [decode_frames(raw, LIMITS, "x") if isinstance(raw, list) else decode_bytes(modality, raw, LIMITS, "x")
               for raw in raw_items]
    return adapter.processor.preprocess(modality, decoded)


def prepared_only(results: list) -> list[PreparedBatch]:
    assert all(isinstance(result, PreparedBatch) for result in results), results
    return results


def test_pool_matches_in_process_preprocessing_in_item_order(pool, adapters):
    qwen = adapters["tiny-qwen2.5-vl"]
    images = [encoded(56 + 28 * (i % 5), 56 + 14 * i, i, "PNG" if i % 2 else "JPEG") for i in range(10)]
    results = prepared_only(pool.submit("image", images).result(timeout=120))
    assert [r.layouts[0] for r in results] == \
        [qwen.processor.item_layout("image", decode_bytes("image", raw, LIMITS, "x"))
         for raw in images]  # in order, one item each
    assert_same(reference(qwen, "image", images), qwen.processor.collate(results))
    video = [[encoded(64, 64, 20), encoded(64, 64, 21), encoded(64, 64, 22)], [encoded(112, 56, 23)] * 2]
    results = prepared_only(pool.submit("video", video).result(timeout=120))
    assert_same(reference(qwen, "video", video), qwen.processor.collate(results))


async def test_prepare_from_the_event_loop_and_bad_items_fail_alone(pool, adapters):
    qwen = adapters["tiny-qwen2.5-vl"]
    good = [encoded(56, 56, 30), encoded(200, 100, 31)]
    items = [good[0], b"not an image at all", encoded(2000, 5, 32), good[1], b""]
    results = await pool.prepare("image", items)
    assert isinstance(results[1], ItemFailure) and results[1].status == 400
    assert results[1].message.startswith("mm_items[1]: not a decodable image")
    assert isinstance(results[2], ItemFailure) and results[2].status == 400
    assert "mm_items[2]" in results[2].message and "aspect ratio" in results[2].message
    assert isinstance(results[4], ItemFailure) and results[4].message == "mm_items[4]: empty image data"
    assert_same(reference(qwen, "image", good), qwen.processor.collate([results[0], results[3]]))
    named = await pool.prepare("image", [b"junk"], locations=["request r7 item 0"])
    assert named[0].message.startswith("request r7 item 0:")
    assert await pool.prepare("image", []) == []


def test_worker_killed_mid_batch_is_restarted_and_its_item_retried(pool, adapters):
    qwen = adapters["tiny-qwen2.5-vl"]
    restarts_before = sum(worker["restarts"] for worker in pool.stats())
    images = [encoded(1600 + 8 * i, 1200, 40 + i, "JPEG") for i in range(8)]  # decoding each takes a while
    future = pool.submit("image", images)
    deadline = time.monotonic() + 60
    while not (busy := pool.in_flight()) and time.monotonic() < deadline:
        time.sleep(0.002)
    assert busy, "no worker ever held an item"
    victim = next(iter(busy))
    os.kill(victim, signal.SIGKILL)
    results = prepared_only(future.result(timeout=180))
    assert_same(reference(qwen, "image", images), qwen.processor.collate(results))
    assert sum(worker["restarts"] for worker in pool.stats()) == restarts_before + 1
    assert victim not in pool.pids()
    wait_until(lambda: len(pool.pids()) == 2, 120)


def test_an_item_that_kills_its_worker_twice_fails_alone(pool, adapters):
    qwen = adapters["tiny-qwen2.5-vl"]
    wait_until(lambda: len(pool.pids()) == 2, 120)
    items = [encoded(56, 56, 50), encoded(CRASH_WIDTH, 60, 51), encoded(120, 60, 52)]
    results = pool.submit("image", items).result(timeout=240)
    assert isinstance(results[1], ItemFailure) and results[1].status == 500
    assert "died twice" in results[1].message and "SIGKILL" in results[1].message
    assert results[1].message.startswith("mm_items[1]")
    assert_same(reference(qwen, "image", [items[0], items[2]]), qwen.processor.collate([results[0], results[2]]))


def test_an_item_that_hangs_is_stopped_after_the_item_timeout(pool):
    wait_until(lambda: len(pool.pids()) == 2, 120)
    started = time.monotonic()
    results = pool.submit("image", [encoded(HANG_WIDTH, 60, 60), encoded(56, 56, 61)]).result(timeout=120)
    assert isinstance(results[0], ItemFailure) and "longer than 4 s" in results[0].message
    assert isinstance(results[1], PreparedBatch)
    assert time.monotonic() - started < 60
    wait_until(lambda: len(pool.pids()) == 2, 120)
    assert isinstance(pool.submit("image", [encoded(56, 56, 62)]).result(timeout=60)[0], PreparedBatch)


def test_utilisation_is_reported(pool):
    stats = pool.stats()
    assert len(stats) == 2 and sum(worker["items"] for worker in stats) > 20
    assert all(0 <= worker["busy_fraction"] <= 1 and worker["cpu_s"] >= 0 for worker in stats)


def test_close_stops_every_worker_and_frees_shared_memory(adapters):
    # Closed while it holds a batch: every item is answered, and nothing is left running or mapped.
    pool = PreprocessPool(adapters["tiny-qwen2.5-vl"], LIMITS, workers=1)
    pool.start()
    pids = pool.pids()
    future = pool.submit("image", [encoded(1600, 1200, 70 + i, "JPEG") for i in range(6)])
    pool.close()
    results = future.result(timeout=30)  # answered, not left hanging: done, or failed as shut down
    assert all(isinstance(r, PreparedBatch) or (isinstance(r, ItemFailure) and r.status == 503) for r in results)
    for pid in pids:
        assert not pid_alive(pid)
    assert pool.submit("image", [encoded(56, 56, 80)]).result(timeout=5)[0].status == 503
    assert not [path for path in SHM_DIR.glob(f"encode-preprocess-{os.getpid()}-{id(pool):x}-*")]
    assert not set(pids) & {child.pid for child in multiprocessing.active_children()}


def test_no_process_outlives_the_module_pool(pool):
    pids = pool.pids()
    pool.close()
    for pid in pids:
        assert not pid_alive(pid)
    assert multiprocessing.active_children() == []
    assert not list(SHM_DIR.glob(f"encode-preprocess-{os.getpid()}-*"))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_until(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_an_audio_clip_travels_too(adapters):
    """Audio goes through the same shared-memory path (in-process check of the worker's function)."""
    from encode_server.preprocessing.worker import prepare_item

    audio = adapters["tiny-qwen2-audio"]
    buffer = io.BytesIO()
    soundfile.write(buffer, wav(16000, 5), 16000, format="WAV")
    prepared = prepare_item(audio.processor, LIMITS, "audio", buffer.getvalue(), "mm_items[0]")
    shared = export_tensors(prepared.inputs, SHM_DIR / f"encode-preprocess-audio-{os.getpid()}")
    back = PreparedBatch("audio", import_tensors(shared), prepared.layouts)
    assert_same(audio.processor.preprocess("audio", [decode_bytes("audio", buffer.getvalue(), LIMITS, "x")]), back)


# --- --preprocess-device -----------------------------------------------------------------------------

def test_preprocess_device_cuda_is_refused_where_it_cannot_run(adapters):
    from encode_server.ops.settings import Settings
    from encode_server.preprocessing.gpu import PreprocessDeviceError, check_preprocess_device

    qwen = adapters["tiny-qwen2.5-vl"]
    check_preprocess_device("cpu", qwen)  # the default: nothing to check
    with pytest.raises(PreprocessDeviceError, match="needs the model on a CUDA device"):
        check_preprocess_device("cuda", qwen)
    on_gpu = Sabotaged(qwen)  # the model's processor, on a model said to run on a GPU
    on_gpu.device = torch.device("cuda")
    try:
        import torchvision  # noqa: F401
    except ImportError:
        with pytest.raises(PreprocessDeviceError, match="needs torchvision"):
            check_preprocess_device("cuda", on_gpu)
    audio = Sabotaged(adapters["tiny-qwen2-audio"])
    audio.device = torch.device("cuda")
    with pytest.raises(PreprocessDeviceError):
        check_preprocess_device("cuda", audio)
    with pytest.raises(ValueError, match="single-process"):
        Settings(preprocess_device="cuda", dp_size=2)
    with pytest.raises(ValueError, match="preprocess-workers"):
        Settings(preprocess_workers=-2)


# --- the server with a pool ------------------------------------------------------------------------------

def child_pids(pid: int) -> list[int]:
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as handle:
            children += [int(child) for child in handle.read().split()]
    return children


def server_workers(server_pid: int) -> list[int]:
    """The server's preprocessing workers: the children of the fork server it started for them (not
    multiprocessing's resource tracker, its other child)."""
    for pid in child_pids(server_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                if b"forkserver" in handle.read():
                    return child_pids(pid)
        except FileNotFoundError:
            continue
    return []


def test_server_with_workers_fails_bad_items_alone_and_survives_a_killed_worker(adapters):
    import base64

    import httpx

    from tests.support.helpers import ServerProcess

    qwen = adapters["tiny-qwen2.5-vl"]
    good = [encoded(120, 90, 90, "JPEG"), encoded(300, 200, 91, "JPEG")]
    truncated = good[1][: len(good[1]) // 2]  # its header is fine: only a worker, decoding it, finds out
    heavy = [encoded(1600, 1200, 92 + i, "JPEG") for i in range(6)]

    def body(req_id: str, data: bytes) -> dict:
        return {"req_id": req_id, "modality": "image", "mm_items": [base64.b64encode(data).decode()],
                "return_embedding": True}

    async def post_all(url: str, bodies: list[dict]) -> list:
        async with httpx.AsyncClient(timeout=180) as client:
            return await asyncio.gather(*(client.post(url + "/encode", json=b) for b in bodies))

    def embedding(response) -> np.ndarray:
        payload = response.json()
        return np.frombuffer(base64.b64decode(payload["embedding"]), "<f4").reshape(payload["embedding_shape"])

    def expected(data: bytes) -> np.ndarray:
        return qwen.forward(reference(qwen, "image", [data])).numpy()

    with ServerProcess("--preprocess-workers", "2", "--max-wait-ms", "50", "--log-level", "info",
                       startup_timeout=300) as server:
        workers = server_workers(server.proc.pid)
        assert len(workers) == 2
        startup = server.log()  # the seconds the workers take to start are said, not silent
        starting, started = (startup.find("starting 2 preprocessing worker processes"),
                             startup.find("preprocessing workers ready in "))
        assert 0 <= starting < started < startup.find(" s: serving "), startup
        responses = asyncio.run(post_all(server.url, [body("g0", good[0]), body("bad", truncated),
                                                      body("g1", good[1])]))
        assert [r.status_code for r in responses] == [200, 400, 200]
        assert "mm_items[0]" in responses[1].json()["message"] and "truncated" in responses[1].json()["message"]
        for response, data in ((responses[0], good[0]), (responses[2], good[1])):
            np.testing.assert_allclose(embedding(response), expected(data), rtol=1e-5, atol=1e-5)

        async def killed_under_load():
            pending = asyncio.ensure_future(post_all(server.url, [body(f"h{i}", data) for i, data in enumerate(heavy)]))
            await asyncio.sleep(0.5)
            os.kill(workers[0], signal.SIGKILL)
            return await pending

        responses = asyncio.run(killed_under_load())
        assert [r.status_code for r in responses] == [200] * len(heavy)
        for response, data in zip(responses, heavy):
            np.testing.assert_allclose(embedding(response), expected(data), rtol=1e-5, atol=1e-5)
        wait_until(lambda: len(server_workers(server.proc.pid)) == 2, 180)  # restarted
        assert httpx.get(server.url + "/health", timeout=60).status_code == 200
        workers_seen = httpx.get(server.url + "/v1/performance", timeout=60).json()["preprocess_workers"]
        assert [w["worker"] for w in workers_seen] == [0, 1]
        assert sum(w["items"] for w in workers_seen) >= len(heavy) + 2  # the truncated item failed in a worker
        assert sum(w["restarts"] for w in workers_seen) >= 1
        assert all(0 <= w["slot_items"] <= w["items"] and w["cpu_s"] >= 0 for w in workers_seen)
    wait_until(lambda: not any(pid_alive(pid) for pid in workers), 30)  # none outlives the server


def test_which_servers_get_a_pool(adapters):
    from encode_server.assembly import make_preprocess_pool

    qwen = adapters["tiny-qwen2.5-vl"]
    assert make_preprocess_pool(Settings(), qwen, LIMITS) is None  # the default: in-process
    made = make_preprocess_pool(Settings(preprocess_workers=3), qwen, LIMITS)
    assert isinstance(made, PreprocessPool) and made.size == 3  # not started: no process yet
    made.close()
    assert made.submit("image", [b"x"]).result(timeout=5)[0].status == 503  # closed before it started: no hang
    assert make_preprocess_pool(Settings(preprocess_workers=2, tp_size=2), qwen, LIMITS) is None
    unpicklable = Sabotaged(qwen)
    unpicklable.processor.sizing = lambda: None  # a processor must pickle: one that does not is refused loudly
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        make_preprocess_pool(Settings(preprocess_workers=2), unpicklable, LIMITS)


def test_spare_items_wait_for_dispatched_ones_and_claimed_ones_go_first(adapters):
    """The order in which free workers take tasks (`TaskQueue`): a dispatched batch's items first, then spare
    items of claimed submissions, then other spare items in submission order; cancelled ones never. And a
    pool closed with spare work waiting fails it too (no hang)."""
    from concurrent.futures import Future

    from encode_server.preprocessing.tasks import Submission, Task, TaskQueue

    queue = TaskQueue()
    submissions = {}
    for name, raws, spare in (("early", [b"early-0", b"early-1"], True), ("dropped", [b"dropped"], True),
                              ("later", [b"later"], True), ("batch", [b"batch"], False),
                              ("left", [b"left"], True)):
        submission = submissions[name] = Submission(Future(), "image", [None] * len(raws), len(raws), spare)
        queue.add(submission, [Task(submission, index, raw, f"mm_items[{index}]") for index, raw in enumerate(raws)])
    assert submissions["dropped"].future.cancel()
    submissions["later"].spare = False  # claimed: its request was dispatched meanwhile
    order = []
    while (task := queue.take()) is not None and len(order) < 4:
        order.append(task.raw)
    assert order == [b"batch", b"later", b"early-0", b"early-1"]
    assert task.raw == b"left" and queue.take() is None and not queue

    pool = PreprocessPool(adapters["tiny-qwen2.5-vl"], LIMITS, workers=1)  # not started: nothing takes tasks
    left = pool.submit("image", [b"left"], spare=True)
    pool.claim(pool.submit("image", [b"claimed"], spare=True))
    pool.close()
    assert left.result(timeout=5)[0].status == 503


def test_server_prepares_queued_requests_ahead_and_uses_that_work(adapters):
    """A burst on a one-worker pool with batches of at most two: queued requests are prepared ahead by the
    idle worker (`ahead_items`), each item is prepared exactly once, and every answer equals the image's
    embedding computed in this process."""
    import base64

    import httpx

    from tests.support.helpers import ServerProcess

    qwen = adapters["tiny-qwen2.5-vl"]
    images = [encoded(448, 336, 700 + i, "JPEG") for i in range(12)]

    async def post_all(url: str) -> list:
        async with httpx.AsyncClient(timeout=180) as client:
            return await asyncio.gather(*(client.post(url + "/encode", json={
                "req_id": f"ahead-{i}", "modality": "image", "mm_items": [base64.b64encode(data).decode()],
                "return_embedding": True}) for i, data in enumerate(images)))

    with ServerProcess("--preprocess-workers", "1", "--max-batch-size", "2", "--max-wait-ms", "0",
                       "--cache-bytes", "0", startup_timeout=300) as server:
        before = httpx.get(server.url + "/v1/performance", timeout=60).json()["preprocess_workers"][0]
        responses = asyncio.run(post_all(server.url))
        after = httpx.get(server.url + "/v1/performance", timeout=60).json()["preprocess_workers"][0]
    assert [r.status_code for r in responses] == [200] * len(images)
    for response, data in zip(responses, images):
        payload = response.json()
        got = np.frombuffer(base64.b64decode(payload["embedding"]), "<f4").reshape(payload["embedding_shape"])
        np.testing.assert_allclose(got, qwen.forward(reference(qwen, "image", [data])).numpy(), rtol=1e-5, atol=1e-5)
    assert after["items"] - before["items"] == len(images)  # work ahead was used, never redone
    assert after["ahead_items"] - before["ahead_items"] >= 1


def test_engine_uses_work_ahead_once_and_gives_back_what_it_forgets(adapters):
    """`EncoderEngine.prefetch` with a real one-worker pool: a prefetched job's results are used by its
    batch (right rows, not prepared twice); forgotten ones give their slots back (the worker has 8: nine
    forgotten jobs would otherwise leave none, and later items would come back in one-off blocks)."""
    from encode_server.engine import EncoderEngine
    from encode_server.ops.metrics import ServerMetrics
    from encode_server.records import EncodeJob, PartMeta

    qwen = adapters["tiny-qwen2.5-vl"]

    def job(req_id: str, data: bytes) -> EncodeJob:
        layout = qwen.processor.item_layout("image", decode_bytes("image", data, LIMITS, "x"))
        return EncodeJob(meta=PartMeta(req_id=req_id, part_idx=0, num_parts=1, modality="image"), items=(None,),
                         layouts=(layout,), raw_items=(data,))

    pool = PreprocessPool(qwen, LIMITS, workers=1)
    pool.start()
    engine = EncoderEngine(qwen, ServerMetrics(), None, pool)
    try:
        assert engine.can_prefetch
        for index in range(10):
            forgotten = job(f"gone-{index}", encoded(224, 168, 800 + index, "JPEG"))
            assert engine.prefetch(forgotten)
            if index < 9:  # nine done (they hold slots until given back), the last one forgotten at once
                wait_until(lambda job=forgotten: engine.prepared_ahead(job), 60)
            engine.forget_prefetch(forgotten)
        ahead, fresh = job("ahead", encoded(140, 84, 900)), job("fresh", encoded(84, 140, 901))
        assert engine.prefetch(ahead) and not engine.prefetch(ahead)  # once per job
        wait_until(lambda: engine.prepared_ahead(ahead), 60)
        before = pool.stats()[0]
        parts = asyncio.run(engine.encode("image", [ahead, fresh]))
        after = pool.stats()[0]
        for part, data in zip(parts, (ahead.raw_items[0], fresh.raw_items[0])):
            torch.testing.assert_close(part.embedding, qwen.forward(reference(qwen, "image", [data])),
                                       rtol=1e-5, atol=1e-5)
        assert after["items"] - before["items"] == 1  # only the fresh job's item: the other was ready
        assert after["slot_items"] - before["slot_items"] == 1  # a free slot: none leaked
        assert not engine._prefetched
    finally:
        engine.close()
        pool.close()
