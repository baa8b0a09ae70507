"""Drive this encoder's `ECCPUConnector` (P2P mode) producer with vLLM 0.33.0's own, unchanged consumer code.

Runs in the side venv that `tools/compat/vllm_compat.sh` builds, with NIXL added to it (`VENV/bin/pip install nixl`),
from the repository root:

    VLLM_TARGET_DEVICE=cpu VENV/bin/python tools/compat/vllm_cpu_compat.py [--items 1000]

It starts this server (from the project's .venv) on the built-in tiny models with `--ec-transfer-config`
ECCPUConnector (`ec_enable_nixl` true) and its side channel on loopback, and builds vLLM's consumer from its
installed wheel: `ECCPUConnector` in the SCHEDULER role (vLLM's `ECCPUScheduler` with its NIXL data transport,
ZMQ client transport and `ConsumerSession`s) and in the WORKER role (`ECCPUWorker`, the mmap region's loads
into an encoder cache; two tensor-parallel ranks, each loading every item, the scheduler unpinning once both
reported). The stand-ins are only what a running engine, or a GPU, would provide: a config object
with vLLM's own `ECTransferConfig` and the model's dtype and hidden size, the worker's tensor-parallel rank,
the request records the connector reads, and, for the worker's copies, CPU versions of the CUDA calls the CPU
wheel lacks (`swap_blocks_batch` as a memmove per descriptor, an event that is always complete, and
`record_stream` a no-op on CPU tensors). Then it
plays the EPD proxy and the engine's steps:

- one encoder request per case; the consumer request carries the answer's `ec_transfer_params`;
- the scheduler's `ensure_cache_available` each step until it admits the request (its XferReqs, the
  producer's XferAcks, vLLM's NIXL READs into its region and the completion notifications), then
  `update_state_after_alloc` per item, `build_connector_meta`, the worker's `start_load_caches`: the loaded
  tensor must be bit-identical to this server's native `/encode` rows; `update_connector_output` unpins it.

Cases: 3 images (one named twice), a video, an audio clip (tiny-qwen2-audio), 8 concurrent requests, the
same item read again by a second consumer request, an item the producer never had (MISSING: vLLM fails the
request as unavailable), a consumer of another model (INCOMPAT: the same), and `--items` items in a row,
after which the server holds no pin and no held byte. Not run by CI (the install is several GB).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import io
import json
import os
import sys
import time
import traceback
import uuid
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.compat.common import RESULTS, b64, data_url, native, png, record  # noqa: E402

CONSUMER_MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"


def cpu_stand_ins() -> None:
    """What the CPU wheel lacks for `ECCPUWorker`'s copies: `swap_blocks_batch`, a completed event, and a CPU
    tensor's `record_stream` (the CUDA allocator's bookkeeping)."""
    import torch
    from vllm.distributed.ec_transfer.ec_connector.cpu import worker as worker_module

    def swap_blocks_batch(src_ptrs, dst_ptrs, sizes, is_src_access_order_any=False) -> None:
        for src, dst, size in zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()):
            ctypes.memmove(dst, src, size)

    class CompletedEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            pass

        def record(self, stream=None) -> None:
            pass

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, other) -> float:
            return 0.0

    record_stream = torch.Tensor.record_stream

    def record_cpu_stream(tensor, stream) -> None:  # the CUDA caching allocator's bookkeeping; nothing on the CPU
        if tensor.device.type != "cpu":
            record_stream(tensor, stream)

    worker_module.swap_blocks_batch = swap_blocks_batch
    torch.Tensor.record_stream = record_cpu_stream
    worker_module.get_tensor_model_parallel_rank = lambda: 0
    worker_module.get_pcp_group = lambda: SimpleNamespace(rank_in_group=0)
    torch.Event = CompletedEvent


class VllmConsumer:
    """vLLM's ECCPUConnector consumer (P2P mode): its scheduler and one worker, in this process."""

    def __init__(self, hidden_size: int, model: str = CONSUMER_MODEL, region_bytes: int = 64 << 20,
                 ranks: int = 1) -> None:
        import torch
        from vllm.config import ECTransferConfig
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.cpu.connector import ECCPUConnector

        transfer = ECTransferConfig(ec_connector="ECCPUConnector", ec_role="ec_consumer",
                                    ec_connector_extra_config={"ec_enable_nixl": True, "ec_cpu_bytes": region_bytes,
                                                               "consumer_ack_timeout_s": 10})
        model_config = SimpleNamespace(dtype=torch.float32, model=model, get_inputs_embeds_size=lambda: hidden_size)
        self.config = SimpleNamespace(
            ec_transfer_config=transfer, model_config=model_config, instance_id=f"compat-{uuid.uuid4().hex[:8]}",
            parallel_config=SimpleNamespace(tensor_parallel_size=ranks, prefill_context_parallel_size=1,
                                            data_parallel_index=0, distributed_executor_backend="mp"),
            use_v2_model_runner=True)
        self.scheduler = ECCPUConnector(self.config, ECConnectorRole.SCHEDULER)
        # Every tensor-parallel rank maps the same region and loads every item into its own encoder cache.
        self.workers = [ECCPUConnector(self.config, ECConnectorRole.WORKER) for _ in range(ranks)]
        self.caches: list[dict] = [{} for _ in self.workers]

    def request(self, request_id: str, items: list[tuple[str, str, int]], params: dict) -> SimpleNamespace:
        features, offset = [], 0
        for mm_hash, modality, rows in items:
            features.append(SimpleNamespace(identifier=mm_hash, modality=modality, data=None,
                                            mm_position=SimpleNamespace(offset=offset, length=rows,
                                                                        get_num_embeds=lambda rows=rows: rows)))
            offset += rows + 1
        return SimpleNamespace(request_id=request_id, mm_features=features, ec_transfer_params=params)

    def step(self) -> None:
        """One engine step's connector calls: the scheduler's metadata to every worker, their reports back."""
        meta = self.scheduler.build_connector_meta(SimpleNamespace())
        reported = None
        for worker, cache in zip(self.workers, self.caches):
            worker.bind_connector_metadata(meta)
            worker.start_load_caches(cache)
            worker.clear_connector_metadata()
            produced = worker.build_connector_worker_meta()
            if produced is not None:
                reported = produced if reported is None else reported.aggregate(produced)
        if reported is not None:
            self.scheduler.update_connector_output(SimpleNamespace(ec_connector_worker_meta=reported))

    def load(self, request, timeout_s: float = 30.0) -> list[dict] | str:
        """vLLM's steps for `request` until it is admitted and loaded: each rank's encoder cache; or
        "unavailable"."""
        deadline = time.monotonic() + timeout_s
        while not self.scheduler.ensure_cache_available(request, 0):
            if request.request_id in self.scheduler.take_unavailable_requests():
                return "unavailable"
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM's scheduler never admitted {request.request_id}")
            self.step()
            time.sleep(0.002)
        for index in range(len(request.mm_features)):
            self.scheduler.update_state_after_alloc(request, index)
        self.step()
        return self.caches

    def close(self) -> None:
        self.scheduler.shutdown()
        for worker in self.workers:
            worker.shutdown()



