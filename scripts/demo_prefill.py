"""Play router and prefill node against a running encoder (loopback only).

The "prefill node" has two tensor-parallel ranks, each with its own EmbeddingReceiver. Both register
for the request through /scheduler_receive_url (receive_count 2); the "router" posts /encode; each
rank receives the embedding and prints what arrived. Then the same again with the destination given
in the request itself (prefill_host + embedding_port).

    encode-server &                       # or: bash scripts/serve.sh &
    python scripts/demo_prefill.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from encode_server.receiver import EmbeddingReceiver  # noqa: E402


def demo_image() -> str:
    pixels = np.random.default_rng(0).integers(0, 256, (112, 168, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def post_json(url: str, body: dict, timeout: float = 60.0) -> dict:
    """POST a JSON body with the standard library (the demo needs nothing the server does not)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"{url} answered {exc.code}: {exc.read().decode(errors='replace')}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    args = parser.parse_args()
    image = demo_image()
    ranks = [EmbeddingReceiver(host="127.0.0.1") for _ in range(2)]
    try:
        # 1. Each prefill rank registers for the request it expects.
        req_id = f"demo-{uuid.uuid4().hex[:8]}"
        for rank, receiver in enumerate(ranks):
            reply = post_json(f"{args.url}/scheduler_receive_url", {
                "req_id": req_id, "receive_url": receiver.endpoint, "receive_count": len(ranks)})
            print(f"rank {rank}: registered {receiver.endpoint} -> {reply}")
        # 2. The router sends the media.
        response = post_json(f"{args.url}/encode", {"req_id": req_id, "modality": "image", "mm_items": [image]})
        print(f"router: /encode answered: shape {response['embedding_shape']}, "
              f"batch {response['batch_size']}, timings {response['timings_ms']}")
        # 3. Every rank gets its copy.
        received = [receiver.get(req_id, timeout=30) for receiver in ranks]
        for rank, result in enumerate(received):
            print(f"rank {rank}: got {tuple(result.tensor.shape)} {result.dtype} items={result.items}")
        assert all(r.tensor.numpy().tobytes() == received[0].tensor.numpy().tobytes() for r in received)
        print("both ranks hold identical bytes")

        # The destination can also travel in the request itself.
        req_id = f"demo-{uuid.uuid4().hex[:8]}"
        post_json(f"{args.url}/encode", {
            "req_id": req_id, "modality": "image", "mm_items": [image],
            "prefill_host": "127.0.0.1", "embedding_port": [r.port for r in ranks]})
        for rank, receiver in enumerate(ranks):
            result = receiver.get(req_id, timeout=30)
            print(f"rank {rank}: got {tuple(result.tensor.shape)} via embedding_port {receiver.port}")
    finally:
        for receiver in ranks:
            receiver.close()


if __name__ == "__main__":
    main()
