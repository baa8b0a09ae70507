"""GPU figures on one NVIDIA H100 or H200: camera images through Qwen2.5-VL-7B's vision tower.

The tower has the published 7B shape (32 blocks, width 1,280, windowed attention with full attention in
blocks 7/15/23/31), random weights with a fixed seed, bfloat16; the images are the camera benchmark's
(1280x720 and 1920x1080 JPEGs under Qwen2.5-VL's own pixel limits). Two parts, each optional:

- `forward`: the tower alone on the same batches the service forms (each image preprocessed on its own,
  then `forward_items`), per attention implementation: `loop` (transformers' SDPA, one call per window),
  `grouped` (ours, the default: one SDPA call per window length), `varlen` (ours, off by default: flash
  varlen over the packed rows), each also with the MLP width 3,420 zero-padded to 3,456 (`+aligned-mlp`,
  as the adapters do on CUDA), with their distances from the first and from a float32 run of the same
  weights (the smallest batch size only); both with the transfers (host pixels in, host rows out, as the
  server does) and on device-resident pixels (the compute alone).
- `profile`: torch.profiler over one forward of eight images, the top kernels to `profile.txt`.
- `service`: the HTTP server (`python benchmarks/camera.py --mode service --tower 7b`) closed loop
  with 0, 4 and 15 preprocessing workers, and with `--preprocess-device cuda`.

    PYTHONPATH=$PWD THP_MEM_ALLOC_ENABLE=1 python benchmarks/gpu_camera.py --parts forward,service \
        --out results.jsonl

(`--tower tiny` dry-runs the forward part on a CPU.) The packages the server needs beyond the GPU image's
travel as wheels; docs/BENCHMARKS.md has the command used on one H100.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.camera import camera_checkpoint, camera_jpegs, checkpoint_folder  # noqa: E402


def emit(result: dict, out: str | None) -> None:
    print(json.dumps(result), flush=True)
    if out:
        with open(out, "a") as sink:
            sink.write(json.dumps(result) + "\n")


def environment() -> dict:
    import transformers

    if not torch.cuda.is_available():
        return {"part": "environment", "torch": torch.__version__, "transformers": transformers.__version__,
                "gpu": None}
    return {"part": "environment", "torch": torch.__version__, "transformers": transformers.__version__,
            "gpu": torch.cuda.get_device_name(0),
            "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
            "cpus": len(os.sched_getaffinity(0)), "python": sys.version.split()[0]}


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_ms(call, repeats: int) -> list[float]:
    call()  # warm-up (kernel selection, allocator)
    synchronize()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return times


def float32_rows(adapter, pixels: list[torch.Tensor], grid: torch.Tensor) -> torch.Tensor:
    """The same tower's rows in float32 (weights upcast, transformers' own per-segment loop): the reference
    that tells the bf16 variants' rounding from a fault."""
    tower = copy.deepcopy(adapter.tower).float()
    tower.config._attn_implementation = "sdpa"
    with torch.inference_mode():
        return tower([p.float() for p in pixels], grid_thw=grid).pooler_output.float()


