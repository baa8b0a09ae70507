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
machine that is otherwise quiet; say which machine, and whether it was shared, with any figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

CONFIGS = ("ours", "sglang", "sglang-batch32")

#: The request ids of a run: fixed width, so that one never is the prefix of another inside frame 0.
RID = re.compile(rb"cmp-\d{3}-\d{6}")


def build_checkpoint(folder: Path) -> Path:
    """A tiny Qwen2.5-VL checkpoint both servers load: the built-in `tiny-qwen2.5-vl` tower's shape
    (4 blocks, width 128, patch 14, merge 2), a two-layer language model (SGLang's loader builds the
    whole model config), the image processor bounded to 56x56..448x448 and an offline byte-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    specials = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={char: index for index, char in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>", additional_special_tokens=specials)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in zip(
        ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"), specials)}
    end = tokenizer.eos_token_id
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=512, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=end, eos_token_id=end,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
        vision_config=dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=128,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[1, 3]),
        **ids,
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    model.config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=448 * 448)
    videos = Qwen2VLVideoProcessor(size={"shortest_edge": 56 * 56, "longest_edge": 448 * 448})
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    Qwen2_5_VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=videos).save_pretrained(folder)
    return folder


def tree_cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process and all its descendants alive now (Linux `/proc`)."""
    from encode_server.ops.memory import cpu_seconds

    total, pending, seen = 0.0, [pid], set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        total += cpu_seconds(current) or 0.0
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                with contextlib.suppress(OSError):
                    children = Path(f"/proc/{current}/task/{task}/children").read_text()
                    pending += [int(child) for child in children.split()]
    return total


