"""SGLang 0.5.23, the whole engine, end to end: its greedy tokens alone, then with this server as its encoder.

Runs in the project's venv from the repository root, with SGLang in the side venv that
`tools/compat/e2e_sglang.sh` builds (`.sglang-venv` by default):

    PYTHONPATH=$PWD .venv/bin/python tools/compat/e2e_sglang.py [--sglang-python .sglang-venv/bin/python]
        [--modes zmq_to_scheduler zmq_to_tokenizer grpc mooncake] [--tokens 12] [--reuse-reference]
        [--server-root CHECKOUT]

On a tiny Qwen2-VL checkpoint built here (a two-layer language model and vision tower, its full processor and
an offline byte-level tokenizer: `tools/compat/e2e_common.py`) it starts:

1. SGLang alone (`sglang.launch_server`, the monolithic server: its own vision tower), and sends the prompts:
   one image, two images in one prompt, three images in one prompt, all three prompts at once, then again one
   after the other (the per-request times). Greedy (`temperature` 0, `ignore_eos`), `max_new_tokens` tokens;
   the ids come from `/generate`'s `output_ids`. These are the reference.
2. Per mode: this server (`--model` the same folder, `--wire-format sglang`, and `--grpc-port` for `grpc`)
   and SGLang `--language-only --encoder-urls http://127.0.0.1:PORT --encoder-transfer-backend MODE`
   (`grpc`: `--encoder-urls grpc://127.0.0.1:GRPC_PORT` with `SGLANG_ENCODER_MM_RECEIVER_MODE=grpc` and
   `zmq_to_tokenizer`, the only pairing SGLang 0.5.23 survives, and
   `SGLANG_ENCODER_BOOTSTRAP_HEALTH_CHECK_INTERVAL=0`: SGLang's encoder registry probes each URL with an HTTP
   `GET /health` and evicts a `grpc://` one). The same prompts must give exactly the
   reference tokens; this server's `encoder_requests_total` must have grown by the requests SGLang sent
   (a language-only SGLang has no vision tower: nothing else could have made the rows).
3. The negative control, in the first mode: this server on the control checkpoint (the same folder with its
   vision tower's weights changed), behind the same SGLang: the tokens must differ from the reference.

SGLang runs on the CPU as found workable: `--device cpu --attention-backend torch_native
--mm-attention-backend sdpa --disable-cuda-graph --skip-server-warmup`, `SGLANG_USE_CPU_ENGINE` unset (it needs
sgl-kernel's CPU build, which the registry lacks). SGLang's rotary-embedding layer imports
`vllm._custom_ops.rotary_embedding` at import time on a CPU: a module of that name (written under the work
folder, on SGLang's `PYTHONPATH` only) lets it start; it fails loudly and leaves a marker file if it is
ever called, and the tool checks that it never was. `mooncake` needs a CUDA device on SGLang's side (its
receiver allocates the landing pool on `cuda:N`): it is run only when asked for, and is reported as what
it is. Prints a pass/fail line per check and the figures (start times, per-request times); exit status 0
when every check passed. Not run by CI (the side venv is several GB).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.compat.e2e_common import (  # noqa: E402
    ROOT,
    Process,
    build_checkpoint,
    build_control,
    data_url,
    encode_server,
    figure,
    free_port,
    png,
    record,
    stop_on_sigterm,
    summary,
)

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--mm-attention-backend", "sdpa",
             "--disable-cuda-graph", "--skip-server-warmup", "--context-length", "2048", "--max-total-tokens",
             "8192", "--max-running-requests", "4", "--log-level", "info")

SHIM = '''"""Stand-in for vLLM's compiled ops, on SGLang's path only: SGLang imports `rotary_embedding` from here at
import time on a CPU. Calling it means SGLang took a path the end-to-end run does not expect."""
import os


def rotary_embedding(*args, **kwargs):
    marker = os.environ.get("E2E_SHIM_MARKER")
    if marker:
        open(marker, "a").write("called\\n")
    raise RuntimeError("vllm._custom_ops.rotary_embedding stand-in called")
'''


def prompts() -> list[dict]:
    """Three prompts: one, two and three images (different sizes, so different row counts)."""
    images = [data_url(png(56, 84, 1)), data_url(png(112, 56, 2)), data_url(png(84, 84, 3)),
              data_url(png(140, 56, 4)), data_url(png(56, 56, 5)), data_url(png(98, 70, 6))]
    groups = [images[:1], images[1:3], images[3:6]]
    return [{"text": "Describe " + " and ".join([PLACEHOLDER] * len(group)) + " please.", "image_data": group}
            for group in groups]


def control_prompts() -> list[dict]:
    images = [data_url(png(70, 70, 41)), data_url(png(84, 56, 42))]
    return [{"text": f"Describe {PLACEHOLDER} and {PLACEHOLDER} please.", "image_data": images}]


def generate(url: str, prompt: dict, tokens: int) -> tuple[list[int], float]:
    body = {**prompt, "sampling_params": {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}}
    started = time.monotonic()
    answer = httpx.post(url + "/generate", json=body, timeout=600)
    elapsed = time.monotonic() - started
    if answer.status_code != 200:
        raise RuntimeError(f"/generate answered {answer.status_code}: {answer.text[:600]}")
    result = answer.json()
    ids = result.get("output_ids")
    if ids is None:
        raise RuntimeError(f"/generate gave no output_ids: {str(result)[:600]}")
    return list(ids), elapsed


def run_prompts(url: str, batch: list[dict], tokens: int, label: str) -> list[list[int]]:
    """All prompts at once (the tokens kept), then one after the other (the per-request times)."""
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        concurrent_ids = [ids for ids, _ in pool.map(lambda prompt: generate(url, prompt, tokens), batch)]
    figure(f"{label}: {len(batch)} concurrent requests, all answered", time.monotonic() - started)
    for index, prompt in enumerate(batch):
        ids, elapsed = generate(url, prompt, tokens)
        figure(f"{label}: request {index} ({len(prompt['image_data'])} image(s)) alone", elapsed)
        if ids != concurrent_ids[index]:
            record(f"{label}: request {index} gives the same tokens alone as among concurrent requests", False,
                   f"{ids} vs {concurrent_ids[index]}")
    return concurrent_ids


def requests_total(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(match.group(1)) for match in re.finditer(r"^encoder_requests_total\{[^}]*\} ([0-9.e+]+)$",
                                                                text, re.MULTILINE))


class Sglang:
    """`sglang.launch_server` from the side venv, the import stand-in on its path."""

    def __init__(self, python: str, work: Path, model: Path) -> None:
        self.python, self.work, self.model = python, work, model
        self.shim = work / "sglang-shim"
        (self.shim / "vllm").mkdir(parents=True, exist_ok=True)
        (self.shim / "vllm" / "__init__.py").write_text('"""Import stand-in for SGLang on a CPU."""\n')
        (self.shim / "vllm" / "_custom_ops.py").write_text(SHIM)
        self.marker = work / "shim-called"
        self.marker.unlink(missing_ok=True)

    def process(self, name: str, port: int, *flags: str, env: dict[str, str] | None = None) -> Process:
        environment = {"PYTHONPATH": str(self.shim), "E2E_SHIM_MARKER": str(self.marker), **(env or {})}
        environment.pop("SGLANG_USE_CPU_ENGINE", None)
        os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
        return Process(name, [self.python, "-m", "sglang.launch_server", "--model-path", str(self.model),
                              "--host", "127.0.0.1", "--port", str(port), *CPU_FLAGS, *flags],
                       self.work / f"{name}.log", env=environment, cwd=self.work)


def language_only(sglang: Sglang, mode: str, encoder_port: int, grpc_port: int | None) -> Process:
    if mode == "grpc":
        return sglang.process(f"sglang-language-{mode}", free_port(), "--language-only", "--encoder-urls",
                              f"grpc://127.0.0.1:{grpc_port}", "--encoder-transfer-backend", "zmq_to_tokenizer",
                              env={"SGLANG_ENCODER_MM_RECEIVER_MODE": "grpc",
                                   # its encoder registry probes every URL with an HTTP GET of /health, which a
                                   # grpc:// URL never answers: it would evict the encoder after three probes
                                   "SGLANG_ENCODER_BOOTSTRAP_HEALTH_CHECK_INTERVAL": "0"})
    return sglang.process(f"sglang-language-{mode}", free_port(), "--language-only", "--encoder-urls",
                          f"http://127.0.0.1:{encoder_port}", "--encoder-transfer-backend", mode)


def our_server(args, name: str, model: Path, port: int, grpc_port: int | None, mode: str) -> Process:
    flags = ["--model", str(model), "--wire-format", "sglang", "--log-level", "info"]
    if grpc_port is not None:
        flags += ["--grpc-port", str(grpc_port)]
    if mode == "mooncake":
        flags += ["--encoder-transfer-backend", "mooncake", "--mooncake-protocol", "tcp"]
    return encode_server(name, port, args.work, *flags, python=args.server_python, root=args.server_root)


def run_mode(args, sglang: Sglang, model: Path, control: Path, mode: str, reference: list[list[int]],
             control_reference: list[list[int]], with_control: bool) -> None:
    port = free_port()
    grpc_port = free_port() if mode == "grpc" else None
    batch = prompts()
    with our_server(args, f"encoder-{mode}", model, port, grpc_port, mode) as ours:
        figure(f"this server start ({mode})", ours.ready(f"http://127.0.0.1:{port}/health", 300))
        with language_only(sglang, mode, port, grpc_port) as engine:
            url = f"http://127.0.0.1:{engine.command[engine.command.index('--port') + 1]}"
            try:
                figure(f"SGLang language-only start ({mode})", engine.ready(url + "/health", args.start_timeout))
            except RuntimeError as error:
                record(f"{mode}: SGLang --language-only starts", False, str(error)[-1500:])
                return
            before = requests_total(f"http://127.0.0.1:{port}")
            try:
                tokens = run_prompts(url, batch, args.tokens, f"SGLang language-only + this server ({mode})")
            except Exception as error:  # noqa: BLE001 - what SGLang answered is the finding
                record(f"{mode}: SGLang language-only + this server answers the prompts", False,
                       f"{error}\n{engine.tail(25)}"[-2000:])
                return
            used = requests_total(f"http://127.0.0.1:{port}") - before
            for index, (ours_ids, alone) in enumerate(zip(tokens, reference)):
                record(f"{mode}: prompt {index} ({len(batch[index]['image_data'])} image(s)) tokens equal SGLang "
                       f"alone's", ours_ids == alone, f"{ours_ids}" if ours_ids == alone else
                       f"{ours_ids} vs alone {alone}")
            # each prompt was sent twice (concurrently, then alone); each is one /encode (one encoder, one part)
            expected = 2 * len(batch)
            record(f"{mode}: every image was encoded by this server", used >= expected,
                   f"encoder_requests_total grew by {used:g} for {expected} SGLang requests")
            if with_control:
                ours.__exit__(None, None, None)
                with our_server(args, "encoder-control", control, port, grpc_port, mode) as changed:
                    changed.ready(f"http://127.0.0.1:{port}/health", 300)
                    control_tokens = [generate(url, prompt, args.tokens)[0] for prompt in control_prompts()]
                record(f"{mode}: negative control: rows changed on purpose change the tokens",
                       control_tokens != control_reference,
                       f"changed rows {control_tokens} vs SGLang alone {control_reference}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sglang-python", default=str(ROOT / ".sglang-venv" / "bin" / "python"))
    parser.add_argument("--server-python", default=None, help="this server's interpreter (default: this one)")
    parser.add_argument("--server-root", type=Path, default=None,
                        help="the checkout this server runs from (default: this one)")
    parser.add_argument("--modes", nargs="+", default=["zmq_to_scheduler", "zmq_to_tokenizer", "grpc"],
                        choices=["zmq_to_scheduler", "zmq_to_tokenizer", "grpc", "mooncake"])
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--reuse-reference", action="store_true",
                        help="take SGLang alone's tokens from the work folder's last run instead of starting it")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--work", type=Path, default=ROOT / ".e2e-work")
    args = parser.parse_args()
    stop_on_sigterm()
    args.work = args.work.resolve()
    model = build_checkpoint(args.work / "qwen2-vl")
    control = build_control(model, args.work / "qwen2-vl-control")
    sglang = Sglang(args.sglang_python, args.work, model)

    batch = prompts()
    saved = args.work / f"sglang-alone-{args.tokens}.json"
    reused = args.reuse_reference and saved.exists()
    if reused:
        reference, control_reference = json.loads(saved.read_text())
    else:
        with sglang.process("sglang-alone", free_port()) as alone:
            url = f"http://127.0.0.1:{alone.command[alone.command.index('--port') + 1]}"
            figure("SGLang alone start", alone.ready(url + "/health", args.start_timeout))
            reference = run_prompts(url, batch, args.tokens, "SGLang alone")
            control_reference = [generate(url, prompt, args.tokens)[0] for prompt in control_prompts()]
        saved.write_text(json.dumps([reference, control_reference]))
    print(f"SGLang alone: {reference}", flush=True)
    record("SGLang alone generates tokens for every prompt" + (" (its last run's)" if reused else ""),
           all(len(ids) == args.tokens for ids in reference))

    for index, mode in enumerate(args.modes):
        try:
            run_mode(args, sglang, model, control, mode, reference, control_reference, with_control=index == 0)
        except Exception as error:  # noqa: BLE001 - one mode's failure is reported, the others still run
            record(f"{mode}: end to end", False, repr(error)[-1500:])
    record("the vllm._custom_ops stand-in was never called", not sglang.marker.exists())
    return summary()


if __name__ == "__main__":
    sys.exit(main())