def forward_part(folder: Path, images: list[bytes], batch_sizes: list[int], repeats: int, out: str | None,
                 device: str = "cuda") -> None:
    from encode_server.media.decoding import MediaLimits, decode_bytes
    from encode_server.models import load_adapter
    from encode_server.models.layers import aligned_mlp, packed_attention
    from encode_server.ops.settings import Settings

    aligned_mlp.enabled = False  # the plain tower first; the padded copy is made below
    adapter = load_adapter(str(folder), device, "bfloat16" if device == "cuda" else "float32")
    aligned_mlp.enabled = True
    limits = MediaLimits.from_settings(Settings(), adapter)
    largest = max(batch_sizes)
    prepared = [adapter.processor.preprocess("image", [decode_bytes("image", images[i % len(images)], limits, "x")])
                for i in range(largest)]
    # (attention implementation, varlen allowed, MLP widths padded); `loop` is transformers' own path.
    modes = {"loop": ("sdpa", False, False), "grouped": (packed_attention.PACKED_ATTENTION, False, False),
             "grouped+aligned-mlp (the default)": (packed_attention.PACKED_ATTENTION, False, True),
             "varlen": (packed_attention.PACKED_ATTENTION, True, False),
             "varlen+aligned-mlp": (packed_attention.PACKED_ATTENTION, True, True)}
    padded = None  # the same weights, MLP widths padded (`encode_server/models/layers/aligned_mlp.py`), made on demand
    for size in batch_sizes:
        batch = prepared[:size]
        rows_in = sum(int(item.inputs["pixel_values"].shape[0]) for item in batch)
        on_device = [item.inputs["pixel_values"].to(device, adapter.dtype) for item in batch]
        grid = torch.cat([item.inputs["grid_thw"] for item in batch]).to(device)
        reference = None
        exact = float32_rows(adapter, on_device, grid) if size == min(batch_sizes) else None
        for mode, (implementation, varlen, aligned) in modes.items():
            if mode == "loop" and size > 8:
                continue  # seconds per call; batch 8 shows it
            if aligned and padded is None:
                padded = copy.deepcopy(adapter)
                padded.padded_mlps = aligned_mlp.align_mlp_widths(padded.tower)
            runner = padded if aligned else adapter
            runner.tower.config._attn_implementation = implementation
            packed_attention.use_varlen = varlen
            try:
                with torch.inference_mode():
                    device_rows = runner.tower_rows(on_device, grid, "image")
                    compute = timed_ms(lambda r=runner, p=on_device, g=grid: r.tower_rows(p, g, "image"), repeats)
                full = timed_ms(lambda r=runner, b=batch: r.forward_items(b), repeats)
            except Exception as exc:  # report and go on with the other modes
                emit({"part": "forward", "batch": size, "attention": mode, "error": repr(exc)[:500]}, out)
                continue
            rows = device_rows.float()
            if reference is None:
                reference = rows
            distance = float((rows - reference).norm() / reference.norm())
            from_float32 = None if exact is None else float((rows - exact).norm() / exact.norm())
            emit({"part": "forward", "batch": size, "attention": mode, "rows_in": rows_in,
                  "rows_out": int(rows.shape[0]), "padded_mlps": runner.padded_mlps,
                  "compute_ms": statistics.median(compute),
                  "compute_images_per_s": size / statistics.median(compute) * 1e3,
                  "with_transfers_ms": statistics.median(full),
                  "with_transfers_images_per_s": size / statistics.median(full) * 1e3,
                  "spread_ms": [round(min(full), 1), round(max(full), 1)],
                  "relative_distance_from_first": distance, "relative_distance_from_float32": from_float32,
                  "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None},
                 out)
    adapter.tower.config._attn_implementation = packed_attention.PACKED_ATTENTION
    packed_attention.use_varlen = False
    # The transfers alone, as `forward_items` makes them: fp32 pixels to bf16 on the GPU, rows back.
    pixels = [item.inputs["pixel_values"] for item in prepared[:8]]
    h2d = timed_ms(lambda: [p.to(device, adapter.dtype, non_blocking=True) for p in pixels], repeats)
    back = torch.empty(sum(int(p.shape[0]) for p in pixels) // 4, adapter.info.hidden_size, device=device,
                       dtype=adapter.dtype)
    d2h = timed_ms(lambda: back.to("cpu"), repeats)
    emit({"part": "transfers", "images": 8, "pixels_mb": sum(p.numel() * 4 for p in pixels) / 1e6,
          "h2d_ms": statistics.median(h2d), "rows_mb": back.numel() * 2 / 1e6, "d2h_ms": statistics.median(d2h)}, out)


def profile_part(folder: Path, images: list[bytes], out_dir: str | None, device: str = "cuda") -> None:
    """torch.profiler over one forward of eight camera images (pixels already on the device): the kernels
    and operators that take the time, written to `out_dir`/profile.txt."""
    from torch.profiler import ProfilerActivity, profile

    from encode_server.media.decoding import MediaLimits, decode_bytes
    from encode_server.models import load_adapter
    from encode_server.ops.settings import Settings

    adapter = load_adapter(str(folder), device, "bfloat16" if device == "cuda" else "float32")
    limits = MediaLimits.from_settings(Settings(), adapter)
    batch = [adapter.processor.preprocess("image", [decode_bytes("image", data, limits, "x")]) for data in images[:8]]
    pixels = [item.inputs["pixel_values"].to(device, adapter.dtype) for item in batch]
    grid = torch.cat([item.inputs["grid_thw"] for item in batch]).to(device)
    with torch.inference_mode():
        for _ in range(2):
            adapter.tower_rows(pixels, grid, "image")
        synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        started = time.perf_counter()
        with profile(activities=activities) as prof:
            adapter.tower_rows(pixels, grid, "image")
            synchronize()
        wall_ms = (time.perf_counter() - started) * 1e3
    averages = prof.key_averages()
    tables = [f"wall {wall_ms:.1f} ms (with the profiler)"]
    for key in ("self_cuda_time_total", "self_device_time_total", "self_cpu_time_total", "cpu_time_total"):
        try:
            tables.append(f"== sorted by {key}\n" + averages.table(sort_by=key, row_limit=30, max_name_column_width=70))
        except (AttributeError, KeyError, ValueError):
            continue
    text = "\n".join(tables)
    print(text[:6000], flush=True)
    if out_dir:
        Path(out_dir, "profile.txt").write_text(text)


def service_part(workers: list[int], gpu_preprocess: bool, concurrency: int, requests: int, out: str | None,
                 timeout: float) -> None:
    runs = [(count, []) for count in workers]
    if gpu_preprocess:
        runs.append((0, ["--server-arg=--preprocess-device=cuda"]))
    for count, extra in runs:
        command = [sys.executable, "-m", "benchmarks.camera", "--mode", "service", "--tower", "7b",
                   "--workers", str(count), "--concurrency", str(concurrency), "--requests", str(requests), *extra]
        started = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            emit({"part": "service", "workers": count, "extra": extra, "error": f"timed out after {timeout:g} s",
                  "stderr": (exc.stderr or b"")[-1500:].decode(errors="replace")
                  if isinstance(exc.stderr, bytes) else str(exc.stderr)[-1500:]}, out)
            continue
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            emit({"part": "service", "workers": count, "extra": extra, "rc": done.returncode,
                  "stderr": done.stderr[-3000:]}, out)
            continue
        result = json.loads(lines[-1])
        emit({"part": "service", "workers": count, "extra": extra, "wall_s": time.perf_counter() - started,
              **{key: result.get(key)
                 for key in ("throughput_rps", "p50_ms", "p99_ms", "mean_batch_size", "errors", "requests")},
              "workers_busy": [round(w["busy_fraction"], 2) for w in result.get("workers_utilisation", [])],
              "result": result}, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="forward,service")
    parser.add_argument("--batch-sizes", default="8,32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", default="15,4,0")
    parser.add_argument("--no-gpu-preprocess", action="store_true")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=384)
    parser.add_argument("--service-timeout", type=float, default=150)
    parser.add_argument("--tower", default="7b", help="tiny: a dry run of the forward part on a CPU")
    parser.add_argument("--out")
    args = parser.parse_args()
    emit(environment(), args.out)
    started = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    folder = camera_checkpoint(checkpoint_folder(args.tower), args.tower, device)
    emit({"part": "checkpoint", "folder": str(folder), "seconds": time.perf_counter() - started}, args.out)
    parts = args.parts.split(",")
    if "forward" in parts:
        forward_part(folder, camera_jpegs(8), [int(x) for x in args.batch_sizes.split(",")], args.repeats, args.out,
                     device)
    if "profile" in parts:
        profile_part(folder, camera_jpegs(8), os.path.dirname(args.out) if args.out else None, device)
    if "service" in parts:
        service_part([int(x) for x in args.workers.split(",") if x], not args.no_gpu_preprocess, args.concurrency,
                     args.requests, args.out, args.service_timeout)


if __name__ == "__main__":
    main()