class Server:
    """One server under test, started by `argv` on `core` alone; `url` once `/health` answers 200."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict[str, str], core: int | None,
                 startup_timeout: float = 300.0) -> None:
        self.name, self.port, self.startup_timeout = name, port, startup_timeout
        self.url = f"http://127.0.0.1:{port}"
        self.argv = (["taskset", "-c", str(core)] if core is not None else []) + argv
        self.env = {**os.environ, **env}
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"compare-{name}-", suffix=".log", delete=False)

    def __enter__(self) -> Server:
        import httpx

        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was ready:\n"
                                   f"{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError(f"{self.name} did not answer /health within {self.startup_timeout:g} s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(Path(self.log.name).read_text().splitlines()[-lines:])

    def __exit__(self, *exc) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGINT)  # its own session: the server and whatever it started
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def server_for(config: str, args, folder: Path, port: int) -> Server:
    if config == "ours":
        argv = [sys.executable, "-m", "encode_server", "--model", str(folder), "--host", "127.0.0.1", "--port",
                str(port), "--wire-format", "sglang", "--cpu-threads", "1", "--log-level", "warning",
                *args.ours_flag]
        return Server(config, argv, port, {}, args.server_core)
    if not args.sglang_python:
        raise SystemExit("python benchmarks/sglang_compare.py: give the Python of a venv with SGLang 0.5.23 "
                         "(--sglang-python or SGLANG_PYTHON; tools/compat/sglang_compat.sh VENV builds one)")
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


@dataclass
class Point:
    config: str
    round: int
    requests: int
    errors: int
    throughput_rps: float
    p50_ms: float
    p99_ms: float
    cpu_ms_per_request: float | None


async def drive(url: str, items: list[str], tag: int, concurrency: int, warm: list[str], pid: int | None,
                timeout: float = 120.0) -> tuple[list[float], int, float, float | None]:
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
    latencies: list[float] = []
    errors = 0
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

            await asyncio.gather(*(one(f"cmp-{tag:03d}-{900000 + i:06d}", item) for i, item in enumerate(warm)))
            cpu_before = tree_cpu_seconds(pid) if pid else None
            counter = iter(range(len(items)))

            async def worker() -> None:
                nonlocal errors
                for index in counter:
                    latency = await one(f"cmp-{tag:03d}-{index:06d}", items[index])
                    if latency is None:
                        errors += 1
                    else:
                        latencies.append(latency)

            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            wall = time.perf_counter() - started
            cpu = tree_cpu_seconds(pid) - cpu_before if pid else None
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        pull.close(linger=0)
        context.term()
    return latencies, errors, wall, cpu


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values) or [0.0]
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarise(points: list[Point]) -> list[dict]:
    """Per configuration: the median of the rounds and their range, for each figure."""
    rows = []
    for config in dict.fromkeys(point.config for point in points):
        mine = [point for point in points if point.config == config]
        row: dict = {"config": config, "rounds": len(mine), "errors": sum(point.errors for point in mine)}
        for field in ("throughput_rps", "p50_ms", "p99_ms", "cpu_ms_per_request"):
            values = [getattr(point, field) for point in mine if getattr(point, field) is not None]
            row[field] = statistics.median(values) if values else None
            row[field + "_range"] = (min(values), max(values)) if values else None
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """The comparison as a Markdown table, with ours against each SGLang setting below it."""
    def cell(row: dict, field: str, digits: int) -> str:
        if row[field] is None:
            return "n/a"
        low, high = row[field + "_range"]
        spread = f" ({low:.{digits}f}-{high:.{digits}f})" if row["rounds"] > 1 else ""
        return f"{row[field]:.{digits}f}{spread}"

    lines = ["| server | rounds | req/s | p50 ms | p99 ms | CPU ms/req | errors |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {row['config']} | {row['rounds']} | {cell(row, 'throughput_rps', 0)} | {cell(row, 'p50_ms', 1)} | "
              f"{cell(row, 'p99_ms', 1)} | {cell(row, 'cpu_ms_per_request', 2)} | {row['errors']} |" for row in rows]
    ours = next((row for row in rows if row["config"] == "ours"), None)
    for row in rows:
        if ours is None or row is ours or not row["throughput_rps"] or not row["p99_ms"]:
            continue
        lines.append(f"ours / {row['config']}: throughput x{ours['throughput_rps'] / row['throughput_rps']:.2f}, "
                     f"p99 x{ours['p99_ms'] / row['p99_ms']:.2f} (medians)")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python benchmarks/sglang_compare.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sglang-python", default=os.environ.get("SGLANG_PYTHON"),
                        help="the Python of a venv with SGLang 0.5.23 (tools/compat/sglang_compat.sh builds one) "
                             "[env: SGLANG_PYTHON]")
    parser.add_argument("--configs", type=lambda text: [x for x in text.split(",") if x], default=list(CONFIGS),
                        help=f"comma-separated, run in this order each round: {', '.join(CONFIGS)}")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (each server started afresh)")
    parser.add_argument("--requests", type=int, default=400, help="timed requests per round and server")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=56)
    parser.add_argument("--server-core", type=int, default=0, help="the one core each server runs on")
    parser.add_argument("--client-core", type=int, default=1, help="the core of the load generator")
    parser.add_argument("--no-pin", action="store_true", help="run without taskset (figures not comparable)")
    parser.add_argument("--checkpoint", type=Path, help="the checkpoint folder (built there if missing; "
                                                        "default: a temporary folder)")
    parser.add_argument("--ours-flag", action="append", default=[], help="an extra flag for our server (repeatable)")
    parser.add_argument("--out", type=Path, help="write the points and the summary to this JSON file")
    args = parser.parse_args(argv)
    unknown = [config for config in args.configs if config not in CONFIGS]
    if unknown:
        parser.error(f"unknown --configs {', '.join(unknown)}: choose from {', '.join(CONFIGS)}")
    if args.rounds < 1 or args.requests < 1 or args.concurrency < 1:
        parser.error("--rounds, --requests and --concurrency must be at least 1")
    if args.no_pin:
        args.server_core = args.client_core = None
    return args


@contextlib.contextmanager
def pinned(core: int | None) -> Iterator[None]:
    own = os.sched_getaffinity(0)
    if core is not None:
        os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


def main(argv=None) -> list[dict]:
    from encode_server.bench.launcher import free_port
    from encode_server.bench.load import make_payloads

    args = parse_args(argv)
    if any(config != "ours" for config in args.configs) and not args.sglang_python:
        raise SystemExit("python benchmarks/sglang_compare.py: give the Python of a venv with SGLang 0.5.23 "
                         "(--sglang-python or SGLANG_PYTHON; tools/compat/sglang_compat.sh VENV builds one)")
    with contextlib.ExitStack() as stack:
        folder = args.checkpoint or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="compare-")))
        build_checkpoint(folder)
        runs = len(args.configs) * args.rounds
        media = make_payloads("image", runs * (args.requests + 8), args.image_size)  # every request its own PNG
        points: list[Point] = []
        for round_ in range(args.rounds):
            for config in args.configs:
                tag = len(points)
                chunk = media[tag * (args.requests + 8):(tag + 1) * (args.requests + 8)]
                with server_for(config, args, folder, free_port()) as server, pinned(args.client_core):
                    latencies, errors, wall, cpu = asyncio.run(drive(
                        server.url, chunk[8:], tag, args.concurrency, chunk[:8], server.proc.pid))
                done = len(latencies)
                point = Point(config, round_, done + errors, errors, done / wall if wall else 0.0,
                              percentile(latencies, 0.5), percentile(latencies, 0.99),
                              1e3 * cpu / done if cpu is not None and done else None)
                points.append(point)
                print(f"round {round_} {config:15s} {point.throughput_rps:7.1f} req/s  p50 {point.p50_ms:7.1f}  "
                      f"p99 {point.p99_ms:7.1f} ms  cpu {point.cpu_ms_per_request or float('nan'):6.2f} ms/req  "
                      f"errors {errors}", flush=True)
    rows = summarise(points)
    print(table(rows), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                        "points": [asdict(p) for p in points], "summary": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()
