"""What the peer comparisons (`benchmarks/sglang_compare.py`, `benchmarks/vllm_compare.py`) share: the tiny
checkpoint both servers load, a server under test started alone on one pinned core, the closed loop that drives
it, the rounds that alternate the configurations, and the table of medians and ranges.

A comparison supplies its configurations, how each one's server starts (`server_for`) and what one request is
(`one`, in its own `drive`); the rest is here, so that both peers are measured the same way: the same items
(distinct PNGs, every request its own), each server alone on `--server-core` (`taskset`) and the load generator
on `--client-core`, every round starting each configuration's server afresh, in turn, and per configuration
the median of the rounds and their range (throughput, p50, p99, the server's CPU time per request from `/proc`,
its whole process tree). The machine (`encode_server.bench.machine`) is printed beside the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

#: The language model of the checkpoint SGLang loads: heads 24 wide. An encoder instance never runs it, but
#: SGLang's loader builds the whole model config.
SGLANG_TEXT = dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, mrope_section=[2, 3, 3])
#: The language model of the checkpoint vLLM 0.32 loads (its encoder-only instance still builds it): heads 64
#: wide, the M-RoPE sections adding up to half of that (vLLM asserts it; its CPU attention takes only some widths).
VLLM_TEXT = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, mrope_section=[8, 12, 12])


def build_checkpoint(folder: Path, text: dict = SGLANG_TEXT) -> Path:
    """A tiny Qwen2.5-VL checkpoint both servers load: the built-in `tiny-qwen2.5-vl` tower's shape
    (4 blocks, width 128, patch 14, merge 2), a two-layer language model of `text`'s width and heads (the
    peer's loader builds the whole model), the image processor bounded to 56x56..448x448 and an offline
    byte-level tokenizer. A folder that already holds a checkpoint is taken as it is."""
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
        text_config=dict(vocab_size=512, hidden_size=text["hidden_size"], intermediate_size=2 * text["hidden_size"],
                         num_hidden_layers=2, num_attention_heads=text["num_attention_heads"],
                         num_key_value_heads=text["num_key_value_heads"], bos_token_id=end, eos_token_id=end,
                         rope_parameters={"rope_type": "default", "mrope_section": text["mrope_section"],
                                          "rope_theta": 10000.0}),
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



#: A timed run's outcome: the latencies (s), the errors, the wall time (s), the server's CPU seconds (or None).
Outcome = tuple[list[float], int, float, float | None]


async def closed_loop(one: Callable[[str, str], Awaitable[float | None]], items: list[str], tag: int,
                      concurrency: int, warm: list[str], pid: int | None) -> Outcome:
    """The warm-up requests all at once, then a closed loop of `len(items)` requests at `concurrency`; `one(rid,
    item)` sends one request and gives its latency (s), or None for an error. The request ids are
    `cmp-TAG-INDEX`, of fixed width. Returns the latencies, the errors, the wall time and the server's CPU seconds
    over the timed loop."""
    await asyncio.gather(*(one(f"cmp-{tag:03d}-{900000 + i:06d}", item) for i, item in enumerate(warm)))
    cpu_before = tree_cpu_seconds(pid) if pid else None
    counter = iter(range(len(items)))
    latencies: list[float] = []
    errors = 0

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
    """The comparison as a Markdown table, with ours against each of the peer's settings below it."""
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


@dataclass(frozen=True)
class Peer:
    """The peer of a comparison: the program's name, its configurations, and the option naming the interpreter
    of the peer's own venv (`--<name>-python`, else the environment variable `env`), with `needs`: what the
    venv holds and how to build one."""

    program: str
    configs: tuple[str, ...]
    name: str
    env: str
    needs: str
    package: str

    def versions(self, python: str) -> str:
        """The peer's package and torch versions in its own venv (from their metadata: nothing is imported)."""
        code = ("import importlib.metadata as m\n"
                "def v(name):\n"
                "    try:\n        return m.version(name)\n"
                "    except m.PackageNotFoundError:\n        return 'not installed'\n"
                f"print('{self.package}', v('{self.package}') + ',', 'torch', v('torch'))")
        try:
            done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as error:
            return f"its Python did not answer: {error}"
        return done.stdout.strip() or f"its Python did not answer: {done.stderr.strip()[-300:]}"

    @property
    def missing(self) -> str:
        return f"python {self.program}: give the Python of a venv with {self.needs}: --{self.name}-python or {self.env}"


def parse_args(peer: Peer, description: str, argv=None,
               more: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The peer's interpreter option, `more`'s, then the options every comparison takes."""
    parser = argparse.ArgumentParser(prog=f"python {peer.program}", description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(f"--{peer.name}-python", default=os.environ.get(peer.env),
                        help=f"the Python of a venv with {peer.needs} [env: {peer.env}]")
    if more is not None:
        more(parser)
    configs = peer.configs
    parser.add_argument("--configs", type=lambda text: [x for x in text.split(",") if x], default=list(configs),
                        help=f"comma-separated, run in this order each round: {', '.join(configs)}")
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
    unknown = [config for config in args.configs if config not in configs]
    if unknown:
        parser.error(f"unknown --configs {', '.join(unknown)}: choose from {', '.join(configs)}")
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




#: How one configuration's timed run is measured: (its server, the timed items, the round's tag, the warm-up
#: items) to its outcome.
Measure = Callable[[Server, list[str], int, list[str]], Outcome]

#: Warm-up requests before each timed run.
WARM = 8


def run_rounds(peer: Peer, args: argparse.Namespace, server_for: Callable[[str, Path, int], Server],
               measure: Measure, text: dict = SGLANG_TEXT,
               prepare: Callable[[Path], object] | None = None) -> list[dict]:
    """The checkpoint (`--checkpoint`, else a temporary folder; built with `text`'s language model, then
    `prepare`d), then every round, every
    configuration in turn: its server afresh on the checkpoint, its own items; the per-round lines, then the
    table and the machine; `--out` gets the points, the summary and the machine."""
    from encode_server.bench.launcher import free_port
    from encode_server.bench.load import make_payloads
    from encode_server.bench.machine import describe_machine

    if any(config != "ours" for config in args.configs) and not getattr(args, f"{peer.name}_python"):
        raise SystemExit(peer.missing)
    machine, machine_line = describe_machine()
    peer_python = getattr(args, f"{peer.name}_python")
    if peer_python and any(config != "ours" for config in args.configs):
        machine["peer"] = peer.versions(peer_python)
        machine_line += f"; the peer's venv: {machine['peer']}"
    print(machine_line, flush=True)
    runs = len(args.configs) * args.rounds
    media = make_payloads("image", runs * (args.requests + WARM), args.image_size)  # every request its own PNG
    points: list[Point] = []
    with contextlib.ExitStack() as stack:
        folder = args.checkpoint or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="compare-")))
        build_checkpoint(folder, text)
        if prepare is not None:
            prepare(folder)
        for round_ in range(args.rounds):
            for config in args.configs:
                tag = len(points)
                chunk = media[tag * (args.requests + WARM):(tag + 1) * (args.requests + WARM)]
                with server_for(config, folder, free_port()) as server, pinned(args.client_core):
                    latencies, errors, wall, cpu = measure(server, chunk[WARM:], tag, chunk[:WARM])
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
    print(machine_line, flush=True)
    if args.out:
        args.out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "machine": machine,
                                        "points": [asdict(p) for p in points], "summary": rows}, indent=2))
    return rows
