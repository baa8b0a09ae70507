"""Drive this encoder's `--encoder-transfer-backend mooncake` with SGLang 0.5.23's own, unchanged receiver code.

Runs in the side venv that `tools/compat/sglang_compat.sh` builds, with Mooncake's TransferEngine added to it
(`VENV/bin/pip install mooncake-transfer-engine-non-cuda`), from the repository root:

    MOONCAKE_PROTOCOL=tcp MC_FORCE_TCP=1 PYTHONPATH=$PWD VENV/bin/python tools/compat/sglang_transport_compat.py

(`MC_FORCE_TCP=1` makes SGLang's `MooncakeTransferEngine` skip the RDMA device lookup, as on a machine
without a NIC.)
It starts two encoders (the built-in `tiny-qwen2.5-vl`, `--encoder-transfer-backend mooncake`,
`--mooncake-protocol tcp`, one request per forward so that the rows compare bit for bit with a lone
`/encode`; loopback only) and uses SGLang's own language side as `tools/compat/sglang_compat.py` does: the
tokenizer's `MMReceiverHTTP` (request building and dispatch of `/encode`, `backend` mooncake) and two
scheduler TP ranks in their own processes (a gloo group; `process_waiting_requests` with SGLang's
`WaitingRDMARequest`: `/scheduler_receive_meta_data`, its landing buffer, `/send` with its
TransferEngine `session_id` and `buffer_address`, the `EmbeddingData` frame on its ZMQ socket, part
merging, the TP-wide status all-reduce). Each rank's TransferEngine is SGLang's own
`MooncakeTransferEngine` (`MOONCAKE_PROTOCOL=tcp`, on 127.0.0.1), and its landing buffer SGLang's own
`EmbeddingPool`, whose buffer is allocated on the CPU instead of `cuda:N` (the only stand-in: this
machine has no GPU). As in `tools/compat/sglang_compat.py`, the receivers are made with `__new__` and given
what their constructors set, and the model's `mm_processor` is a stand-in that keeps what SGLang hands it.
Videos and audio over this backend are checked by `tests/fronts/test_sglang_mooncake.py` (a receiver written
from the same protocol), not here.

Checks: one image, two images in one part, a request split over two encoders (two parts merged in order),
five requests in a row; the rows every rank gets must be byte-identical to our own `return_embedding`
output and the grids equal to ours; afterwards the encoders hold no staged part and no registered byte;
a corrupt image fails both ranks with our 400 message. Not run by CI (the install is several GB).
"""

from __future__ import annotations

import base64
import functools
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.compat.sglang_compat import (  # noqa: E402
    CapturingProcessor,
    Ranks,
    generate_request,
    png_b64,
    quiet,
    rank_main,
    record,
    reference,
    report,
    scheduler_mode,
    tokenizer_receiver,
)

POOL_BYTES = 64 << 20


class Captured:
    """What the stand-in processor keeps; a class of its own, as SGLang ties the pool slot's release to it
    (`weakref.finalize`, which a SimpleNamespace cannot take)."""

    def __init__(self, prompt, embeddings, meta) -> None:
        self.input_ids, self.mm_items = [0], []
        self.prompt, self.embeddings, self.meta = prompt, embeddings, meta


class KeepingProcessor(CapturingProcessor):
    def get_validated_mm_data(self, prompt, embeddings, **meta):
        return Captured(prompt, embeddings, meta)


def cpu_embedding_pool(engine):
    """SGLang's `EmbeddingPool`, its buffer on the CPU (it allocates `cuda:N`)."""
    from unittest import mock

    import torch
    from sglang.srt.disaggregation.encoder.receiver import EmbeddingPool

    empty = torch.empty
    with mock.patch.object(torch, "empty", lambda *args, device=None, **kwargs: empty(*args, **kwargs)):
        return EmbeddingPool(0, POOL_BYTES, engine)


