"""Drive this encoder's `ECMooncakeConnector` producer with vLLM 0.33.0's own, unchanged consumer code.

Runs in the side venv that `tools/compat/vllm_compat.sh` builds, with Mooncake's TransferEngine added to it
(`VENV/bin/pip install mooncake-transfer-engine-non-cuda`), from the repository root:

    VLLM_TARGET_DEVICE=cpu VLLM_HOST_IP=127.0.0.1 VENV/bin/python tools/compat/vllm_transport_compat.py [--items 1000]

(`VLLM_HOST_IP` keeps vLLM's TransferEngine on loopback.) It starts this server (from the project's .venv)
on the built-in tiny models with `--ec-transfer-config` ECMooncakeConnector over `tcp`, and builds vLLM's
consumer from its installed wheel: `ECMooncakeConnector` in the SCHEDULER role and, per tensor-parallel
rank, in the WORKER role (`start_worker_services`: vLLM's control server, reservation manager and
registered CPU pool, `ec_buffer_device` cpu). The only stand-ins are what a running engine would hand
these objects: a config object with vLLM's own `ECTransferConfig`, each worker's TP rank (vLLM reads it
from its distributed groups, absent outside a distributed run), and the request and scheduler-output
records the connector reads. Then it plays the EPD proxy:

- one encoder request per case with `ec_transfer_params = {consumer_zmq, ec_items: [{transfer_id}]}`;
- the consumer request with the answer's `ec_items: [{mm_hash, transfer_id}]`: the scheduler's
  `has_cache_item` (readiness events from vLLM's control server), `ensure_cache_available`,
  `build_connector_meta`, every worker's `start_load_caches` into an encoder cache, and
  `update_connector_output`; the loaded tensor must be bit-identical to this server's native `/encode`
  rows on every rank; then `request_finished` releases it.

Cases: images (two in one request, one named twice), a video, an audio clip (tiny-qwen2-audio), 2 consumer
ranks, 8 concurrent requests, the same transfer pushed twice, the same item under a new transfer id while
the consumer still holds it (`cached`), `--items` items in a row (then neither side holds any registered
byte or reservation), the placeholder fields published against vLLM's own declarations, and a consumer
that is shut down (the next request fails with a 502 within the control timeout; the server holds
nothing). Not run by CI (the install is several GB).
"""

from __future__ import annotations

import argparse
import concurrent.futures
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


def free_port_pair(count: int) -> int:
    """A port with `count` free consecutive ports from it (the consumer ranks' control sockets)."""
    import socket

    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count >= 65535:
            continue
        try:
            sockets = []
            for offset in range(count):
                sock = socket.socket()
                sock.bind(("127.0.0.1", base + offset))
                sockets.append(sock)
            for sock in sockets:
                sock.close()
            return base
        except OSError:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no free consecutive ports")


