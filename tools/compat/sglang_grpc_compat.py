"""Drive this encoder's gRPC front (`--grpc-port`) with SGLang 0.5.23's own, unchanged gRPC receiving code.

Runs in the side venv that `tools/compat/sglang_compat.sh` builds (it installs `smg-grpc-proto` and grpcio
there too), from the repository root:

    PYTHONPATH=$PWD .sglang-venv/bin/python tools/compat/sglang_grpc_compat.py

It starts one encoder (the built-in `tiny-qwen2.5-omni`: images, audio and video; `--wire-format sglang`,
`--grpc-port`, loopback only) and uses SGLang's `MMReceiverGrpc` (`encode`: one `grpc.insecure_channel` and one
`Encode` per part, through SGLang's `_grpc_encode_request`; `_recv_mm_data`, the tokenizer's receive and part
merging) and `WaitingZmqRequestGrpc` (each scheduler rank's `SchedulerReceiveUrl` through SGLang's
`_grpc_scheduler_receive_url`, ZMQ receive, the TP-wide status all-reduce) as shipped. As in
`tools/compat/sglang_compat.py`, the receivers are made with `__new__` and given what their constructors set,
and the model's `mm_processor` is a stand-in that keeps what SGLang hands it.

Checks, for an image, an audio clip and a video (the rows must be byte-identical to our own `/encode`
`return_embedding` rows, and the grids SGLang merged equal to ours):
- `zmq_to_tokenizer`: SGLang's own `recv_mm_data` for images (one encoder, and two parts merged in order);
  `MMReceiverGrpc.encode` + `_recv_mm_data` for audio and video, with the items as plain strings (given as
  SGLang's own dicts, `encode` refuses any modality but IMAGE before sending anything: reported as SGLang-side);
- `zmq_to_scheduler`: two TP ranks in their own processes registering through gRPC, the dispatch being
  `MMReceiverGrpc.encode` itself, called as `_run_encode_in_thread` calls it but without `time_stats_json`
  (SGLang 0.5.23 passes that keyword, which `MMReceiverGrpc.encode` does not take: the dispatch fails with a
  TypeError before any call reaches an encoder; this is checked and reported as SGLang-side too);
- a corrupt image: `INVALID_ARGUMENT` through SGLang's `_grpc_encode_request`, with `/encode`'s 400 message;
- SGLang's gRPC deadline (`SGLANG_ENCODER_GRPC_TIMEOUT_SECS`): `DEADLINE_EXCEEDED` when no rank registers;
- health (`SERVING` for `""` and the encoder service) and reflection (the three services SGLang's encoder lists);
- `MMReceiverGrpc` with `--encoder-transfer-backend mooncake`: SGLang refuses it in its constructor
  (SGLang-side; our `Send` RPC is tested by tests/fronts/test_sglang_grpc_mooncake.py).
Not run by CI (the install is several GB).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import os
import sys
import threading
import time
import types
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.compat import sglang_compat as sc  # noqa: E402

MODEL = "tiny-qwen2.5-omni"
#: SGLang's Modality names, and the grid fields its merge fills, per modality.
SGLANG_NAME = {"image": "IMAGE", "audio": "AUDIO", "video": "VIDEO"}
AUDIO_RATE, AUDIO_SECONDS = 16000, 1
GRID_FIELD = {"image": "img_grid_thw", "video": "video_grid_thw", "audio": "audio_feature_lens"}


def media() -> dict[str, list[str]]:
    from tests.support.paths import GOLDEN
    from tests.support.tiny_parts import wav_b64, waveform

    clip = base64.b64encode((GOLDEN / "vllm-videos" / "clip.mp4").read_bytes()).decode()
    return {"image": [sc.png_b64(56, 84, seed=1), "data:image/png;base64," + sc.png_b64(112, 56, seed=2)],
            "audio": [wav_b64(waveform(AUDIO_SECONDS, AUDIO_RATE, seed=3), AUDIO_RATE)],
            "video": [clip]}


def reference(url: str, modality: str, items: list[str]) -> tuple[bytes, object]:
    """Our own rows for the items (`/encode`, `return_embedding`) and their grids as SGLang merges them."""
    import httpx

    body = httpx.post(url + "/encode", json={"req_id": f"ref-{uuid.uuid4().hex}", "modality": modality,
                                             "mm_items": items, "return_embedding": True}, timeout=120).json()
    grids = [item["grid_thw"] for item in body["items"]]
    if modality == "audio":  # SGLang's audio_feature_lens: the mel frames of each clip (a 10 ms hop)
        grids = [AUDIO_RATE * AUDIO_SECONDS // 160] * len(items)
    return base64.b64decode(body["embedding"]), grids


def compare(received: dict, modality: str, expected: tuple[bytes, object]) -> tuple[bool, str]:
    got = received["embeddings"].get(SGLANG_NAME[modality])
    if got is None:
        return False, f"no {SGLANG_NAME[modality]} embedding (got {sorted(received['embeddings'])})"
    dtype, shape, raw = got
    grids = received["grids"][GRID_FIELD[modality]]
    flat = grids if modality != "audio" or grids is None else [int(value) for value in _flatten(grids)]
    grids_ok = flat == expected[1]
    ok = raw == expected[0] and grids_ok
    return ok, (f"{shape[0]}x{shape[1]} {dtype.removeprefix('torch.')}, {len(raw)} bytes "
                f"{'identical' if raw == expected[0] else 'DIFFERENT'}; {GRID_FIELD[modality]} {grids}"
                f"{'' if grids_ok else f' != ours {expected[1]}'}")


def _flatten(value):
    for item in value:
        if isinstance(item, list):
            yield from _flatten(item)
        else:
            yield item


def grpc_receiver(urls: list[str], backend: str):
    """SGLang's `MMReceiverGrpc` as its constructor leaves it on the tokenizer."""
    from sglang.srt.disaggregation.encoder.receiver import MMReceiverGrpc

    receiver = sc.tokenizer_receiver(urls, backend)
    receiver.__class__ = MMReceiverGrpc
    receiver.recv_timeout = 60
    receiver.model_type = "qwen2_5_omni"
    return receiver