def encoder_request(server, parts: list[dict]):
    import httpx

    body = {"model": "consumer-model", "stream": False, "max_tokens": 1,
            "messages": [{"role": "user", "content": parts}]}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"x-request-id": uuid.uuid4().hex},
                      timeout=120)


def consumer_request(consumer: VllmConsumer, response, modalities: list[str]):
    """The consumer's request as the proxy sends it: the items by position and the answer's ec_transfer_params."""
    answer = response.json()
    items = [(item["identifier"], modality, item["tokens"]) for item, modality in zip(answer["encoder_cache"],
                                                                                     modalities)]
    return consumer.request(uuid.uuid4().hex, items, answer["ec_transfer_params"]), items


def check_case(server, consumer: VllmConsumer, step: str, parts: list[dict], modalities: list[str],
               natives: list) -> bool:
    import torch

    response = encoder_request(server, parts)
    if not record(f"{step}: encoder answers 200", response.status_code == 200,
                  response.text[:300] if response.status_code != 200 else ""):
        return False
    request, items = consumer_request(consumer, response, modalities)
    caches = consumer.load(request)
    same = caches != "unavailable" and all(torch.equal(cache[mm_hash], rows) for cache in caches
                                           for (mm_hash, *_), rows in zip(items, natives))
    return record(f"{step}: vLLM's consumer ({len(consumer.workers)} rank(s)) loaded rows bit-identical to "
                  f"native /encode", same)