class VllmConsumer:
    """vLLM's ECMooncakeConnector consumer: one scheduler and `ranks` workers, in this process."""

    def __init__(self, ranks: int, pool_bytes: int = 256 << 20) -> None:
        import torch
        from vllm.config import ECTransferConfig
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.mooncake_ec_connector import ECMooncakeConnector

        self.port = free_port_pair(ranks)
        self.address = f"tcp://127.0.0.1:{self.port}"
        transfer = ECTransferConfig(ec_connector="ECMooncakeConnector", ec_role="ec_consumer",
                                    ec_buffer_device="cpu", ec_buffer_size=pool_bytes, ec_ip="127.0.0.1",
                                    ec_port=self.port, ec_connector_extra_config={
                                        "mooncake_protocol": "tcp", "push_wait_timeout_s": 30,
                                        "control_timeout_s": 5})
        config = SimpleNamespace(
            ec_transfer_config=transfer, model_config=SimpleNamespace(dtype=torch.float32, multimodal_config=None),
            parallel_config=SimpleNamespace(tensor_parallel_size=ranks, pipeline_parallel_size=1,
                                            data_parallel_size=1, data_parallel_index=0),
            use_v2_model_runner=False, lora_config=None)
        self.workers = []
        for rank in range(ranks):
            worker = ECMooncakeConnector(config, ECConnectorRole.WORKER)
            # What vLLM reads from its tensor-parallel group in a distributed run.
            worker._worker._consumer_rank_resolved = True
            worker._worker._tp_rank, worker._worker._tp_size = rank, ranks
            worker.start_worker_services()
            self.workers.append(worker)
        self.scheduler = ECMooncakeConnector(config, ECConnectorRole.SCHEDULER)
        self.caches: list[dict] = [{} for _ in self.workers]  # each rank's encoder cache, as the engine keeps it

    def load(self, request_id: str, items: list[tuple[str, str, str, int]], timeout_s: float = 30.0) -> list[dict]:
        """Run vLLM's consumer steps for a request of `items` (mm_hash, transfer_id, modality, rows); each
        rank's encoder cache."""
        from vllm.distributed.ec_transfer.ec_connector.mooncake.metadata import ECMooncakeWorkerMetadata

        features, offset = [], 0
        for mm_hash, _, modality, rows in items:
            features.append(SimpleNamespace(identifier=mm_hash, modality=modality, data=None,
                                            mm_position=SimpleNamespace(offset=offset, length=rows,
                                                                        get_num_embeds=lambda rows=rows: rows)))
            offset += rows + 1
        request = SimpleNamespace(request_id=request_id, mm_features=features, ec_transfer_params={
            "ec_items": [{"mm_hash": mm_hash, "transfer_id": transfer_id} for mm_hash, transfer_id, _, _ in items]})
        deadline = time.monotonic() + timeout_s
        while not all(self.scheduler.has_cache_item(mm_hash) for mm_hash, *_ in items):
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM's scheduler saw no readiness for {request_id}")
            time.sleep(0.005)
        caches = self.caches
        for _ in range(50):
            if self.scheduler.ensure_cache_available(request, 0):
                break
            output = SimpleNamespace(free_encoder_mm_hashes=[], preempted_req_ids=set())
            meta = self.scheduler.build_connector_meta(output)
            worker_meta = None
            for worker, cache in zip(self.workers, caches):
                worker.bind_connector_metadata(meta)
                worker.start_load_caches(cache)
                produced = worker.build_connector_worker_meta() or ECMooncakeWorkerMetadata()
                worker_meta = produced if worker_meta is None else worker_meta.aggregate(produced)
                worker.clear_connector_metadata()
            self.scheduler.update_connector_output(SimpleNamespace(ec_connector_worker_meta=worker_meta))
        else:
            raise TimeoutError(f"vLLM's scheduler never found {request_id}'s items available")
        return caches

    def finish(self, request_id: str, items: list[tuple[str, str, str, int]]) -> None:
        """The request is done and its encoder-cache entries are freed, as the engine reports both."""
        features = [SimpleNamespace(identifier=mm_hash, modality=modality, data=None,
                                    mm_position=SimpleNamespace(offset=0, length=rows))
                    for mm_hash, _, modality, rows in items]
        request = SimpleNamespace(request_id=request_id, mm_features=features, ec_transfer_params={
            "ec_items": [{"mm_hash": mm_hash, "transfer_id": transfer_id} for mm_hash, transfer_id, _, _ in items]})
        self.scheduler.request_finished(request)
        meta = self.scheduler.build_connector_meta(SimpleNamespace(
            free_encoder_mm_hashes=[mm_hash for mm_hash, *_ in items], preempted_req_ids=set()))
        for worker, cache in zip(self.workers, self.caches):
            for mm_hash, *_ in items:
                cache.pop(mm_hash, None)
            worker.bind_connector_metadata(meta)
            worker.start_load_caches(cache)
            worker.clear_connector_metadata()

    def active_reservations(self) -> list[str]:
        """Each reservation vLLM's consumer ranks still hold: transfer id, state."""
        held = []
        for worker in self.workers:
            manager = worker._worker._reservations
            held += [f"{key[:8]}:{manager._records[key].state.name}" for key in manager._active_ids]
        return held

    def close(self) -> None:
        self.scheduler.shutdown()
        for worker in self.workers:
            worker.shutdown()