def generate_request(modality: str, items: list[str]):
    from sglang.srt.managers.io_struct import GenerateReqInput

    field = {"image": "image_data", "audio": "audio_data", "video": "video_data"}[modality]
    return GenerateReqInput(text="<x>" * len(items), rid=f"req{time.monotonic_ns()}", **{field: list(items)})


# --- zmq_to_tokenizer -------------------------------------------------------------------------

def tokenizer_images(urls: list[str], items: list[str], expected, step: str) -> None:
    """SGLang's whole tokenizer path: `recv_mm_data` (its request building, `encode`, the receive, the merge)."""
    receiver = grpc_receiver(urls, "zmq_to_tokenizer")
    started = time.monotonic()
    captured = asyncio.run(receiver.recv_mm_data(generate_request("image", items), sc.CapturingProcessor(), "<x>"))
    if captured is None:
        sc.record(step, False, "SGLang's recv_mm_data returned None (see the log above)")
        return
    ok, detail = compare(sc.tensor_report(captured), "image", expected)
    sc.record(step, ok, f"{detail}; {time.monotonic() - started:.2f} s")


def tokenizer_plain(urls: list[str], modality: str, items: list[str], expected, step: str) -> None:
    """`MMReceiverGrpc.encode` with the items as plain strings, `_recv_mm_data` on the tokenizer's socket."""
    import zmq
    from sglang.srt.utils.network import get_zmq_socket_on_host

    receiver = grpc_receiver(urls, "zmq_to_tokenizer")

    async def run():
        req_id = uuid.uuid4().hex
        port, socket = get_zmq_socket_on_host(receiver.context, zmq.PULL, host=receiver.host)
        try:
            dispatch = asyncio.create_task(receiver.encode(req_id, list(items), port, "encode", encode_urls=urls))
            receive = receiver._recv_mm_data(req_id, socket, sc.CapturingProcessor(), "<x>")
            captured = await asyncio.wait_for(receive, 60)
            await dispatch
            return captured
        finally:
            socket.close(linger=0)

    started = time.monotonic()
    captured = asyncio.run(run())
    if captured is None:
        sc.record(step, False, "SGLang's _recv_mm_data returned None (see the log above)")
        return
    ok, detail = compare(sc.tensor_report(captured), modality, expected)
    sc.record(step, ok, f"{detail}; {time.monotonic() - started:.2f} s")


def refused_dicts(urls: list[str], items: list[str]) -> None:
    """SGLang's own dict items of another modality: `MMReceiverGrpc.encode` refuses them itself."""
    from sglang.srt.managers.schedule_batch import Modality

    receiver = grpc_receiver(urls, "zmq_to_tokenizer")
    try:
        asyncio.run(receiver.encode("x", [{"url": items[0], "modality": Modality.AUDIO}], 1, "encode"))
    except NotImplementedError as exc:
        sc.record_sglang_side("zmq_to_tokenizer: audio/video as SGLang's own dict items",
                           f"MMReceiverGrpc.encode raises before any call: {exc}")
        return
    sc.record("zmq_to_tokenizer: SGLang's MMReceiverGrpc refuses non-image dict items", False, "it did not")