def settled(server, timeout_s: float = 5.0) -> tuple:
    deadline = time.monotonic() + timeout_s
    while True:
        held = (server.metric("encoder_transport_open_reservations", transport="ECCPUConnector"),
                server.metric("encoder_transport_held_bytes", transport="ECCPUConnector"))
        if held == (0, 0) or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


def start_server(args, model: str, port: int):
    from tests.support.helpers import ServerProcess

    config = json.dumps({"ec_connector": "ECCPUConnector", "ec_role": "ec_producer", "ec_connector_extra_config": {
        "ec_enable_nixl": True, "ec_cpu_bytes": 32 << 20, "unread_hold_s": 2}})
    # One request per forward: every case compares bits with a lone `/encode`.
    return ServerProcess("--model", model, "--ec-transfer-config", config, "--ec-model-id", CONSUMER_MODEL,
                         "--ec-vllm-version", args.vllm_version, "--ec-side-channel-host", "127.0.0.1",
                         "--ec-side-channel-port", str(port), "--cache-bytes", "0", "--enable-dynamic-batching",
                         "false", startup_timeout=300, python=args.server_python)


def run(args) -> None:
    import httpx
    import torch

    from encode_server.fronts.vllm.video import decode_vllm_video
    from tests.support.helpers import free_port

    with start_server(args, "tiny-qwen2.5-vl", free_port()) as server:
        info = httpx.get(f"{server.url}/server_info").json()
        hidden = info["model"]["hidden_size"]
        consumer = VllmConsumer(hidden, ranks=2)
        try:
            first, second = png(64, 48, 1), png(40, 56, 2)
            parts = [{"type": "image_url", "image_url": {"url": data_url(first, "image/png")}},
                     {"type": "image_url", "image_url": {"url": data_url(second, "image/png")}},
                     {"type": "image_url", "image_url": {"url": data_url(first, "image/png")}}]
            natives = [native(server, "image", b64(first)), native(server, "image", b64(second))]
            check_case(server, consumer, "3 images (one twice)", parts, ["image"] * 3,
                       [natives[0], natives[1], natives[0]])
            clip = (ROOT / "tests" / "golden" / "vllm-videos" / "clip.mp4").read_bytes()
            frames = decode_vllm_video(clip, "qwen2_vl", 10**8, 100, "x").frames
            from PIL import Image

            def frame_png(frame) -> str:
                buffer = io.BytesIO()
                Image.fromarray(frame).save(buffer, "PNG")
                return b64(buffer.getvalue())

            video_rows = native(server, "video", {"frames": [frame_png(frame) for frame in frames]})
            check_case(server, consumer, "a video", [{"type": "video_url", "video_url": {
                "url": data_url(clip, "video/mp4")}}], ["video"], [video_rows])
            # The same item asked for by a second consumer (a fresh consumer: its own session and region).
            second_consumer = VllmConsumer(hidden)
            try:
                check_case(server, second_consumer, "the first image again, read by a second consumer",
                           parts[:1], ["image"], natives[:1])
            finally:
                second_consumer.close()
            # Concurrent encoder requests, then vLLM's scheduler takes them one step at a time, as its engine does.
            images = [png(32 + 8 * (index % 4), 40, 100 + index) for index in range(8)]
            expected = [native(server, "image", b64(data)) for data in images]
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(lambda data: encoder_request(server, [
                    {"type": "image_url", "image_url": {"url": data_url(data, "image/png")}}]), images))
            same = []
            for response, rows in zip(answers, expected):
                if response.status_code != 200:
                    same.append(False)
                    continue
                request, items = consumer_request(consumer, response, ["image"])
                caches = consumer.load(request)
                same.append(caches != "unavailable" and all(torch.equal(cache[items[0][0]], rows) for cache in caches))
            record("8 concurrent requests: all 200, rows bit-identical", all(same), str(same))
            # An item the producer never had: MISSING, and vLLM fails the request as unavailable.
            request = consumer.request("missing", [("0" * 64, "image", 4)], {"0" * 64: {
                "peer_host": "127.0.0.1", "peer_port": info["transport"]["vllm"]["peer_port"],
                "size_bytes": 4 * hidden * 4, "shape": [4, hidden]}})
            record("an item the producer never had: vLLM's consumer reports the request unavailable",
                   consumer.load(request) == "unavailable")
            # A consumer of another model: its compatibility hash differs, INCOMPAT, unavailable.
            other = VllmConsumer(hidden, model="another/model")
            try:
                response = encoder_request(server, parts[:1])
                request, _ = consumer_request(other, response, ["image"])
                record("a consumer of another model (INCOMPAT): its request is unavailable",
                       other.load(request) == "unavailable")
            finally:
                other.close()
            # Many items in a row.
            started, failures = time.monotonic(), 0
            for index in range(0, args.items, 10):
                batch = [png(16 + 4 * (k % 3), 16, 1000 + index + k) for k in range(min(10, args.items - index))]
                response = encoder_request(server, [{"type": "image_url", "image_url": {
                    "url": data_url(data, "image/png")}} for data in batch])
                if response.status_code != 200:
                    failures += 1
                    continue
                request, _ = consumer_request(consumer, response, ["image"] * len(batch))
                if consumer.load(request) == "unavailable":
                    failures += 1
            time.sleep(2.5)  # the unread-item hold of the INCOMPAT and MISSING cases' items lapses
            held = settled(server)
            record(f"{args.items} items through vLLM's consumer in {time.monotonic() - started:.1f} s", failures == 0
                   and held == (0, 0), f"failed requests {failures}; pins, held bytes: {held}")
        finally:
            consumer.close()
    audio_case(args)


