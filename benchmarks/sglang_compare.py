"""`python benchmarks/sglang_compare.py`: this server against SGLang's own encoder server, side by side in one run.

Both serve the same tiny Qwen2.5-VL checkpoint folder (built here with `save_pretrained`: the built-in
`tiny-qwen2.5-vl` tower's shape, a two-layer language model and a byte-level tokenizer, so SGLang can load
it), each alone on one pinned core (`taskset`; this process and its load on another core). Each request
is the body SGLang's prefill side posts to `/encode` in its `zmq_to_scheduler` form with the destination
in the body (`prefill_host` and `embedding_port` as a list of the ranks' ports, here one PULL socket of
this process), one distinct 56x56 PNG each; the embedding rows come back as SGLang's frames (a pickled
`EmbeddingData`, then the rows), ours with `--wire-format sglang`. A request is done when its rows
arrived on the socket (and its HTTP answer, which both servers send after the push, came back).

Configurations (`--configs`): `ours` (`encode-server` at its defaults, `--wire-format sglang`),
`sglang` (SGLang at its defaults: `SGLANG_ENCODER_MAX_BATCH_SIZE` 8), `sglang-batch32` (the same with
`SGLANG_ENCODER_MAX_BATCH_SIZE=32`). Every round starts each configuration's server afresh, in turn,
so a drift in the machine's load hits all of them (`--rounds`); the table gives per configuration the
median of the rounds and their range: throughput, p50, p99 and the server's CPU time per request (the
whole process tree, from `/proc`). Both servers log at warning level (SGLang's uvicorn access log stays on).

SGLang runs from its own environment, never this one: `--sglang-python` (or `SGLANG_PYTHON`) names
the interpreter of a venv with SGLang 0.5.23, which `tools/compat/sglang_compat.sh VENV` builds:

    tools/compat/sglang_compat.sh .sglang-venv
    python benchmarks/sglang_compare.py --sglang-python .sglang-venv/bin/python --rounds 3

Needs two cores (`--server-core`, `--client-core`). Not a test: figures only mean something on a
machine that is otherwise quiet; say which machine, and whether it was shared, with any figure (the run prints
the CPU model, the cores it sees and the torch version at its start and beside the table). What it shares with
`benchmarks/vllm_compare.py` (the checkpoint, the pinned servers, the closed loop, the rounds, the table) is
`benchmarks/peer_compare.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/sglang_compare.py` from anywhere

from benchmarks.peer_compare import Outcome, Peer, Server, closed_loop, run_rounds  # noqa: E402
from benchmarks.peer_compare import parse_args as parse_peer_args  # noqa: E402

CONFIGS = ("ours", "sglang", "sglang-batch32")
PEER = Peer("benchmarks/sglang_compare.py", CONFIGS, "sglang", "SGLANG_PYTHON",
            "SGLang 0.5.23 (tools/compat/sglang_compat.sh VENV builds one)", "sglang")

#: The request ids of a run: fixed width, so that one never is the prefix of another inside frame 0.
RID = re.compile(rb"cmp-\d{3}-\d{6}")


def server_for(config: str, args, folder: Path, port: int) -> Server:
    if config == "ours":
        argv = [sys.executable, "-m", "encode_server", "--model", str(folder), "--host", "127.0.0.1", "--port",
                str(port), "--wire-format", "sglang", "--cpu-threads", "1", "--log-level", "warning",
                *args.ours_flag]
        return Server(config, argv, port, {}, args.server_core)
    if not args.sglang_python:
        raise SystemExit(PEER.missing)
    argv = [args.sglang_python, "-m", "sglang.launch_server", "--encoder-only", "--device", "cpu", "--dtype",
            "float32", "--model-path", str(folder), "--host", "127.0.0.1", "--port", str(port),
            "--encoder-transfer-backend", "zmq_to_scheduler", "--log-level", "warning"]
    env = {"SGLANG_ENCODER_MAX_BATCH_SIZE": "32"} if config == "sglang-batch32" else {}
    return Server(config, argv, port, env, args.server_core)


def request_body(url: str, rid: str, item: str, port: int) -> dict:
    """What SGLang's prefill side posts for a one-part request in `zmq_to_scheduler` form with the ranks'
    ports in the body (receiver.py, `MMReceiverHTTP.encode`)."""
    return {"encoder_idx": 0, "encoder_url": url, "mm_items": [item], "num_parts": 1, "part_idx": 0,
            "req_id": rid, "modality": "IMAGE", "prefill_host": "127.0.0.1", "embedding_port": [port],
            "time_stats_json": None}


async def drive(url: str, items: list[str], tag: int, concurrency: int, warm: list[str], pid: int | None,
                timeout: float = 120.0) -> Outcome:
    """A closed loop of `len(items)` requests at `concurrency`, each done when its rows arrived on this
    process's PULL socket. Returns the latencies (s), the errors, the wall time and the server's CPU seconds."""
    import aiohttp
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context()
    pull = context.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    waiting: dict[bytes, asyncio.Future] = {}

    async def receive() -> None:
        while True:
            frames = await pull.recv_multipart(copy=True)
            found = RID.search(frames[0])
            future = waiting.pop(found.group(0), None) if found else None
            if future is not None and not future.done():  # rows in a second frame; one frame is an error
                future.set_result((time.perf_counter(), len(frames) == 2 and len(frames[1]) > 0))

    reader = asyncio.ensure_future(receive())
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 8),
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            loop = asyncio.get_running_loop()

            async def one(rid: str, item: str) -> float | None:
                future = loop.create_future()
                waiting[rid.encode()] = future
                started = time.perf_counter()
                try:
                    async with session.post(url + "/encode", json=request_body(url, rid, item, port)) as response:
                        await response.read()
                        ok = response.status == 200
                    arrived, rows = await asyncio.wait_for(future, timeout) if ok else (0.0, False)
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    ok, rows = False, False
                waiting.pop(rid.encode(), None)
                return arrived - started if ok and rows else None

            return await closed_loop(one, items, tag, concurrency, warm, pid)
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        pull.close(linger=0)
        context.term()


def parse_args(argv=None):
    return parse_peer_args(PEER, __doc__, argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)

    def measure(server: Server, items: list[str], tag: int, warm: list[str]) -> Outcome:
        return asyncio.run(drive(server.url, items, tag, args.concurrency, warm, server.proc.pid))

    return run_rounds(PEER, args, lambda config, folder, port: server_for(config, args, folder, port), measure)


if __name__ == "__main__":
    main()
