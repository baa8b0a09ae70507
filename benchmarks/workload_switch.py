"""Small images, then camera images, then small images again, through one server that is never restarted: what
the overlap choice (`/server_info`'s `overlap`: batches in flight, and why) is after each phase, and each phase's
throughput against the same work in this process on one core.

The server runs with its defaults on every core (no preprocessing workers, `--max-wait-ms 5`, `--cache-bytes 0`:
the phases' images repeat) on the camera benchmark's checkpoint: Qwen2.5-VL's published pixel limits and a tiny
vision tower (`--tower`, one of `benchmarks/camera.py`'s). Each phase is a closed loop: 56x56 PNGs at concurrency
64, or camera-sized JPEGs (1280x720 and 1920x1080) at concurrency 8. Its in-process reference, measured right
before it (the machine's speed drifts between minutes), is decode + processor + forward of the same images in
batches of 32 or 8, one torch thread, pinned to one core. A phase's ratio service / in-process says how much of
the second core the server put to use on that workload; the choice after it says what the server measured; the
second small phase against the first says whether coming back cost anything.

    THP_MEM_ALLOC_ENABLE=1 python benchmarks/workload_switch.py
    THP_MEM_ALLOC_ENABLE=1 python benchmarks/workload_switch.py --phases small,camera,small,camera
    THP_MEM_ALLOC_ENABLE=1 python benchmarks/workload_switch.py --tower windowed

Not a test: the figures only mean something on a machine that is otherwise quiet.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/workload_switch.py` from anywhere

from benchmarks.camera import (  # noqa: E402
    VISION_TOWERS,
    camera_checkpoint,
    camera_jpegs,
    checkpoint_folder,
    run_inprocess,
)
from benchmarks.pinned import per_request_ms, thread_cpu_s  # noqa: E402

#: Each workload: (closed-loop concurrency, batch size of the in-process reference).
WORKLOADS = {"small": (64, 32), "camera": (8, 8)}


def small_pngs(count: int) -> list[bytes]:
    from encode_server.bench.load import make_payloads

    return [base64.b64decode(item) for item in make_payloads("image", count, 56)]


def run_phase(url: str, pid: int, name: str, images: list[bytes], requests: int) -> dict:
    """One closed loop of `requests` through the running server, its threads' CPU per request, and the overlap
    choice after it."""
    import httpx

    from encode_server.bench.load import closed_loop

    concurrency = WORKLOADS[name][0]
    payloads = [base64.b64encode(data).decode() for data in images]
    before = thread_cpu_s(pid)
    result = asyncio.run(closed_loop(url, name, concurrency, requests, "image", payloads, warm=0))
    by_thread = per_request_ms(before, thread_cpu_s(pid), result.requests)
    overlap = httpx.get(url + "/server_info", timeout=30).json().get("overlap", {})
    return {"phase": name, "throughput_rps": round(result.throughput_rps, 2), "p99_ms": round(result.p99_ms, 1),
            "mean_batch_size": round(result.mean_batch_size, 1), "errors": result.errors,
            "server_cpu_ms_per_request": round(sum(by_thread.values()), 3),
            "batches_in_flight": overlap.get("batches_in_flight"), "overlap_reason": overlap.get("reason")}


def main(argv=None) -> None:
    from encode_server.bench.launcher import ServerProcess
    from encode_server.bench.machine import describe_machine
    from encode_server.models import load_adapter

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", default="small,camera,small", help="comma-separated: small, camera")
    parser.add_argument("--small-requests", type=int, default=4000)
    parser.add_argument("--camera-requests", type=int, default=192)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each in-process reference")
    parser.add_argument("--tower", default="tiny", choices=sorted(set(VISION_TOWERS) - {"7b"}),
                        help="the checkpoint's vision tower (benchmarks/camera.py's VISION_TOWERS)")
    parser.add_argument("--server-arg", action="append", default=[], help="one more server flag (repeat)")
    args = parser.parse_args(argv)
    phases = [phase for phase in args.phases.split(",") if phase]
    unknown = [phase for phase in phases if phase not in WORKLOADS]
    if unknown:
        parser.error(f"unknown --phases {', '.join(unknown)}: choose from {', '.join(WORKLOADS)}")
    print(describe_machine()[1], flush=True)
    folder = camera_checkpoint(checkpoint_folder(args.tower), args.tower)
    images = {"small": small_pngs(64), "camera": camera_jpegs(8)}
    requests = {"small": args.small_requests, "camera": args.camera_requests}
    adapter = load_adapter(str(folder), "cpu", "float32")
    ratios: dict[str, list[float]] = {}
    flags = ["--model", str(folder), "--max-wait-ms", "5", "--cache-bytes", "0", *args.server_arg]
    with ServerProcess(*flags, startup_timeout=600) as server:
        for name in phases:
            reference = run_inprocess(adapter, images[name], WORKLOADS[name][1], args.seconds)
            result = run_phase(server.url, server.proc.pid, name, images[name], requests[name])
            ratio = result["throughput_rps"] / reference["images_per_s"]
            ratios.setdefault(name, []).append(ratio)
            print(json.dumps({**result, "inprocess_images_per_s": round(reference["images_per_s"], 2),
                              "service_over_inprocess": round(ratio, 2)}), flush=True)
    for name, values in ratios.items():
        print(f"{name}: service / in-process on one core {', '.join(f'{v:.2f}x' for v in values)}"
              f" (median {statistics.median(values):.2f}x)", flush=True)


if __name__ == "__main__":
    main()