def encoder_request(server, consumer: VllmConsumer, parts: list[dict], ids: list[str] | None = None,
                    request_id: str | None = None):
    import httpx

    request_id = request_id or uuid.uuid4().hex
    ids = ids or [uuid.uuid4().hex for _ in parts]
    body = {"model": "consumer-model", "stream": False, "messages": [{"role": "user", "content": parts}],
            "ec_transfer_params": {"consumer_zmq": consumer.address,
                                   "ec_items": [{"transfer_id": transfer_id} for transfer_id in ids]}}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"x-request-id": request_id},
                          timeout=120)
    return response, ids


def consumer_items(response, ids: list[str], modalities: list[str]) -> list[tuple[str, str, str, int]]:
    """(mm_hash, transfer_id, modality, rows) by position, as vLLM's proxy builds `ec_items`."""
    answer = response.json()
    return [(item["identifier"], transfer_id, modality, item["tokens"])
            for item, transfer_id, modality in zip(answer["encoder_cache"], ids, modalities)]


def check_case(server, consumer: VllmConsumer, step: str, parts: list[dict], modalities: list[str],
               natives: list, ids: list[str] | None = None) -> list[tuple[str, str, str, int]] | None:
    import torch

    response, ids = encoder_request(server, consumer, parts, ids)
    if not record(f"{step}: encoder answers 200", response.status_code == 200, response.text[:300]
                  if response.status_code != 200 else ""):
        return None
    items = consumer_items(response, ids, modalities)
    caches = consumer.load(uuid.uuid4().hex, items)
    same = all(torch.equal(cache[mm_hash], rows) for cache in caches for (mm_hash, *_), rows in zip(items, natives))
    record(f"{step}: vLLM's workers ({len(caches)} ranks) loaded rows bit-identical to native /encode", same)
    return items


def metadata_against_vllm() -> None:
    """What we publish beside each item names exactly the placeholder fields vLLM's data parser declares."""
    from vllm.model_executor.models.qwen2_5_omni_thinker import Qwen2_5OmniThinkerMultiModalDataParser
    from vllm.model_executor.models.qwen2_audio import Qwen2AudioMultiModalDataParser
    from vllm.model_executor.models.qwen2_vl import Qwen2VLMultiModalDataParser
    from vllm.model_executor.models.qwen3_vl import Qwen3VLMultiModalDataParser

    from encode_server.fronts.vllm.connectors.base import PLACEHOLDER_FIELDS

    parsers = {"qwen2_vl": Qwen2VLMultiModalDataParser, "qwen2_5_vl": Qwen2VLMultiModalDataParser,
               "qwen3_vl": Qwen3VLMultiModalDataParser, "qwen2_5_omni": Qwen2_5OmniThinkerMultiModalDataParser,
               "qwen3_omni_moe": Qwen2_5OmniThinkerMultiModalDataParser, "qwen2_audio": Qwen2AudioMultiModalDataParser}
    wrong = []
    for family, parser in parsers.items():
        for modality in ("image", "video", "audio"):
            declared = parser.placeholder_metadata_fields(modality)
            ours = PLACEHOLDER_FIELDS.get((family, modality))
            if ours is not None and {ours} != declared:
                wrong.append(f"{family}/{modality}: we publish {ours}, vLLM declares {sorted(declared)}")
    record("published placeholder fields are vLLM's declarations (where we publish any)", not wrong, "; ".join(wrong))