# --- zmq_to_scheduler -------------------------------------------------------------------------

def grpc_setup(receiver, rank: int, host: str) -> None:
    """A scheduler rank's receiver is SGLang's `MMReceiverGrpc` (its waiting requests `WaitingZmqRequestGrpc`)."""
    from sglang.srt.disaggregation.encoder.receiver import MMReceiverGrpc

    receiver.__class__ = MMReceiverGrpc
    receiver.model_type = "qwen2_5_omni"


def dispatch_crash(urls: list[str], items: list[str]) -> None:
    """SGLang 0.5.23's own dispatch of `zmq_to_scheduler` over gRPC (`_send_encode_request`)."""
    receiver = grpc_receiver(urls, "zmq_to_scheduler")
    obj = generate_request("image", items)
    errors: list = []
    ready = receiver._send_encode_request(obj, on_dispatch_error=errors.append)
    ready.set()
    deadline = time.monotonic() + 30
    while not errors and time.monotonic() < deadline:
        time.sleep(0.05)
    message = errors[0].error_msg if errors else ""
    if "time_stats_json" in message:
        sc.record_sglang_side("zmq_to_scheduler: SGLang's own dispatch (_send_encode_request)",
                           f"fails before any gRPC call: {message} (error_code {errors[0].error_code}); "
                           "a --language-only server then fails the request")
    else:
        sc.record("zmq_to_scheduler: SGLang's own dispatch", not errors, message or "dispatched")


def scheduler_mode(ranks: sc.Ranks, urls: list[str], modality: str, items: list[str], expected, step: str) -> None:
    receiver = grpc_receiver(urls, "zmq_to_scheduler")
    obj = generate_request(modality, items)
    mm_data = receiver._extract_url_data(obj)
    num_items_assigned = receiver._assign_items_by_modality(mm_data, len(urls))
    plain = [entry["url"] for entry in mm_data] if modality != "image" else mm_data
    ranks.run(obj.rid, num_items_assigned, list(urls))
    errors: list = []

    def dispatch() -> None:  # `_run_encode_in_thread`, without the keyword MMReceiverGrpc.encode does not take
        try:
            asyncio.run(receiver.encode(req_id=obj.rid, mm_data=plain, embedding_port=None, endpoint_encode="encode",
                                        num_items_assigned=num_items_assigned, encode_urls=list(urls)))
        except Exception as exc:  # noqa: BLE001 - reported
            errors.append(exc)

    thread = threading.Thread(target=dispatch)
    thread.start()
    outcome = ranks.collect()
    thread.join(60)
    ok, details = sc.ranks_outcome(outcome, lambda received: compare(received, modality, expected))
    ok &= not errors
    sc.record(step, ok, "; ".join(details) + (f"; dispatch error {errors}" if errors else ""))


# --- errors, deadline, health, reflection, mooncake -------------------------------------------

def corrupt_image(url: str, target: str) -> None:
    import grpc
    import httpx
    from sglang.srt.disaggregation.encoder.receiver import _grpc_encode_request

    bad = base64.b64encode(b"\x89PNG\r\n\x1a\n not an image").decode()
    http = httpx.post(url + "/encode", json={"req_id": "bad-http", "modality": "image", "mm_items": [bad]}).json()
    step = "corrupt image: INVALID_ARGUMENT with /encode's 400 message (SGLang's _grpc_encode_request)"
    try:
        _grpc_encode_request(target, {"mm_items": [bad], "req_id": "bad-grpc", "num_parts": 1, "part_idx": 0,
                                      "prefill_host": "127.0.0.1", "embedding_port": None})
    except grpc.RpcError as error:
        ok = error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details() == http["message"]
        sc.record(step, ok, f"{error.code().name}: {error.details()}")
        return
    sc.record(step, False, "the call succeeded")