def mooncake_setup(receiver, rank: int, host: str) -> None:
    """What `MMReceiverBase.__init__` sets on a scheduler rank with `--encoder-transfer-backend mooncake`."""
    import torch
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import MooncakeTransferEngine

    receiver.encoder_transfer_backend = "mooncake"
    receiver.mm_processor = KeepingProcessor()
    receiver.embeddings_engine = MooncakeTransferEngine(hostname=host, gpu_id=0, ib_device=None)
    receiver.dtype = torch.float32
    receiver.gpu_id = 0
    receiver.embedding_pool = cpu_embedding_pool(receiver.embeddings_engine)


def mooncake_ranks() -> Ranks:
    """Two scheduler TP ranks in their own processes, each with SGLang's TransferEngine and pool."""
    return Ranks(("127.0.0.1", "127.0.0.1"), target=functools.partial(rank_main, setup=mooncake_setup))


def corrupt_image(ranks: Ranks, url: str) -> None:
    """Both ranks fail with our 400 message, which they read from the sizes they pulled."""
    receiver = tokenizer_receiver([url], "mooncake")
    obj = generate_request([base64.b64encode(b"not an image").decode()])
    ready = receiver._send_encode_request(obj, on_dispatch_error=lambda error: None)
    ranks.run(obj.rid, obj.num_items_assigned, obj.encoder_urls)
    ready.set()
    outcome = ranks.collect()
    ok = all(kind == "failed" and "mm_items[0]" in str(payload[0]) for kind, _, payload in outcome.values())
    detail = "; ".join(f"rank {rank} {kind}: {str(payload)[:160]}"
                       for rank, (kind, _, payload) in sorted(outcome.items()))
    record("mooncake: a corrupt image fails both ranks with our 400 message", ok, detail)


def nothing_held(urls: list[str], step: str) -> None:
    import httpx

    held = []
    for url in urls:
        info = httpx.get(url + "/server_info").json()["transport"]["sglang"]
        held.append((info["staged_parts"], info["registered_bytes"]))
    record(step, all(h == (0, 0) for h in held), f"(staged parts, registered bytes) per encoder: {held}")


def main() -> int:
    if os.environ.get("MOONCAKE_PROTOCOL") != "tcp":
        print("set MOONCAKE_PROTOCOL=tcp (SGLang's TransferEngine then needs no RDMA NIC)")
        return 2
    quiet()
    import sglang

    from encode_server.bench.launcher import ServerProcess

    print(f"SGLang {sglang.__version__} from {os.path.dirname(sglang.__file__)}", flush=True)
    flags = ("--model", "tiny-qwen2.5-vl", "--encoder-transfer-backend", "mooncake", "--mooncake-protocol", "tcp",
             "--enable-dynamic-batching", "false", "--send-timeout-s", "10")
    image_a, image_b = png_b64(56, 84, seed=1), png_b64(112, 56, seed=2)
    ranks = mooncake_ranks()
    try:
        with ServerProcess(*flags) as first, ServerProcess(*flags) as second:
            urls = [first.url, second.url]
            scheduler_mode(ranks, [first.url], [image_a], reference(first.url, [image_a]),
                           "mooncake: one image, one encoder, 2 TP ranks", backend="mooncake")
            expected = reference(first.url, [image_a, image_b])
            scheduler_mode(ranks, [first.url], [image_a, image_b], expected,
                           "mooncake: two images in one part, 2 TP ranks", backend="mooncake")
            scheduler_mode(ranks, urls, [image_a, image_b], expected,
                           "mooncake: two images over two encoders (two parts, merged), 2 TP ranks", backend="mooncake")
            for round_index in range(5):
                images = [png_b64(32 + 8 * round_index, 40, seed=10 + round_index)]
                scheduler_mode(ranks, urls, images, reference(first.url, images),
                               f"mooncake: request {round_index + 1} of 5 in a row", backend="mooncake")
            corrupt_image(ranks, first.url)
            nothing_held(urls, "afterwards: no staged part, no registered byte on either encoder")
    except Exception as exc:
        traceback.print_exc()
        record("run", False, f"{type(exc).__name__}: {exc}")
    finally:
        ranks.close()
    return report()


if __name__ == "__main__":
    sys.exit(main())
