"""End-to-end time per item, from the encoder request to the rows in the consumer's memory, three ways side by side.

    nixl    `ECCPUConnector` (P2P): `POST /v1/chat/completions`, then the consumer's XferReq, XferAck and NIXL
            READ (`tests/support/nixl_consumer.py`, as vLLM's consumer does), the rows copied out of its region
    files   `ECExampleConnector`: `POST /v1/chat/completions` with `--ec-storage`, then the consumer's
            `safetensors` load of the item's file (as vLLM's `ECExampleConnector` loads it)
    zmq     SGLang's default wire: `POST /encode` with `prefill_host`/`embedding_port`, then the frames an
            `encode_server.receiver.EmbeddingReceiver` takes off its ZMQ socket

Two servers on loopback (the connector's, which also answers `/encode` for the ZMQ wire, and one with
`--ec-storage` in a temporary folder), the same model, the embedding cache off, one request at a time.
Every item is a distinct image (nothing is a cache or storage hit), and the modes take turns item by
item, so drift on a shared machine hits them alike. Each mode's rows are checked bit-identical to the
others' for the same image. Prints per-item milliseconds as median [p10-p90]:

    python benchmarks/epd_transports.py --items 60 --size 224
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=60, help="items per mode")
    parser.add_argument("--size", type=int, default=224, help="each image's side in pixels")
    parser.add_argument("--model", default="tiny-qwen2.5-vl")
    args = parser.parse_args()

    import httpx
    import torch
    from safetensors.torch import load_file

    from encode_server.receiver import EmbeddingReceiver
    from encode_server.transport.nixl import quiet_ucx_exit
    from tests.support.helpers import ServerProcess, free_port, png_bytes
    from tests.support.nixl_consumer import NixlConsumer, consumer_compatibility_hash

    quiet_ucx_exit()
    side = free_port()
    config = json.dumps({"ec_connector": "ECCPUConnector", "ec_role": "ec_producer", "ec_connector_extra_config": {
        "ec_enable_nixl": True, "ec_cpu_bytes": 256 << 20}})
    storage = tempfile.mkdtemp(prefix="ec-storage-")
    common = ("--model", args.model, "--ec-model-id", "bench/model", "--enable-dynamic-batching", "false")
    nixl_server = ServerProcess(*common, "--ec-transfer-config", config, "--ec-side-channel-host", "127.0.0.1",
                                "--ec-side-channel-port", str(side), startup_timeout=300)
    files_server = ServerProcess(*common, "--ec-storage", storage, startup_timeout=300)
    times: dict[str, list[float]] = {"nixl": [], "files": [], "zmq": []}
    mismatches = 0
    with nixl_server, files_server, EmbeddingReceiver(port=free_port()) as receiver:
        info = httpx.get(f"{nixl_server.url}/server_info").json()["transport"]["vllm"]
        consumer = NixlConsumer(info["block_size_bytes"], consumer_compatibility_hash(*info["compatibility"]))
        client = httpx.Client(timeout=120)

        def chat(url: str, image: bytes) -> dict:
            url_of_image = "data:image/png;base64," + base64.b64encode(image).decode()
            body = {"model": "bench/model", "max_tokens": 1, "stream": False, "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url_of_image}}]}]}
            response = client.post(f"{url}/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()

        def nixl(image: bytes) -> torch.Tensor:
            answer = chat(nixl_server.url, image)
            identifier = answer["encoder_cache"][0]["identifier"]
            return consumer.read(answer["ec_transfer_params"][identifier], identifier, torch.float32)

        def files(image: bytes) -> torch.Tensor:
            answer = chat(files_server.url, image)
            identifier = answer["encoder_cache"][0]["identifier"]
            return load_file(os.path.join(storage, identifier, "encoder_cache.safetensors"))["ec_cache"]

        def zmq(image: bytes, index: int) -> torch.Tensor:
            req_id = f"z{index}"
            response = client.post(f"{nixl_server.url}/encode", json={
                "req_id": req_id, "modality": "image", "mm_items": [base64.b64encode(image).decode()],
                "prefill_host": "127.0.0.1", "embedding_port": receiver.port})
            assert response.status_code == 200, response.text
            return receiver.get(req_id, timeout=60).tensor

        for warm in range(2):  # connections, first forwards
            image = png_bytes(args.size, args.size, 10_000 + warm)
            nixl(image), files(image), zmq(image, -1 - warm)
        for index in range(args.items):
            image = png_bytes(args.size, args.size, index)
            rows = {}
            order = ("nixl", "files", "zmq") if index % 2 == 0 else ("zmq", "files", "nixl")
            for mode in order:
                started = time.perf_counter()
                rows[mode] = nixl(image) if mode == "nixl" else files(image) if mode == "files" else zmq(image, index)
                times[mode].append(time.perf_counter() - started)
            zmq_rows = rows["zmq"].to(torch.float32)
            if not (torch.equal(rows["nixl"], rows["files"]) and torch.equal(rows["nixl"], zmq_rows)):
                mismatches += 1
        shape = list(rows["nixl"].shape)
        consumer.close()
        client.close()

    def summary(values: list[float]) -> str:
        ordered = sorted(values)
        pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3  # noqa: E731
        return f"{statistics.median(values) * 1e3:.1f} [{pick(0.1):.1f}-{pick(0.9):.1f}]"

    print(f"{args.items} items per mode, {args.size}x{args.size} images on {args.model} (rows {shape} float32, "
          f"{shape[0] * shape[1] * 4} bytes), one request at a time, modes alternating per item; "
          f"rows that differed between modes: {mismatches}\n")
    print("| mode | ms per item, median [p10-p90] |")
    print("| --- | --- |")
    for mode, label in (("nixl", "ECCPUConnector (NIXL read)"), ("files", "ECExampleConnector (safetensors file)"),
                        ("zmq", "SGLang ZMQ wire (/encode push)")):
        print(f"| {label} | {summary(times[mode])} |")
    sys.stdout.flush()
    os._exit(0 if mismatches == 0 else 1)  # NIXL's agent goes with the process


if __name__ == "__main__":
    sys.exit(main())