def deadline(target: str, item: str) -> None:
    import grpc
    from sglang.srt.disaggregation.encoder.receiver import _grpc_encode_request

    os.environ["SGLANG_ENCODER_GRPC_TIMEOUT_SECS"] = "1"
    step = "SGLANG_ENCODER_GRPC_TIMEOUT_SECS=1, no rank registers: DEADLINE_EXCEEDED within the deadline"
    started = time.monotonic()
    try:
        _grpc_encode_request(target, {"mm_items": [item], "req_id": "never", "num_parts": 1, "part_idx": 0,
                                      "prefill_host": "127.0.0.1", "embedding_port": None})
    except grpc.RpcError as error:
        took = time.monotonic() - started
        sc.record(step, error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and took < 1.5,
               f"{error.code().name} after {took:.2f} s: {error.details()}")
        return
    finally:
        os.environ.pop("SGLANG_ENCODER_GRPC_TIMEOUT_SECS", None)
    sc.record(step, False, "the call succeeded")


def health_and_reflection(target: str) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
    from smg_grpc_proto import sglang_encoder_pb2

    # The names SGLang's serve_grpc_encoder gives reflection, built as it builds them.
    expected = {sglang_encoder_pb2.DESCRIPTOR.services_by_name["SglangEncoder"].full_name, "grpc.health.v1.Health",
                reflection.SERVICE_NAME}
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        statuses = {name: health_pb2.HealthCheckResponse.ServingStatus.Name(
            health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status)
            for name in ("", "sglang.grpc.encoder.SglangEncoder")}
        sc.record("grpc.health.v1 Check: SERVING, as SGLang's EncoderHealthServicer once started",
               set(statuses.values()) == {"SERVING"}, str(statuses))
        answer = next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
        listed = {service.name for service in answer.list_services_response.service}
        sc.record("reflection lists SGLang's three services", listed == expected, ", ".join(sorted(listed)))


def mooncake_refused() -> None:
    import sglang.srt.disaggregation.encoder.receiver as receiver_module

    real = receiver_module.get_disagg
    receiver_module.get_disagg = lambda: types.SimpleNamespace(encoder_transfer_backend="mooncake")
    try:
        receiver_module.MMReceiverGrpc(server_args=None)
    except NotImplementedError as exc:
        sc.record_sglang_side("mooncake over gRPC", f"SGLang's MMReceiverGrpc refuses it in its constructor: {exc}")
        return
    except Exception as exc:  # noqa: BLE001
        sc.record("mooncake over gRPC: MMReceiverGrpc's constructor", False, repr(exc))
        return
    finally:
        receiver_module.get_disagg = real
    sc.record("mooncake over gRPC: MMReceiverGrpc's constructor refuses it", False, "it did not")


def main() -> int:
    sc.quiet()
    import httpx
    import sglang

    from encode_server.bench.launcher import ServerProcess
    from tests.support.helpers import free_port

    print(f"SGLang {sglang.__version__} from {os.path.dirname(sglang.__file__)}", flush=True)
    grpc_port = free_port()
    items = media()
    with ServerProcess("--model", MODEL, "--wire-format", "sglang", "--grpc-port", str(grpc_port)) as server:
        target = httpx.get(server.url + "/server_info").json()["transport"]["grpc"]["address"]
        url = f"grpc://{target}"
        expected = {modality: reference(server.url, modality, sent) for modality, sent in items.items()}
        single = {modality: reference(server.url, modality, sent[:1]) for modality, sent in items.items()}
        tokenizer_images([url], items["image"], expected["image"], "zmq_to_tokenizer: images, one encoder")
        tokenizer_images([url, url], items["image"], expected["image"],
                         "zmq_to_tokenizer: images, two parts merged in order")
        for modality in ("audio", "video"):
            tokenizer_plain([url], modality, items[modality], expected[modality],
                            f"zmq_to_tokenizer: {modality} (plain items)")
        refused_dicts([url], items["audio"])
        dispatch_crash([url], items["image"][:1])
        ranks = sc.Ranks(("127.0.0.1", "127.0.0.1"), target=functools.partial(sc.rank_main, setup=grpc_setup))
        try:
            for modality in ("image", "audio", "video"):
                scheduler_mode(ranks, [url], modality, items[modality][:1], single[modality],
                               f"zmq_to_scheduler: {modality}, 2 TP ranks registering over gRPC, receive_count 2")
        finally:
            ranks.close()
        corrupt_image(server.url, target)
        deadline(target, items["image"][0])
        health_and_reflection(target)
        fronts = httpx.get(server.url + "/server_info").json()["fronts"]
        sc.record("/server_info counts the gRPC front's answers", fronts.get("grpc", {}).get("200", 0) >= 7,
               str(fronts))
    mooncake_refused()
    return sc.report()


if __name__ == "__main__":
    sys.exit(main())
