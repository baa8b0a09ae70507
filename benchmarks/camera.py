"""The "camera" scenario: camera-sized JPEGs under Qwen2.5-VL's real pixel limits, on a tiny tower.

Preprocessing dominates here (a 1280x720 image becomes 4,784 patches: decode, resize, normalise and
patchify cost far more than the tiny tower's forward), so this measures how well the CPU path
spreads over the cores. `stages` times decode, processor and forward of one image of each size on
one core, and a batch of every image forwarded with and without concatenating its items' pixels;
then three closed loops over the same images, batches of `--batch-size`:

- `inprocess`: decode + processor + forward in this one process on one core (affinity set to one
  CPU, one torch thread): the ceiling of the old design, where one thread preprocessed every batch;
- `pool`: a `PreprocessPool` of `--workers` processes decodes and preprocesses (each item on its own),
  `forward_items` in this process (as the server's forward thread), at most two batches between
  submission and the end of their forward as in the server (the next batch preprocessing while this
  one runs the forward);
  prints each worker's utilisation (CPU seconds and busy seconds over the loop's wall time);
- `service`: the HTTP server on all cores (`--preprocess-workers`), closed loop at `--concurrency`
  after a warm-up round; prints the workers' utilisation as the server reports it.

    python benchmarks/camera.py --mode inprocess,pool --seconds 20
    THP_MEM_ALLOC_ENABLE=1 python benchmarks/camera.py --mode inprocess,pool --workers 2
    THP_MEM_ALLOC_ENABLE=1 python benchmarks/camera.py --mode inprocess,service --workers 0 --seconds 15 \
        --requests 192 --concurrency 8 --rounds 5 --server-arg=--max-wait-ms=5 --server-arg=--cache-bytes=0

`--rounds` alternates the modes and prints the median ratio: the machine's speed drifts from minute to minute.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import statistics
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from encode_server.bench.machine import describe_machine

#: Qwen2.5-VL's own pixel limits (preprocessor_config.json of the published checkpoints).
QWEN25_MIN_PIXELS, QWEN25_MAX_PIXELS = 3136, 12845056
CAMERA_SIZES = ((1280, 720), (1920, 1080))
#: Vision towers the checkpoint can carry: `tiny` (one windowed block, width 32: a small fraction of a camera
#: image's preprocessing on a CPU, as a real tower's forward on a GPU would be); `windowed`, the `tiny-qwen2.5-vl`
#: tower's shape with every block windowed (as 28 of Qwen2.5-VL-7B's 32 are), whose forward grows with a camera
#: image's patches, not with their square; `tiny-qwen2.5-vl`, that tower itself (two full-attention blocks: a camera
#: image's forward takes seconds on a CPU); and `7b`, the published Qwen2.5-VL-7B vision tower's shape (32 blocks,
#: width 1,280, full attention in blocks 7/15/23/31), for a GPU.
VISION_TOWERS = {
    "tiny": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128,
                 fullatt_block_indexes=[]),
    "windowed": dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=128,
                     fullatt_block_indexes=[]),
    "tiny-qwen2.5-vl": dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=128,
                            fullatt_block_indexes=[1, 3]),
    "7b": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
               fullatt_block_indexes=[7, 15, 23, 31]),
}
DEFAULT_CHECKPOINT = Path(tempfile.gettempdir()) / "encode-bench-camera-qwen2.5-vl-d1w32"


def checkpoint_folder(tower: str = "tiny") -> Path:
    """Where `camera_checkpoint` keeps the checkpoint of `tower` (a key of `VISION_TOWERS`)."""
    if tower == "tiny":
        return DEFAULT_CHECKPOINT
    return DEFAULT_CHECKPOINT.with_name(f"encode-bench-camera-qwen2.5-vl-{tower}")


def camera_checkpoint(folder: Path = DEFAULT_CHECKPOINT, tower: str = "tiny", device: str = "cpu") -> Path:
    """A full Qwen2.5-VL checkpoint (fixed seed, random weights, a one-layer language model) with the real
    processor limits and the vision tower `tower` of `VISION_TOWERS`, saved once to `folder`; `device` is where
    the weights are drawn (a GPU draws the 7B tower's 670M in seconds). The server and the loops here load
    the same folder, so they run the same weights."""
    if (folder / "config.json").is_file():
        return folder
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
        vision_config=dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           **VISION_TOWERS[tower]),
    )
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(1234)
        model = Qwen2_5_VLForConditionalGeneration(config).eval()
    if tower == "7b":
        model = model.to(torch.bfloat16)  # half the bytes to write and load; the server computes in bf16 anyway
    staging = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model.save_pretrained(staging)
    Qwen2VLImageProcessorPil(min_pixels=QWEN25_MIN_PIXELS, max_pixels=QWEN25_MAX_PIXELS).save_pretrained(staging)
    os.replace(staging, folder)
    return folder


def camera_tower(folder: Path = DEFAULT_CHECKPOINT):
    from encode_server.models import load_adapter

    return load_adapter(str(camera_checkpoint(folder)), "cpu", "float32")


def camera_jpegs(count: int, seed: int = 0) -> list[bytes]:
    """Camera-like JPEGs (smooth gradients, some noise; quality 90), alternating 1280x720 and 1920x1080."""
    rng = np.random.default_rng(seed)
    images = []
    for index in range(count):
        width, height = CAMERA_SIZES[index % len(CAMERA_SIZES)]
        x = np.linspace(0, 1, width)[None, :, None]
        y = np.linspace(0, 1, height)[:, None, None]
        tint = rng.uniform(0, 255, (1, 1, 3))
        pixels = (tint * x + (255 - tint) * y + rng.normal(0, 12, (height, width, 3))).clip(0, 255)
        buffer = io.BytesIO()
        Image.fromarray(pixels.astype(np.uint8)).save(buffer, "JPEG", quality=90)
        images.append(buffer.getvalue())
    return images


def run_inprocess(adapter, images: list[bytes], batch_size: int, seconds: float) -> dict:
    """Decode + processor + forward, one batch after another, on one core."""
    from encode_server.media.decoding import MediaLimits
    from encode_server.ops.settings import Settings

    torch.set_num_threads(1)
    limits = MediaLimits.from_settings(Settings(), adapter)
    with one_core():
        return _inprocess_loop(adapter, limits, images, batch_size, seconds)


@contextlib.contextmanager
def one_core():
    """Pin this process to its first allowed core for the block, then give the others back: the modes
    that follow (and the processes they start, which inherit the affinity) must have every core."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)


def _inprocess_loop(adapter, limits, images: list[bytes], batch_size: int, seconds: float) -> dict:
    from encode_server.media.decoding import decode_bytes

    def one_batch(batch: list[bytes]) -> None:
        decoded = [decode_bytes("image", data, limits, "x") for data in batch]
        adapter.forward(adapter.processor.preprocess("image", decoded))

    one_batch(images[:1])  # warm-up
    done, started, cpu_started = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - started < seconds:
        batch = [images[(done + i) % len(images)] for i in range(batch_size)]
        one_batch(batch)
        done += batch_size
    wall = time.perf_counter() - started
    cpu_s = time.process_time() - cpu_started
    return {"mode": "inprocess", "images": done, "wall_s": wall, "images_per_s": done / wall,
            "cpu_fraction": cpu_s / wall, "cpu_s_per_image": cpu_s / max(1, done)}


def run_stages(adapter, images: list[bytes], repeats: int = 8) -> dict:
    """Decode, processor and forward of one image of each camera size, and the forward of a batch of all
    `images` prepared one by one (`collate` + `forward` against `forward_items`), on one core: ms per call."""
    from encode_server.media.decoding import MediaLimits, decode_bytes
    from encode_server.ops.settings import Settings

    torch.set_num_threads(1)
    limits = MediaLimits.from_settings(Settings(), adapter)

    def timed(call) -> tuple[float, object]:
        result = call()  # warm-up
        started = time.perf_counter()
        for _ in range(repeats):
            call()
        return (time.perf_counter() - started) / repeats * 1e3, result

    stages = {}
    with one_core():
        for data in images[:len(CAMERA_SIZES)]:
            decode_ms, decoded = timed(lambda data=data: decode_bytes("image", data, limits, "x"))
            processor_ms, prepared = timed(lambda decoded=decoded: adapter.processor.preprocess("image", [decoded]))
            forward_ms, _ = timed(lambda prepared=prepared: adapter.forward(prepared))
            stages["x".join(map(str, decoded.size))] = {"decode_ms": decode_ms, "processor_ms": processor_ms,
                                                          "forward_ms": forward_ms}
        # A batch of every image, prepared one by one (as the pool returns them): concatenated first, or not.
        per_item = [adapter.processor.preprocess("image", [decode_bytes("image", data, limits, "x")])
                    for data in images]
        collated_ms, _ = timed(lambda: adapter.forward(adapter.processor.collate(per_item)))
        items_ms, _ = timed(lambda: adapter.forward_items(per_item))
        stages[f"batch of {len(images)}"] = {"collate_and_forward_ms": collated_ms, "forward_items_ms": items_ms}
    return {"mode": "stages", **stages}


def run_pool(adapter, images: list[bytes], batch_size: int, seconds: float, workers: int) -> dict:
    """The pool prepares batch k+1 while this process forwards batch k (`forward_items`, as the server does)."""
    from encode_server.media.decoding import MediaLimits
    from encode_server.models import PreparedBatch
    from encode_server.ops.settings import Settings
    from encode_server.preprocessing.pool import PreprocessPool

    torch.set_num_threads(1)
    limits = MediaLimits.from_settings(Settings(), adapter)
    pool = PreprocessPool(adapter, limits, workers)
    started_pool = time.perf_counter()
    pool.start()
    start_s = time.perf_counter() - started_pool
    try:
        pool.release(pool.submit("image", images[:workers]).result())  # warm-up
        before = pool.stats()
        cursor = 0

        def next_batch():
            nonlocal cursor
            batch = [images[(cursor + i) % len(images)] for i in range(batch_size)]
            cursor += batch_size
            return pool.submit("image", batch)

        done, forward_s, started, cpu_started = 0, 0.0, time.perf_counter(), time.process_time()
        # As the server's scheduler: at most two batches between dispatch and the end of their forward.
        # While batch k runs its forward, k+1 is in the pool; once k's forward ends, k+2 joins k+1 there.
        pending = deque([next_batch(), next_batch()])
        while time.perf_counter() - started < seconds:
            results = pending.popleft().result(timeout=300)
            prepared = [r for r in results if isinstance(r, PreparedBatch)]
            if len(prepared) != len(results):
                raise RuntimeError(f"items failed: {[r for r in results if not isinstance(r, PreparedBatch)]}")
            forward_started = time.perf_counter()
            adapter.forward_items(prepared)
            pool.release(prepared)
            forward_s += time.perf_counter() - forward_started
            done += len(prepared)
            pending.append(next_batch())
        wall = time.perf_counter() - started
        main_cpu_s = time.process_time() - cpu_started
        for future in pending:
            pool.release(future.result(timeout=300))
        after = pool.stats()
    finally:
        pool.close()
    utilisation = workers_utilisation(before, after, wall)
    workers_cpu_s = sum(worker["cpu_fraction"] for worker in utilisation) * wall
    return {"mode": "pool", "workers": workers, "images": done, "wall_s": wall, "images_per_s": done / wall,
            "collate_and_forward_fraction": forward_s / wall, "main_cpu_fraction": main_cpu_s / wall,
            "cpu_s_per_image": (main_cpu_s + workers_cpu_s) / max(1, done), "pool_start_s": start_s,
            "workers_utilisation": utilisation}


def workers_utilisation(before: list[dict], after: list[dict], wall: float) -> list[dict]:
    """Per worker, between two `PreprocessPool.stats()` snapshots `wall` seconds apart: items (in slots, taken
    as spare work ahead of their batch), CPU and busy time as fractions of `wall`."""
    return [{"worker": a["worker"], "items": a["items"] - b["items"], "slot_items": a["slot_items"] - b["slot_items"],
             "ahead_items": a.get("ahead_items", 0) - b.get("ahead_items", 0),
             "cpu_fraction": (a["cpu_s"] - b["cpu_s"]) / wall, "busy_fraction": (a["busy_s"] - b["busy_s"]) / wall}
            for a, b in zip(after, before)]


def run_service(images: list[bytes], workers: int, concurrency: int, requests: int, extra: list[str],
                checkpoint: Path | None = None) -> dict:
    """The HTTP server with `--preprocess-workers`, closed loop, one image per request, after a warm-up
    round of `concurrency` requests (as the other modes warm up first); the workers' utilisation comes
    from the server's `/v1/performance`."""
    import httpx

    from encode_server.bench.launcher import ServerProcess
    from encode_server.bench.load import closed_loop

    def pool_stats(url: str) -> list[dict]:
        return httpx.get(url + "/v1/performance", timeout=60).json()["preprocess_workers"]

    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/camera.py` from anywhere
    from benchmarks.pinned import per_request_ms, thread_cpu_s

    payloads = [base64.b64encode(data).decode() for data in images]
    # The images repeat round robin: the embedding cache would answer all but the first eight.
    flags = ["--model", str(checkpoint or camera_checkpoint()), "--preprocess-workers", str(workers),
             "--cache-bytes", "0", *extra]
    with ServerProcess(*flags, startup_timeout=600) as server:
        asyncio.run(closed_loop(server.url, "warm-up", concurrency, concurrency, "image", payloads))
        before, threads_before, started = pool_stats(server.url), thread_cpu_s(server.proc.pid), time.perf_counter()
        client_started = time.process_time()
        result = asyncio.run(closed_loop(server.url, f"service-w{workers}", concurrency, requests, "image", payloads,
                                         warm=0))  # warmed up above: every request the threads' CPU covers is counted
        wall = time.perf_counter() - started
        client_cpu_s = time.process_time() - client_started
        utilisation = workers_utilisation(before, pool_stats(server.url), wall)
        # Each server thread's CPU per request: where the cores went (Linux; the workers' processes not included).
        by_thread = per_request_ms(threads_before, thread_cpu_s(server.proc.pid), result.requests)
    return {**result.as_dict(), "mode": "service", "workers": workers, "workers_utilisation": utilisation,
            "server_cpu_ms_per_request_by_thread": by_thread,
            "server_cpu_busy_cores": round(sum(by_thread.values()) * result.requests / 1e3 / wall, 2),
            "load_generator_busy_cores": round(client_cpu_s / wall, 2)}


def run_mode(mode: str, args: argparse.Namespace, images: list[bytes], workers: int) -> dict:
    """One measurement of `mode` (stages, inprocess, pool or service) with the command line's settings."""
    if mode == "service":
        device = "cuda" if args.tower != "tiny" and torch.cuda.is_available() else "cpu"
        checkpoint = camera_checkpoint(checkpoint_folder(args.tower), args.tower, device)
        return run_service(images, workers, args.concurrency, args.requests, args.server_arg, checkpoint)
    adapter = camera_tower()
    if mode == "stages":
        return run_stages(adapter, images)
    if mode == "inprocess":
        return run_inprocess(adapter, images, args.batch_size, args.seconds)
    return run_pool(adapter, images, args.batch_size, args.seconds, workers)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="inprocess,pool",
                        help="comma-separated: stages, inprocess, pool, service")
    parser.add_argument("--workers", type=int, default=None,
                        help="preprocessing workers of pool and service modes (default: every core; service mode "
                             "takes 0: preprocessing in the server process)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--images", type=int, default=8, help="distinct images, reused round robin")
    parser.add_argument("--concurrency", type=int, default=16, help="service mode: closed-loop clients")
    parser.add_argument("--requests", type=int, default=96, help="service mode: requests")
    parser.add_argument("--tower", default="tiny", choices=sorted(VISION_TOWERS),
                        help="service mode: the checkpoint's vision tower (7b: Qwen2.5-VL-7B's shape, for a GPU)")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="service mode: one more server flag (repeat), e.g. --server-arg=--preprocess-device=cuda")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat the modes this many times, alternating, and print the median ratio: the "
                             "machine's speed drifts between minutes, so one round's ratio can stray")
    parser.add_argument("--out", help="append the results as JSON lines to this file")
    args = parser.parse_args(argv)
    print(describe_machine()[1], flush=True)
    workers = len(os.sched_getaffinity(0)) if args.workers is None else args.workers
    images = camera_jpegs(args.images)
    results = []
    ratios: dict[str, list[float]] = {}
    for round_ in range(1, args.rounds + 1):
        by_mode = {}
        for mode in args.mode.split(","):
            result = run_mode(mode, args, images, workers)
            if args.rounds > 1:
                result["round"] = round_
            print(json.dumps(result), flush=True)
            results.append(result)
            by_mode[mode] = result
        if "inprocess" in by_mode:
            base = by_mode["inprocess"]["images_per_s"]
            for mode in ("pool", "service"):
                if mode in by_mode:
                    rate = by_mode[mode].get("images_per_s") or by_mode[mode].get("throughput_rps")
                    ratios.setdefault(mode, []).append(rate / base)
                    print(f"{mode} / inprocess on one core: {rate:.2f} / {base:.2f} = {rate / base:.2f}x", flush=True)
    if args.rounds > 1:
        for mode, values in ratios.items():
            print(f"{mode} / inprocess over {len(values)} rounds: median {statistics.median(values):.2f}x "
                  f"[{min(values):.2f}-{max(values):.2f}]", flush=True)
    if args.out:
        with open(args.out, "a") as sink:
            for result in results:
                sink.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