def run(args) -> None:
    import torch

    from encode_server.fronts.vllm.video import decode_vllm_video
    from tests.support.helpers import ServerProcess

    config = json.dumps({"ec_connector": "ECMooncakeConnector", "ec_role": "ec_producer", "ec_buffer_device": "cpu",
                         "ec_buffer_size": 256 << 20,
                         "ec_connector_extra_config": {"mooncake_protocol": "tcp", "control_timeout_s": 3}})
    metadata_against_vllm()
    consumer = VllmConsumer(ranks=2)
    # One request per forward: rows batched with other requests' differ from a lone forward's in the last bits
    # (float32 on the CPU), and every case here compares bits with a lone `/encode`.
    import vllm

    server = ServerProcess("--model", "tiny-qwen2.5-vl", "--ec-transfer-config", config, "--cache-bytes", "0",
                           "--ec-vllm-version", vllm.__version__, "--enable-dynamic-batching", "false",
                           startup_timeout=300, python=args.server_python)
    try:
        with server:
            first, second = png(64, 48, 1), png(40, 56, 2)
            parts = [{"type": "image_url", "image_url": {"url": data_url(first, "image/png")}},
                     {"type": "image_url", "image_url": {"url": data_url(second, "image/png")}},
                     {"type": "image_url", "image_url": {"url": data_url(first, "image/png")}}]
            natives = [native(server, "image", b64(first)), native(server, "image", b64(second))]
            items = check_case(server, consumer, "3 images (one twice), 2 consumer ranks", parts, ["image"] * 3,
                               [natives[0], natives[1], natives[0]])
            if items:
                consumer.finish("images", items)
            clip = (ROOT / "tests" / "golden" / "vllm-videos" / "clip.mp4").read_bytes()
            frames = decode_vllm_video(clip, "qwen2_vl", 10**8, 100, "x").frames
            import io

            from PIL import Image

            def frame_png(frame) -> str:
                buffer = io.BytesIO()
                Image.fromarray(frame).save(buffer, "PNG")
                return b64(buffer.getvalue())

            video_rows = native(server, "video", {"frames": [frame_png(frame) for frame in frames]})
            items = check_case(server, consumer, "a video", [{"type": "video_url", "video_url": {
                "url": data_url(clip, "video/mp4")}}], ["video"], [video_rows])
            if items:
                consumer.finish("video", items)
            # The same transfer pushed twice: the second push writes nothing and the item stays intact.
            image = png(48, 48, 3)
            rows = native(server, "image", b64(image))
            part = [{"type": "image_url", "image_url": {"url": data_url(image, "image/png")}}]
            ids = [uuid.uuid4().hex]
            once = check_case(server, consumer, "a push", part, ["image"], [rows], ids)
            response, _ = encoder_request(server, consumer, part, ids)
            record("the same transfer pushed again: 200, nothing reserved again", response.status_code == 200 and
                   not consumer.active_reservations(), f"{response.status_code}: {consumer.active_reservations()}")
            # The same item under a new transfer id while the consumer still holds it.
            before = server.metric("encoder_transport_transfers_total", transport="ECMooncakeConnector")
            cached = check_case(server, consumer, "the same item, a new transfer id", part, ["image"], [rows])
            record("  (writes it took: " + str(server.metric("encoder_transport_transfers_total",
                                                             transport="ECMooncakeConnector") - before) + ")", True)
            for done in (once, cached):
                if done:
                    consumer.finish(uuid.uuid4().hex, done)
            # Concurrent requests.
            images = [png(32 + 8 * (index % 4), 40, 100 + index) for index in range(8)]
            natives = [native(server, "image", b64(data)) for data in images]

            def one(index: int):
                return encoder_request(server, consumer, [
                    {"type": "image_url", "image_url": {"url": data_url(images[index], "image/png")}}])

            # The encoder requests at once; vLLM's scheduler then takes them one step at a time, as its engine does.
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(one, range(8)))
            same = [response.status_code == 200 for response, _ in answers]
            for (response, ids), rows in zip(answers, natives):
                if response.status_code != 200:
                    continue
                items = consumer_items(response, ids, ["image"])
                caches = consumer.load(uuid.uuid4().hex, items)
                same.append(all(torch.equal(cache[items[0][0]], rows) for cache in caches))
                consumer.finish(uuid.uuid4().hex, items)
            record("8 concurrent requests: all 200, rows bit-identical on every rank", all(same),
                   "" if all(same) else f"{same}; " + "; ".join(response.text[:200] for response, _ in answers
                                                              if response.status_code != 200))
            # Many items in a row.
            started, failures = time.monotonic(), 0
            for index in range(0, args.items, 10):
                batch = [png(16 + 4 * (k % 3), 16, 1000 + index + k) for k in range(min(10, args.items - index))]
                response, ids = encoder_request(server, consumer, [
                    {"type": "image_url", "image_url": {"url": data_url(data, "image/png")}} for data in batch])
                if response.status_code != 200:
                    failures += 1
                    continue
                items = consumer_items(response, ids, ["image"] * len(batch))
                consumer.load(uuid.uuid4().hex, items)
                consumer.finish(uuid.uuid4().hex, items)
            held = (server.metric("encoder_transport_registered_bytes", transport="ECMooncakeConnector"),
                    server.metric("encoder_transport_open_reservations", transport="ECMooncakeConnector"),
                    consumer.active_reservations())
            record(f"{args.items} items through vLLM's consumer in {time.monotonic() - started:.1f} s", failures == 0
                   and held == (0, 0, []), f"failed requests {failures}; registered bytes, open reservations here, "
                   f"active reservations in vLLM's consumer: {held}")
            # A consumer that is gone: its request fails within the control timeout, nothing stays held.
            address = consumer.address
            consumer.close()
            consumer.address = address
            started = time.monotonic()
            response, _ = encoder_request(server, consumer, part)
            record("a consumer that is shut down: 502 within the control timeout", response.status_code == 502
                   and time.monotonic() - started < 15, f"{response.status_code} after "
                   f"{time.monotonic() - started:.1f} s: {response.text[:160]}")
            record("after it the server holds nothing", server.metric(
                "encoder_transport_registered_bytes", transport="ECMooncakeConnector") == 0 and server.metric(
                "encoder_transport_open_reservations", transport="ECMooncakeConnector") == 0)
    finally:
        consumer.close()
    audio_case(args, config)


