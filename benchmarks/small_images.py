"""Small images on every core: 56x56 PNGs through the server, closed loop, and where each server thread's CPU went.

The server (`tiny-qwen2.5-vl`, `--max-batch-size 32`, `--cache-bytes 0`: the payloads repeat) on all the
machine's cores, this process's load generator beside it; after a warm-up of 500 requests, `--requests` at
`--concurrency`. Prints throughput, the mean batch, each server thread's CPU per request (`/proc`, Linux) and
the load generator's own. `--tree` runs the server from another checkout (its `encode_server`), with this
checkout's load generator, so that two trees compare under the very same load:

    python benchmarks/small_images.py --rounds 2 --tree ../encode-server-before    # alternates the two

Not a test: the figures only mean something on a machine that is otherwise quiet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `python benchmarks/small_images.py` from anywhere

from benchmarks.pinned import per_request_ms, thread_cpu_s  # noqa: E402


def run(tree: Path, concurrency: int, requests: int, image_size: int) -> dict:
    from encode_server.bench.launcher import ServerProcess
    from encode_server.bench.load import closed_loop, make_payloads

    payloads = make_payloads("image", 64, image_size)
    env = {"PYTHONPATH": str(tree)}
    with ServerProcess("--model", "tiny-qwen2.5-vl", "--cache-bytes", "0", "--max-batch-size", "32",
                       startup_timeout=300, cwd=tree, env=env) as server:
        asyncio.run(closed_loop(server.url, "warm-up", concurrency, 500, "image", payloads))
        before, client = thread_cpu_s(server.proc.pid), os.times()
        result = asyncio.run(closed_loop(server.url, "small", concurrency, requests, "image", payloads, warm=0))
        after, client_after = thread_cpu_s(server.proc.pid), os.times()
    by_thread = per_request_ms(before, after, result.requests)
    client_ms = ((client_after.user - client.user) + (client_after.system - client.system)) * 1e3 / result.requests
    return {"tree": str(tree), "throughput_rps": round(result.throughput_rps, 1), "p99_ms": round(result.p99_ms, 1),
            "mean_batch_size": round(result.mean_batch_size, 1),
            "server_cpu_ms_per_request": round(sum(by_thread.values()), 3), "by_thread": by_thread,
            "load_generator_cpu_ms_per_request": round(client_ms, 3)}


def main(argv=None) -> None:
    from encode_server.bench.machine import describe_machine

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, help="another checkout to run the server from, alternating with this")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--image-size", type=int, default=56)
    args = parser.parse_args(argv)
    print(describe_machine()[1], flush=True)
    trees = [ROOT] + ([args.tree.resolve()] if args.tree else [])
    for _ in range(args.rounds):
        for tree in trees:
            print(json.dumps(run(tree, args.concurrency, args.requests, args.image_size)), flush=True)


if __name__ == "__main__":
    main()