def audio_case(args) -> None:
    import httpx

    from encode_server.fronts.vllm.audio import Resampler, decode_vllm_audio
    from tests.support.helpers import free_port

    clip = (ROOT / "tests" / "golden" / "vllm-audio" / "mono16k.wav").read_bytes()
    with start_server(args, "tiny-qwen2-audio", free_port()) as server:
        consumer = VllmConsumer(httpx.get(f"{server.url}/server_info").json()["model"]["hidden_size"])
        try:
            resampler = Resampler()
            try:
                audio = decode_vllm_audio(clip, 16000, 60.0, "x", resampler)
            finally:
                resampler.close()
            rows = native(server, "audio", b64(audio.wav()))
            check_case(server, consumer, "an audio clip (tiny-qwen2-audio)", [{
                "type": "input_audio", "input_audio": {"data": b64(clip), "format": "wav"}}], ["audio"], [rows])
        finally:
            consumer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=1000, help="items read in a row for the leak check")
    default_python = ROOT / ".venv" / "bin" / "python"
    parser.add_argument("--server-python", default=str(default_python) if default_python.exists() else sys.executable,
                        help="the interpreter that runs the server (default: the project's .venv, else this one)")
    args = parser.parse_args()
    import vllm

    args.vllm_version = vllm.__version__
    from encode_server.transport.nixl import quiet_ucx_exit

    quiet_ucx_exit()
    cpu_stand_ins()
    try:
        run(args)
    except Exception as exc:
        traceback.print_exc()
        record("run", False, f"{type(exc).__name__}: {exc}")
    passed = sum(ok for _, ok, _ in RESULTS)
    print(f"\nvLLM {vllm.__version__}, ECCPUConnector (P2P, NIXL): {passed} passed, {len(RESULTS) - passed} failed",
          flush=True)
    os._exit(0 if passed == len(RESULTS) else 1)  # NIXL's agents are torn down with the process


if __name__ == "__main__":
    sys.exit(main())