def audio_case(args, config: str) -> None:
    from encode_server.fronts.vllm.audio import Resampler, decode_vllm_audio
    from tests.support.helpers import ServerProcess

    clip = (ROOT / "tests" / "golden" / "vllm-audio" / "mono16k.wav").read_bytes()
    consumer = VllmConsumer(ranks=1)
    try:
        import vllm

        with ServerProcess("--model", "tiny-qwen2-audio", "--ec-transfer-config", config, "--cache-bytes", "0",
                           "--ec-vllm-version", vllm.__version__, startup_timeout=300,
                           python=args.server_python) as server:
            resampler = Resampler()
            try:
                audio = decode_vllm_audio(clip, 16000, 60.0, "x", resampler)
            finally:
                resampler.close()
            rows = native(server, "audio", b64(audio.wav()))
            items = check_case(server, consumer, "an audio clip (tiny-qwen2-audio)", [{
                "type": "input_audio", "input_audio": {"data": b64(clip), "format": "wav"}}],
                ["audio"], [rows])
            if items:
                consumer.finish("audio", items)
    finally:
        consumer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=1000, help="items pushed in a row for the leak check")
    default_python = ROOT / ".venv" / "bin" / "python"
    parser.add_argument("--server-python", default=str(default_python) if default_python.exists() else sys.executable,
                        help="the interpreter that runs the server (default: the project's .venv, else this one)")
    args = parser.parse_args()
    if os.environ.get("VLLM_HOST_IP") != "127.0.0.1":
        print("set VLLM_HOST_IP=127.0.0.1 (vLLM's TransferEngine then listens on loopback only)")
        return 2
    import vllm

    try:
        run(args)
    except Exception as exc:
        traceback.print_exc()
        record("run", False, f"{type(exc).__name__}: {exc}")
    passed = sum(ok for _, ok, _ in RESULTS)
    print(f"\nvLLM {vllm.__version__}, ECMooncakeConnector: {passed} passed, {len(RESULTS) - passed} failed")
    return 0 if passed == len(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
