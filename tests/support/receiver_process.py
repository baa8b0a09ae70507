"""A stand-in prefill rank in its own process: bind an EmbeddingReceiver, report its endpoint, wait
for one request's embedding and write what arrived as JSON.

    python -m tests.support.receiver_process OUT.json REQ_ID [PORT]
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from encode_server.receiver import EmbeddingReceiver


def main() -> None:
    out, req_id = Path(sys.argv[1]), sys.argv[2]
    port = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    with EmbeddingReceiver(port=port) as receiver:
        print(receiver.endpoint, flush=True)
        result = receiver.get(req_id, timeout=60)
        raw = result.tensor.contiguous().numpy().tobytes()
        out.write_text(json.dumps({"shape": list(result.tensor.shape), "dtype": result.dtype,
                                   "sha256": hashlib.sha256(raw).hexdigest(), "items": result.items}))


if __name__ == "__main__":
    main()
