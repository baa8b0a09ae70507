"""Drive this encoder with SGLang's own, unchanged language-side code, and print a pass/fail table.

Runs in the side venv that `tools/compat/sglang_compat.sh` builds (SGLang 0.5.23 and its imports, plus this
server's dependencies; `.sglang-venv` in the repository unless it was given another folder), from the
repository root:

    PYTHONPATH=$PWD .sglang-venv/bin/python tools/compat/sglang_compat.py [--language-side-only]
        [--architectures qwen3_vl ...] [--only-omni] [--only-families [--families dots3_note]]

It starts two encoders (the built-in `tiny-qwen2.5-vl`, `--wire-format sglang`, loopback only) and
uses SGLang's `MMReceiverHTTP` (request building, dispatch, `/scheduler_receive_url` registration,
ZMQ receive, `safe_pickle_loads`, part merging, the TP-wide status all-reduce) and
`WaitingZmqRequest` exactly as shipped. Skipped, because they need a real LLM: the receivers'
constructors (objects are made with `__new__` and given the attributes the constructor would set,
on 127.0.0.1 / ::1) and the model's `mm_processor` (a stand-in keeps what SGLang hands it), and
`create_req` (it builds the LLM's `Req` for an abort; the stand-in returns the rid).

Checks, in both of SGLang's ZMQ modes:
- `zmq_to_tokenizer` (`embedding_port` an int): one encoder, and a request split over two encoders
  (two parts) merged in order;
- `zmq_to_scheduler` (`embedding_port` null, two TP ranks in two processes with a gloo group, each
  registering with `receive_count` 2; rank 0 on 127.0.0.1, rank 1 on ::1): one and two encoders;
  a corrupt image making every rank fail within a second with our 400 message (from our ZMQ error
  frames alone: the tokenizer's dispatch error is not forwarded to the ranks); a request nobody
  registers for giving 502 after `--send-timeout-s`.
Embeddings must be byte-identical to our own `return_embedding` output and grids equal to ours.
Then the Omni families against SGLang's language side (`omni_language_side`, its own section below;
`--only-omni` runs only those). 
Then, for the image + video + audio families (`--families`, default Muse Spark and Dots3-Note), from tiny
checkpoints built here and one server each: per modality, a request through SGLang's receiver, and the
model's own SGLang language-side processor called on what it merged, as a language-only prefill server
calls it (`get_validated_mm_data(prompt, embeddings, **fields)`). Its `input_ids` must equal those of the
model's full `transformers` processor for the same prompt and media (so the placeholder counts and, for
video, the timestamp text agree), and the rows it splices must be ours, byte for byte. Muse's processor is
built by its own constructor (with a `ServerArgs` for the folder published in SGLang's runtime context);
Dots3's with `__new__` (its constructor reads the published checkpoint's preprocessing files, which
`get_mm_data` does not use). `--only-families` runs only these. Where the model's SGLang processor stops on
an attribute that none of its classes defines or sets (`sglang_missing_attribute`: SGLang 0.5.23's
`DotsNoteOmniProcessor` inherits the base `get_mm_data`, which reads `self.IM_START_TOKEN_ID`, and never
sets it), no checkpoint can get past it: the row is reported as "SGLang-side" with where SGLang reads it,
not as a failure of ours; the row before it (the merged fields against the `transformers` processor's
placeholders and our rows) is checked all the same.
Not run by CI (the install is several GB).

Kimi K2.5, GLM-5-Next and MiniMax-M3 VL (`kimi_glm5_minimax_checks`): a tiny checkpoint of each
(`tests/support/checkpoints/`) served by one of our encoders; two images, then two clips, go
through `recv_mm_data` (zmq_to_tokenizer) into the model's own SGLang processor (made with `__new__` and
the attributes its constructor sets), whose `get_validated_mm_data` builds the prompt's `input_ids` as the
prefill's tokenizer does. Each passes when those hold one placeholder per row we sent (the count the
model's full `transformers` processor inserts), the rows kept are ours byte for byte, and, where the two
layouts are meant to agree, the `input_ids` equal the full processor's. Importing these processors needs
`einops` (installed by `tools/compat/sglang_compat.sh`).

The language side of the Qwen-VL architectures and Qwen2-Audio (`language_side`; `--language-side-only`
and `--architectures` run only it, or part of it): Qwen2-VL, Qwen2.5-VL, Qwen3-VL and its MoE, Qwen3.5 and
its MoE (images and videos) and Qwen2-Audio (audio), each on a tiny checkpoint saved with its full processor
and an offline byte-level tokenizer (tests/support/checkpoints/prompts.py) and served by one of our encoders. A
request of two items (two parts, merged by SGLang's receiver) goes through `recv_mm_data`, which hands the
merged parts to the model's own SGLang language-side processor, built by SGLang's own `_init_mm_processor`
with the settings of a `--language-only` server. Each row checks that the `input_ids` it builds hold
exactly as many placeholder tokens as our rows, that the rows it got are ours byte for byte, that the
`input_ids` equal those of the model's `transformers` processor for the same media (decoded as we decode
them), and for Qwen3-VL / Qwen3.5 videos that the `<t seconds>` SGLang wrote are the ones `transformers`
writes and ours. To add an architecture there: its checkpoint builder in LANGUAGE_CHECKPOINTS and one small function
per modality in LANGUAGE_CASES; the table at the end has one row per architecture and modality.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import io
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import traceback
import types
import warnings
from array import array

SEND_TIMEOUT_S = 2.0
RESULTS: list[tuple[str, bool, str]] = []


def record(step: str, ok: bool, detail: str = "") -> None:
    RESULTS.append((step, ok, detail))
    print(f"[{'PASS' if ok else 'FAIL'}] {step}" + (f": {detail}" if detail else ""), flush=True)


#: Steps that stopped inside SGLang on a defect no checkpoint and no encoder can avoid: (step, reason).
SGLANG_SIDE: list[tuple[str, str]] = []


def record_sglang_side(step: str, reason: str) -> None:
    SGLANG_SIDE.append((step, reason))
    print(f"[SGLANG-SIDE] {step}: {reason}", flush=True)


def quiet() -> None:
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("sglang").setLevel(logging.ERROR)


def png_b64(width: int, height: int, seed: int) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class CapturingProcessor:
    """Stands in for the model's mm_processor (it needs the LLM): keeps what SGLang hands it."""

    prefer_tokenized_input = False

    def get_validated_mm_data(self, prompt, embeddings, **meta):
        return types.SimpleNamespace(input_ids=[0], mm_items=[], prompt=prompt, embeddings=embeddings, meta=meta)


def tensor_report(captured) -> dict:
    """What a receiver got: per-modality embedding bytes and dtype, and the grids SGLang merged."""
    out = {"embeddings": {}, "grids": {}}
    for modality, tensor in captured.embeddings.items():
        tensor = tensor.contiguous()
        out["embeddings"][modality.name] = (str(tensor.dtype), list(tensor.shape),
                                            tensor.view(-1).view(__import__("torch").uint8).numpy().tobytes())
    for key in ("img_grid_thw", "video_grid_thw", "audio_feature_lens"):
        value = captured.meta.get(key)
        out["grids"][key] = None if value is None else value.tolist()
    return out


# --- the scheduler side: one process per TP rank ------------------------------------------------

class TpGroup:
    """The two things SGLang's receiver uses of its TP group, over a gloo process group."""

    def __init__(self, world: int) -> None:
        import torch.distributed as dist

        self.world = world
        self.cpu_group = dist.group.WORLD

    def all_gather_object(self, obj):
        import torch.distributed as dist

        gathered = [None] * self.world
        dist.all_gather_object(gathered, obj)
        return gathered


def rank_main(rank: int, world: int, dist_port: int, host: str, commands: mp.Queue, results: mp.Queue,
              setup=None) -> None:
    """One scheduler TP rank; `setup(receiver, rank, host)`, when given, adapts the receiver to another backend."""
    quiet()
    try:
        import torch.distributed as dist
        import zmq
        from sglang.srt.disaggregation.encoder.receiver import MMReceiverHTTP, _ReceiveRegistrationRunner
        from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.utils.network import get_zmq_socket_on_host

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank, world_size=world)
        receiver = MMReceiverHTTP.__new__(MMReceiverHTTP)  # what MMReceiverBase.__init__ sets on a scheduler rank
        receiver.encoder_transfer_backend = "zmq_to_scheduler"
        receiver.scheduler_context = zmq.Context()
        receiver.registration_runner = _ReceiveRegistrationRunner(f"encoder-receive-registration-{rank}")
        receiver.scheduler_embedding_port, receiver.scheduler_recv_socket = get_zmq_socket_on_host(
            receiver.scheduler_context, zmq.PULL, host=host)
        receiver.hostname = host
        receiver.tp_size, receiver.tp_rank, receiver.tp_group = world, rank, TpGroup(world)
        receiver.waiting_list, receiver.waiting_by_rid = [], {}
        receiver.encode_urls = []
        receiver.model_type = "qwen2_5_vl"
        receiver.mm_processor = CapturingProcessor()
        receiver.wait_timeout = 30
        receiver.embedding_pool = None
        receiver.create_req = lambda recv_req: recv_req.rid  # builds the LLM's Req for an abort
        if setup is not None:
            setup(receiver, rank, host)
        results.put(("ready", rank, receiver.scheduler_embedding_port))
        while (command := commands.get()) is not None:
            rid, num_items_assigned, encoder_urls = command
            request = TokenizedGenerateReqInput(
                rid=rid, input_text="<image>", input_ids=array("q", [1, 2, 3]), input_embeds=None, mm_inputs=None,
                token_type_ids=None, sampling_params=SamplingParams(), return_logprob=False, logprob_start_len=-1,
                top_logprobs_num=0, token_ids_logprob=None, stream=False, need_wait_for_mm_inputs=True,
                num_items_assigned=num_items_assigned, encoder_urls=encoder_urls)
            done, aborted = receiver.process_waiting_requests([request])
            while not done and not aborted:  # the scheduler's event loop ticks
                time.sleep(0.005)
                done, aborted = receiver.process_waiting_requests([])
            finished = time.time()
            if done:
                results.put(("done", rank, finished, tensor_report(done[0].mm_inputs)))
            else:
                _, message, code = aborted[0]
                results.put(("failed", rank, finished, (message, int(code) if code is not None else None)))
    except Exception:
        results.put(("crashed", rank, time.time(), traceback.format_exc()))


class Ranks:
    """Two scheduler TP ranks in their own processes (`target`: what each runs, `rank_main` by default)."""

    def __init__(self, hosts: tuple[str, ...] = ("127.0.0.1", "::1"), target=None) -> None:
        context = mp.get_context("spawn")
        self.results = context.Queue()
        self.commands = [context.Queue() for _ in hosts]
        port = free_port()
        self.processes = [context.Process(target=target or rank_main, args=(rank, len(hosts), port, host,
                                                                            self.commands[rank],
                                                                  self.results), daemon=True)
                          for rank, host in enumerate(hosts)]
        for process in self.processes:
            process.start()
        self.ports = {}
        for _ in hosts:
            kind, rank, *rest = self.results.get(timeout=180)
            if kind != "ready":
                raise RuntimeError(f"rank {rank} did not start: {rest[-1]}")
            self.ports[rank] = rest[0]

    def run(self, rid: str, num_items_assigned, encoder_urls) -> None:
        for commands in self.commands:
            commands.put((rid, num_items_assigned, encoder_urls))

    def collect(self, timeout: float = 60.0) -> dict[int, tuple]:
        found = {}
        while len(found) < len(self.commands):
            kind, rank, when, payload = self.results.get(timeout=timeout)
            found[rank] = (kind, when, payload)
        return found

    def close(self) -> None:
        for commands in self.commands:
            commands.put(None)
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.kill()


# --- the tokenizer side ----------------------------------------------------------------------

def tokenizer_receiver(urls: list[str], backend: str):
    import zmq.asyncio
    from sglang.srt.disaggregation.encoder.receiver import MMReceiverHTTP

    receiver = MMReceiverHTTP.__new__(MMReceiverHTTP)  # what MMReceiverBase.__init__ sets on the tokenizer
    receiver.context = zmq.asyncio.Context()
    receiver.encoder_transfer_backend = backend
    receiver.encode_urls = list(urls)
    receiver.host = "127.0.0.1"
    receiver.recv_timeout = 30
    receiver.model_type = "qwen2_5_vl"
    return receiver


def reference(url: str, items: list[str]) -> tuple[bytes, list]:
    """Our own answer for the items: `return_embedding` bytes and each item's grid."""
    import httpx

    response = httpx.post(url + "/encode", json={"req_id": f"ref-{time.monotonic_ns()}", "modality": "image",
                                                 "mm_items": items, "return_embedding": True}, timeout=60)
    response.raise_for_status()
    body = response.json()
    return base64.b64decode(body["embedding"]), [item["grid_thw"] for item in body["items"]]


def compare(report: dict, expected: tuple[bytes, list]) -> tuple[bool, str]:
    got = report["embeddings"].get("IMAGE")
    if got is None:
        return False, f"no IMAGE embedding (got {sorted(report['embeddings'])})"
    dtype, shape, raw = got
    grids = report["grids"]["img_grid_thw"]
    ok = raw == expected[0] and grids == expected[1]
    return ok, (f"{shape[0]}x{shape[1]} {dtype.removeprefix('torch.')}, {len(raw)} bytes "
                f"{'identical' if raw == expected[0] else 'DIFFERENT'}; img_grid_thw {grids}"
                f"{'' if grids == expected[1] else f' != ours {expected[1]}'}")


def generate_request(items: list[str]):
    from sglang.srt.managers.io_struct import GenerateReqInput

    return GenerateReqInput(text="<image>" * len(items), image_data=list(items), rid=f"req{time.monotonic_ns()}")


def tokenizer_mode(urls: list[str], items: list[str], expected, step: str) -> None:
    receiver = tokenizer_receiver(urls, "zmq_to_tokenizer")
    started = time.monotonic()
    captured = asyncio.run(receiver.recv_mm_data(generate_request(items), CapturingProcessor(), "<image>"))
    if captured is None:
        record(step, False, "SGLang's recv_mm_data returned None (see the log above)")
        return
    ok, detail = compare(tensor_report(captured), expected)
    record(step, ok, f"{detail}; {time.monotonic() - started:.2f} s")


def scheduler_mode(ranks: Ranks, urls: list[str], items: list[str], expected, step: str,
                   backend: str = "zmq_to_scheduler") -> None:
    receiver = tokenizer_receiver(urls, backend)
    obj = generate_request(items)
    errors = []
    ready = receiver._send_encode_request(obj, on_dispatch_error=errors.append)
    ranks.run(obj.rid, obj.num_items_assigned, obj.encoder_urls)
    ready.set()
    ok, details = ranks_outcome(ranks.collect(), lambda report: compare(report, expected))
    ok &= not errors
    parts = sum(1 for count in obj.num_items_assigned[next(iter(obj.num_items_assigned))] if count)
    record(step, ok, f"{parts} part(s); " + "; ".join(details) + (f"; dispatch error {errors}" if errors else ""))


def ranks_outcome(outcome: dict[int, tuple], judge) -> tuple[bool, list[str]]:
    """Whether every rank got its rows (`judge(report) -> (ok, detail)`), and a line per rank."""
    details, ok = [], True
    for rank, (kind, _, payload) in sorted(outcome.items()):
        if kind != "done":
            ok = False
            details.append(f"rank {rank} {kind}: {payload if kind != 'crashed' else payload[-400:]}")
            continue
        rank_ok, detail = judge(payload)
        ok &= rank_ok
        details.append(f"rank {rank}: {detail}")
    return ok, details


def corrupt_image(ranks: Ranks, url: str, good: str) -> None:
    step = "zmq_to_scheduler: corrupt image fails every rank within 1 s with our 400 message"
    receiver = tokenizer_receiver([url], "zmq_to_scheduler")
    obj = generate_request([good, base64.b64encode(b"this is not an image").decode()])
    errors = []
    started = time.time()
    ready = receiver._send_encode_request(obj, on_dispatch_error=errors.append)
    ranks.run(obj.rid, obj.num_items_assigned, obj.encoder_urls)  # the dispatch error is NOT forwarded to them
    ready.set()
    outcome = ranks.collect()
    deadline = time.time() + 10
    while not errors and time.time() < deadline:
        time.sleep(0.01)
    ours = errors[0].error_msg if errors else None
    ok = bool(errors) and errors[0].error_code == 400
    details = [f"/encode answered {errors[0].error_code if errors else 'nothing'}: {ours!r}"]
    for rank, (kind, when, payload) in sorted(outcome.items()):
        rank_ok = kind == "failed" and payload == (ours, 400) and when - started < 1.0
        ok &= rank_ok
        details.append(f"rank {rank} {kind} after {when - started:.3f} s with {payload!r}")
    record(step, ok, "; ".join(details))


def never_registered(url: str, item: str) -> None:
    step = f"zmq_to_scheduler: nobody registers -> 502 after --send-timeout-s {SEND_TIMEOUT_S:g}"
    receiver = tokenizer_receiver([url], "zmq_to_scheduler")
    obj = generate_request([item])
    mm_data = receiver._extract_url_data(obj)
    started = time.monotonic()
    error = asyncio.run(receiver.encode(obj.rid, mm_data, None, "encode", encode_urls=[url]))
    elapsed = time.monotonic() - started
    ok = error is not None and error.error_code == 502 and SEND_TIMEOUT_S <= elapsed < SEND_TIMEOUT_S + 2
    code, message = getattr(error, "error_code", None), getattr(error, "error_msg", None)
    record(step, ok, f"{code} after {elapsed:.2f} s: {message!r}")


def registry_round_trip(flags: tuple[str, ...]) -> None:
    """`--register-with` against SGLang's own EncoderBootstrapServer: listed on start, gone after drain."""
    from sglang.srt.disaggregation.encoder.receiver import EncoderBootstrapServer

    from encode_server.bench.launcher import ServerProcess

    step = "--register-with: SGLang's EncoderBootstrapServer lists us on start, drops us on drain"
    port = free_port()
    registry = EncoderBootstrapServer("127.0.0.1", port, urls=[], health_check_interval=0)
    try:
        with ServerProcess(*flags, "--register-with", f"http://127.0.0.1:{port}") as server:
            deadline = time.monotonic() + 30
            while server.url not in registry.list_urls() and time.monotonic() < deadline:
                time.sleep(0.1)
            listed = registry.list_urls()
        deadline = time.monotonic() + 10
        while registry.list_urls() and time.monotonic() < deadline:
            time.sleep(0.1)
        after = registry.list_urls()
        record(step, listed == [server.url] and after == [], f"while serving {listed}, after drain {after}")
    finally:
        registry.close()


# --- Omni families: SGLang's language side (`get_mm_data`) on our rows -----------------------------
#
# For each of `qwen2_5_omni` and `qwen3_omni_moe`, a tiny full checkpoint (tests/support/checkpoints/qwen_omni.py) is
# served with `--wire-format sglang`, and for each modality SGLang's tokenizer-side receiver takes our parts
# and hands them, merged, to the model's own language-side processor, `QwenVLImageProcessor`, through
# `get_validated_mm_data` (which also checks that every row received is consumed). Its constructor runs as
# shipped except the shared base `__init__` (it needs a published server config), replaced by one that sets
# `hf_config` and the processor. Checked per modality: the placeholder tokens `get_mm_data` builds into
# `input_ids` (per item and in all) equal our rows and the placeholder tokens the transformers full processor
# inserts for the same decoded items; the rows it slices equal our `return_embedding` bytes; audio's
# `audio_feature_lens` equal the processor's `feature_attention_mask`; video's `second_per_grid_ts` equal the
# processor's `video_second_per_grid` at `--video-fps`. Neither Omni processor inserts timestamp text, and
# SGLang's get_mm_data for these model types reads no `video_timestamps`.
#
# Two things cannot be driven exactly as in production, and the steps say so:
# - videos: SGLang dispatches a video as a URL only (a file, which our server decodes with PyAV; the side
#   venv has none), so the video part is requested by a plain POST in SGLang's request form (its part id,
#   `prefill_host`, `embedding_port`) with the frames as a list; the receive, merge and `get_mm_data` are
#   SGLang's;
# - qwen2_5_omni: SGLang 0.5.23 lists Qwen2_5OmniForConditionalGeneration for EPD but has no model and no
#   registered processor for it, and `QwenVLImageProcessor` reads the token ids from the top-level config,
#   where Qwen2.5-Omni has none; its `qwen2_5_omni` branch of `get_mm_data` (the audio count) is driven with
#   the thinker config, relabelled `qwen2_5_omni`.

OMNI_MODEL_TYPES = ("qwen2_5_omni", "qwen3_omni_moe")
OMNI_VIDEO_FPS = 2.0
OMNI_PLACEHOLDERS = {"image": "image_token", "video": "video_token", "audio": "audio_token"}
OMNI_BOUNDARIES = {"image": ("vision_bos_token", "vision_eos_token"), "video": ("vision_bos_token", "vision_eos_token"),
                   "audio": ("audio_bos_token", "audio_eos_token")}


def allow_missing_einops() -> None:
    """SGLang's model modules (`sglang.srt.models.qwen3_vl` and others, which its processor modules import for
    their classes) import `einops` at the top for code the language-side processors never run; the side venv
    may lack it. A stand-in whose every function fails if called is installed only then (once)."""
    import importlib.util

    if "einops" in sys.modules or importlib.util.find_spec("einops") is not None:
        return
    stand_in = types.ModuleType("einops")

    def missing(name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"einops stand-in: einops.{name} is not installed in this venv")
        return unavailable

    stand_in.__getattr__ = missing
    sys.modules["einops"] = stand_in


def omni_language_processor(folder, model_type: str):
    """SGLang's `QwenVLImageProcessor` for the folder, and the transformers full processor it wraps."""
    from unittest import mock

    from sglang.srt.multimodal.processors import base_processor
    from sglang.srt.multimodal.processors.qwen_vl import QwenVLImageProcessor
    from transformers import AutoConfig, AutoProcessor

    hf_config = AutoConfig.from_pretrained(folder)
    processor = AutoProcessor.from_pretrained(folder)
    if model_type == "qwen2_5_omni":
        hf_config = hf_config.thinker_config
        hf_config.model_type = "qwen2_5_omni"

    def base_init(self, hf_config, server_args, _processor, transport_mode=None, *args, **kwargs):
        self.hf_config, self.server_args, self._processor = hf_config, server_args, _processor
        self.transport_mode = transport_mode
        self._tokenizer = _processor.tokenizer

    with mock.patch.object(base_processor.BaseMultimodalProcessor, "__init__", base_init):
        return QwenVLImageProcessor(hf_config, None, processor, None), processor


#: What SGLang 0.5.23's `get_rope_index` raises for Qwen2.5-Omni prompts with images or videos.
QWEN25_OMNI_ROPE_ERROR = "Unimplemented model type: qwen2_5_omni"


class RecordingProcessor:
    """The real language-side processor, keeping what SGLang hands it (`meta`, `embeddings`).

    With `expansion_only` (Qwen2.5-Omni), a `get_mm_data` that stops in SGLang's `get_rope_index` on
    `QWEN25_OMNI_ROPE_ERROR` is recorded (`error`) and the prompt's expansion is taken from the same
    processor's `build_input_ids` on the grids SGLang merged (what `get_mm_data` calls before it)."""

    def __init__(self, inner, expansion_only: bool = False) -> None:
        self.inner = inner
        self.expansion_only = expansion_only
        self.meta = self.embeddings = self.error = None
        self.prefer_tokenized_input = getattr(inner, "prefer_tokenized_input", False)

    def get_validated_mm_data(self, prompt, embeddings, **meta):
        self.meta, self.embeddings = meta, embeddings
        try:
            return self.inner.get_validated_mm_data(prompt, embeddings, **meta)
        except RuntimeError as exc:
            if not self.expansion_only or QWEN25_OMNI_ROPE_ERROR not in str(exc):
                raise
            self.error = str(exc)
        input_ids, offsets, _ = self.inner.build_input_ids(prompt, meta.get("img_grid_thw"), meta.get("video_grid_thw"))
        return types.SimpleNamespace(input_ids=input_ids, mm_items=[types.SimpleNamespace(offsets=[offset])
                                                                    for offset in offsets], mrope_positions=None)


def omni_items(model_type: str, modality: str) -> tuple[list, list]:
    """(the items as sent, the same items decoded as our server decodes them)."""
    import soundfile
    from PIL import Image

    from tests.support.checkpoints import qwen_omni as omni_checkpoints

    def png(image) -> str:
        buffer = io.BytesIO()
        image.save(buffer, "PNG")
        return base64.b64encode(buffer.getvalue()).decode()

    if modality == "image":
        images = omni_checkpoints.sample_images()[:3]
        return [png(image) for image in images], [Image.open(io.BytesIO(base64.b64decode(png(i)))).convert("RGB")
                                                  for i in images]
    if modality == "video":
        clips = omni_checkpoints.sample_clips()
        return [{"frames": [png(frame) for frame in clip]} for clip in clips], clips
    sent, decoded = [], []
    for clip in omni_checkpoints.sample_audio(model_type):
        buffer = io.BytesIO()
        soundfile.write(buffer, clip, omni_checkpoints.SAMPLING_RATE, format="WAV", subtype="FLOAT")
        sent.append(base64.b64encode(buffer.getvalue()).decode())
        decoded.append(soundfile.read(io.BytesIO(buffer.getvalue()), dtype="float32")[0])
    return sent, decoded


def omni_prompt(model_type: str, modality: str, count: int) -> str:
    from tests.support.checkpoints.qwen_omni import TOKENS

    tokens = TOKENS[model_type]
    start, end = (tokens[name] for name in OMNI_BOUNDARIES[modality])
    return "describe " + " and ".join(f"{start}{tokens[OMNI_PLACEHOLDERS[modality]]}{end}" for _ in range(count))


async def omni_receive(url: str, model_type: str, modality: str, sent: list, prompt: str, processor):
    """SGLang's receiver (tokenizer side) on one request; None if SGLang gave up (see its log)."""
    import httpx
    import zmq
    import zmq.asyncio
    from sglang.srt.disaggregation.encoder.receiver import MMReceiverHTTP, create_part_req_id
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.utils.network import get_zmq_socket_on_host

    receiver = MMReceiverHTTP.__new__(MMReceiverHTTP)  # what MMReceiverBase.__init__ sets on the tokenizer
    receiver.context = zmq.asyncio.Context()
    receiver.encoder_transfer_backend = "zmq_to_tokenizer"
    receiver.encode_urls = [url]
    receiver.host = "127.0.0.1"
    receiver.recv_timeout = 60
    receiver.model_type = model_type
    if modality != "video":
        field = {"image": "image_data", "audio": "audio_data"}[modality]
        request = GenerateReqInput(text=prompt, rid=f"omni{time.monotonic_ns()}", **{field: list(sent)})
        return await receiver.recv_mm_data(request, processor, prompt)
    req_id = f"omni{time.monotonic_ns()}"
    port, socket_ = get_zmq_socket_on_host(receiver.context, zmq.PULL, host="127.0.0.1")
    body = {"req_id": create_part_req_id(req_id, 0), "num_parts": 1, "part_idx": 0, "modality": "VIDEO",
            "mm_items": sent, "prefill_host": "127.0.0.1", "embedding_port": port}
    async with httpx.AsyncClient(timeout=60) as client:
        answer = await client.post(url + "/encode", json=body)
    if answer.status_code != 200:
        socket_.close()
        raise RuntimeError(f"/encode answered {answer.status_code}: {answer.text}")
    return await receiver._recv_mm_data(req_id, socket_, processor, prompt)


def omni_reference(url: str, modality: str, sent: list) -> tuple[bytes, list[dict]]:
    import httpx

    response = httpx.post(url + "/encode", json={"req_id": f"ref-{time.monotonic_ns()}", "modality": modality,
                                                 "mm_items": sent, "return_embedding": True}, timeout=60)
    response.raise_for_status()
    body = response.json()
    return base64.b64decode(body["embedding"]), body["items"]


def omni_full_processor_counts(hf_processor, model_type: str, modality: str, decoded: list) -> tuple[list, list]:
    """Per item, alone: the placeholder tokens the transformers full processor inserts, and its audio frames
    (`feature_attention_mask`) or video `video_second_per_grid`."""
    from tests.support.checkpoints.qwen_omni import TOKENS, token_ids

    placeholder = token_ids(model_type)[OMNI_PLACEHOLDERS[modality]]
    text = [f"describe {TOKENS[model_type][OMNI_PLACEHOLDERS[modality]]}"]
    counts, extra = [], []
    for item in decoded:
        if modality == "image":
            out = hf_processor(text=text, images=[item], return_tensors="pt")
        elif modality == "video":
            out = hf_processor(text=text, videos=[item], fps=OMNI_VIDEO_FPS, return_tensors="pt")
            extra.append(float(out["video_second_per_grid"][0]))
        else:
            out = hf_processor(text=text, audio=[item], return_tensors="pt")
            extra.append(int(out["feature_attention_mask"].sum()))
        counts.append(int((out["input_ids"] == placeholder).sum()))
    return counts, extra


def omni_check(url: str, model_type: str, modality: str, mm_processor, hf_processor) -> None:
    from tests.support.checkpoints.qwen_omni import token_ids

    notes = []
    if model_type == "qwen2_5_omni":
        notes.append("thinker config, SGLang has no qwen2_5_omni model")
    if modality == "video":
        notes.append("frames POSTed in SGLang's request form")
    expansion = "build_input_ids" if model_type == "qwen2_5_omni" and modality != "audio" else "get_mm_data"
    note = f" ({'; '.join(notes)})" if notes else ""
    step = f"{model_type} {modality}: {expansion} placeholders == our rows == transformers' processor{note}"
    try:
        sent, decoded = omni_items(model_type, modality)
        ours, items = omni_reference(url, modality, sent)
        rows = [item["tokens"] for item in items]
        prompt = omni_prompt(model_type, modality, len(sent))
        recorder = RecordingProcessor(mm_processor, expansion_only=model_type == "qwen2_5_omni")
        output = asyncio.run(omni_receive(url, model_type, modality, sent, prompt, recorder))
        if output is None:
            record(step, False, "SGLang's receiver returned None (see the log above)")
            return
        placeholder = token_ids(model_type)[OMNI_PLACEHOLDERS[modality]]
        in_prompt = sum(1 for token in output.input_ids if token == placeholder)
        per_item = [end - start + 1 for item in output.mm_items for start, end in item.offsets]
        slices = [item.precomputed_embeddings for item in output.mm_items] if recorder.error is None \
            else list(recorder.embeddings.values())  # the rows SGLang merged, as get_mm_data would slice them
        spliced = b"".join(rows_.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()
                           for rows_ in slices)
        theirs, extra = omni_full_processor_counts(hf_processor, model_type, modality, decoded)
        meta = recorder.meta
        ok = in_prompt == sum(rows) and per_item == rows == theirs and spliced == ours
        built = "get_mm_data" if recorder.error is None else f"build_input_ids (get_mm_data: {recorder.error!r})"
        details = [f"rows {rows}", f"{built} {per_item} ({in_prompt} in input_ids)", f"transformers {theirs}",
                   f"rows {'identical' if spliced == ours else 'DIFFERENT'} to return_embedding"]
        if modality == "audio":
            lens = meta["audio_feature_lens"].tolist()
            ok &= lens == extra == [item.get("mel_frames", lens[i]) for i, item in enumerate(items)]
            details.append(f"audio_feature_lens {lens} (transformers' feature_attention_mask {extra})")
        if modality == "video":
            seconds = [float(value) for value in (meta.get("second_per_grid_ts") or [])]
            ok &= seconds == extra
            details.append(f"second_per_grid_ts {seconds} (transformers' video_second_per_grid {extra})")
        positions = getattr(output, "mrope_positions", None)
        if recorder.error is None:
            ok &= positions is not None and tuple(positions.shape) == (3, len(output.input_ids))
            details.append(f"mrope_positions {tuple(positions.shape) if positions is not None else None}")
        record(step, ok, "; ".join(details))
    except Exception:
        record(step, False, traceback.format_exc()[-1500:])


def omni_language_side() -> None:
    """The Omni checks, one row per architecture and modality."""
    import tempfile
    from pathlib import Path

    from encode_server.bench.launcher import ServerProcess
    from tests.support.checkpoints.qwen_omni import checkpoint

    allow_missing_einops()
    with tempfile.TemporaryDirectory(prefix="omni-compat-") as work:
        for seed, model_type in enumerate(OMNI_MODEL_TYPES, start=41):
            _, folders = checkpoint(Path(work), model_type, seed, layouts=("nested",))
            folder = folders["nested"]
            mm_processor, hf_processor = omni_language_processor(folder, model_type)
            with ServerProcess("--model", str(folder), "--wire-format", "sglang", "--device", "cpu",
                               "--video-fps", str(OMNI_VIDEO_FPS), "--send-timeout-s", str(SEND_TIMEOUT_S)) as server:
                for modality in ("image", "video", "audio"):
                    omni_check(server.url, model_type, modality, mm_processor, hf_processor)


def print_results() -> int:
    return report()
# --- Muse Spark and Dots3-Note: SGLang's own language side rebuilds the prompt from our fields ---------

AV_VIDEO_FPS = 2.0


def omni_media(rate: int) -> dict:
    """Two images, one video file (mp4: our server decodes it at AV_VIDEO_FPS) and two audio clips at `rate`."""
    import av

    from tests.support.tiny_parts import video, wav_b64, waveform

    frames = video(64, 48, 4, 1)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=int(AV_VIDEO_FPS))
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_image(frame)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    clips = [waveform(0.7, rate, 1), waveform(1.3, rate, 2)]
    return {"image": [png_b64(60, 45, seed=3), png_b64(130, 40, seed=4)],
            "video": [base64.b64encode(buffer.getvalue()).decode()],
            "audio": [wav_b64(clip, rate) for clip in clips]}


def decoded(modality: str, item: str, rate: int):
    """An item as our server decodes it, for transformers' own processor (the same frames, the same samples)."""
    from encode_server.media.decoding import decode_audio, decode_image, decode_video

    data = base64.b64decode(item)
    if modality == "image":
        return decode_image(data, 10**9, "ref")
    if modality == "video":
        return decode_video(data, AV_VIDEO_FPS, 64, 10**9, "ref")
    return decode_audio(data, rate, 3600.0, "ref")


def av_reference(url: str, modality: str, items: list[str]) -> tuple[bytes, int]:
    """Our own answer for the items: `return_embedding` bytes and the row count."""
    import httpx

    response = httpx.post(url + "/encode", json={"req_id": f"ref-{time.monotonic_ns()}", "modality": modality,
                                                 "mm_items": items, "return_embedding": True}, timeout=120)
    response.raise_for_status()
    body = response.json()
    return base64.b64decode(body["embedding"]), int(body["embedding_shape"][0])


def hf_inputs(processor, prompt: str, modality: str, media: list, rate: int):
    """What the model's full transformers processor makes of the prompt and the decoded media."""
    if modality == "image":
        return processor(text=[prompt], images=media, return_tensors="pt")
    if modality == "audio":
        return processor(text=[prompt], audio=media, sampling_rate=rate, return_tensors="pt")
    from transformers.video_utils import VideoMetadata

    metadata = [VideoMetadata(total_num_frames=len(frames), fps=AV_VIDEO_FPS, frames_indices=list(range(len(frames))))
                for frames in media]
    return processor(text=[prompt], videos=media, return_tensors="pt",
                     videos_kwargs={"do_sample_frames": False, "return_metadata": True, "video_metadata": metadata})


def received_rows(output, modality) -> bytes:
    import torch

    rows = [item.precomputed_embeddings for item in output.mm_items if item.modality.name == modality.upper()]
    return torch.cat(rows).contiguous().view(-1).view(torch.uint8).numpy().tobytes() if rows else b""


def muse_spark_processor(folder, processor):
    """SGLang's `MuseSpark1xOmniMultimodalProcessor`, built by its own constructor (its runtime context published
    from a `ServerArgs` for the folder, as a language-only server has it)."""
    from sglang.srt.multimodal.processors.muse_spark_omni import MuseSpark1xOmniMultimodalProcessor
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs
    from transformers import AutoConfig

    server_args = ServerArgs(model_path=str(folder), mm_process_config={})
    get_context().set_server_args(server_args)
    return MuseSpark1xOmniMultimodalProcessor(AutoConfig.from_pretrained(folder), server_args, processor, "default")


def dots3_note_processor(folder, processor):
    """SGLang's `DotsNoteOmniProcessor`, made with `__new__`: its constructor reads the published checkpoint's
    `preprocessor_config.json` layout for preprocessing, which get_mm_data does not use."""
    import json

    from sglang.srt.configs.dots3 import Dots3Config
    from sglang.srt.multimodal.processors.dots_note_omni import DotsNoteOmniProcessor

    mm_processor = DotsNoteOmniProcessor.__new__(DotsNoteOmniProcessor)
    config = json.loads((folder / "config.json").read_text())
    mm_processor.hf_config = Dots3Config(**{**config, **config.pop("text_config", {})})
    mm_processor._processor, mm_processor._tokenizer = processor, processor.tokenizer
    return mm_processor


AV_FAMILIES = {
    # family: (checkpoint builder, SGLang processor, sampling rate, the placeholders the HF processor expands,
    #          the merge that turns the grids we send into rows)
    "muse_spark": ("muse_spark_checkpoint", muse_spark_processor, 24000,
                   {"image": "<|patch|>", "video": "<|video|>", "audio": "<|audio|>"}, 1),
    "dots3_note": ("dots3_note_checkpoint", dots3_note_processor, 16000,
                   {"image": "<|imgpad|>", "video": "<|video_pad|>", "audio": "<|audio_comp_pad|>"}, 2),
}


def field_rows(meta: dict, modality: str, merge: int) -> int:
    """The rows SGLang's merged fields account for: grids over merge^2 (a merged grid has merge 1), audio lengths."""
    if modality == "audio":
        return int(meta["audio_feature_lens"].sum())
    grids = meta["img_grid_thw" if modality == "image" else "video_grid_thw"]
    return int(grids.prod(-1).sum()) // merge**2


def av_family_checks(family: str) -> None:
    """For each modality: our server (`--wire-format sglang`) -> SGLang's receiver (`zmq_to_tokenizer`: dispatch,
    ZMQ receive, part merging) -> the model's SGLang language-side processor, called as the receiver calls it,
    `get_validated_mm_data(prompt, embeddings, **merged fields)`. Its `input_ids` must be those of the model's full
    transformers processor for the same prompt and media (placeholder counts and, for video, the timestamp text),
    and the rows it splices ours. Independently of that call, the merged fields must account for the placeholders
    the transformers processor inserts."""
    import importlib
    import tempfile
    from pathlib import Path

    from transformers import AutoProcessor

    from encode_server.bench.launcher import ServerProcess

    builder, make_processor, rate, tokens, merge = AV_FAMILIES[family]
    with tempfile.TemporaryDirectory() as work:
        folder = Path(work) / family
        folder.mkdir()
        getattr(importlib.import_module(f"tests.support.checkpoints.{family}"), builder)(folder)
        processor = AutoProcessor.from_pretrained(folder)
        mm_processor = make_processor(folder, processor)
        media = omni_media(rate)
        flags = ("--model", str(folder), "--wire-format", "sglang", "--video-fps", str(AV_VIDEO_FPS))
        with ServerProcess(*flags) as server:
            for modality, items in media.items():
                prompt = "look: " + " and ".join(tokens[modality] for _ in items) + " done"
                expected = hf_inputs(processor, prompt, modality, [decoded(modality, item, rate) for item in items],
                                     rate)["input_ids"][0].tolist()
                token_id = processor.tokenizer.convert_tokens_to_ids(tokens[modality])
                ours, rows = av_reference(server.url, modality, items)
                receiver = tokenizer_receiver([server.url], "zmq_to_tokenizer")
                receiver.model_type = family
                captured = asyncio.run(receiver.recv_mm_data(omni_request(modality, items, prompt),
                                                             CapturingProcessor(), prompt))
                if captured is None:
                    record(f"{family} {modality}: SGLang's receiver merges our parts", False, "recv_mm_data gave None")
                    continue
                counted = field_rows(captured.meta, modality, merge)
                record(f"{family} {modality}: merged fields account for the transformers processor's placeholders",
                       counted == expected.count(token_id) == rows,
                       f"fields give {counted} rows, the processor inserts {expected.count(token_id)} placeholders, "
                       f"we sent {rows} rows")
                step = f"{family} {modality}: get_mm_data's input_ids are the transformers processor's"
                try:
                    output = mm_processor.get_validated_mm_data(captured.prompt, captured.embeddings, **captured.meta)
                except Exception as exc:  # noqa: BLE001 (SGLang's own failure, reported as the row's result)
                    from tests.support.sglang_side import sglang_missing_attribute

                    reason = sglang_missing_attribute(mm_processor, exc)
                    if reason is not None:
                        record_sglang_side(step, reason)
                    else:
                        record(step, False, f"SGLang's {type(mm_processor).__name__}.get_mm_data raised "
                                            f"{type(exc).__name__}: {exc}")
                    continue
                ids = list(output.input_ids)
                same_ids, same_rows = ids == expected, received_rows(output, modality) == ours
                placeholders = ids.count(token_id)
                stamps = ""
                if modality == "video":
                    text = processor.tokenizer.decode(ids)
                    stamps = "; timestamps " + " ".join(part.split("<")[0] for part in text.split("Time: ")[1:])
                record(step, same_ids and same_rows and placeholders == rows,
                       f"{placeholders} placeholders for {rows} rows; input_ids {'identical' if same_ids else 'DIFFER'}"
                       f" ({len(ids)} tokens); spliced rows {'identical' if same_rows else 'DIFFER'}{stamps}")


def omni_request(modality: str, items: list[str], prompt: str):
    from sglang.srt.managers.io_struct import GenerateReqInput

    return GenerateReqInput(text=prompt, rid=f"req{time.monotonic_ns()}", **{f"{modality}_data": list(items)})


# --- Kimi K2.5, GLM-5-Next, MiniMax-M3 VL: our rows through SGLang's receiver into each model's own get_mm_data --

def epd_language_processor(model_type: str, folder):
    """The model's own SGLang multimodal processor, as the prefill server holds it, made without its constructor
    (which needs the LLM's server args): given the attributes that constructor sets, from the folder's config
    and `transformers` processor (what SGLang loads as `_processor`)."""
    from sglang.srt.multimodal.processors.base_processor import MultimodalSpecialTokens
    from transformers import AutoConfig, AutoProcessor

    config, hf = AutoConfig.from_pretrained(folder), AutoProcessor.from_pretrained(folder)
    if model_type == "kimi_k25":
        from sglang.srt.multimodal.processors.kimi_k25 import KimiK2_5VLImageProcessor as cls
    elif model_type == "glm5_next":
        from sglang.srt.multimodal.processors.glm4v import Glm4vImageProcessor as cls
    else:
        from sglang.srt.multimodal.processors.minimax_m3_vl import MiniMaxM3VLProcessor as cls
    processor = cls.__new__(cls)
    processor.hf_config, processor._processor, processor._tokenizer = config, hf, hf.tokenizer
    tokens = hf.tokenizer.convert_tokens_to_ids
    if model_type == "kimi_k25":  # KimiK2_5VLImageProcessor.__init__ (media_placeholder_token_id: image_token_id)
        processor.mm_tokens = MultimodalSpecialTokens(image_token="<|media_pad|>",
                                                      image_token_id=config.image_token_id)
        processor.processor_fingerprint = "encode-server sglang_compat"  # what the image identities hash with
    elif model_type == "glm5_next":  # Glm4vImageProcessor.__init__
        processor.IM_TOKEN_ID, processor.VIDEO_TOKEN_ID = config.image_token_id, config.video_token_id
        processor.IM_START_TOKEN_ID, processor.IM_END_TOKEN_ID = config.image_start_token_id, config.image_end_token_id
    else:  # MiniMaxM3VLProcessor.__init__
        processor.IM_TOKEN_ID, processor.VIDEO_TOKEN_ID = tokens(cls.IMAGE_TOKEN), tokens(cls.VIDEO_TOKEN)
        processor.IM_START_TOKEN_ID = tokens(cls.IMAGE_START_TOKEN)
        processor.IM_END_TOKEN_ID = tokens(cls.IMAGE_END_TOKEN)
    return processor, hf


def frames_b64(frames) -> dict:
    buffers = []
    for frame in frames:
        buffer = io.BytesIO()
        frame.save(buffer, "PNG")
        buffers.append(base64.b64encode(buffer.getvalue()).decode())
    return {"frames": buffers}


def epd_case(model_type: str, folder, url: str, modality: str, items: list, placeholders: int, step: str) -> None:
    """One request through SGLang's `MMReceiverHTTP.recv_mm_data` (zmq_to_tokenizer) into the model's own
    `get_validated_mm_data`, as the prefill's tokenizer runs it. Passes when the input_ids it builds hold one
    placeholder per row we sent, the rows it keeps are ours byte for byte, and (where the two layouts are meant
    to agree) the input_ids equal what the model's full `transformers` processor builds for the same items."""
    import httpx
    import torch
    from sglang.srt.managers.io_struct import GenerateReqInput

    from tests.support.checkpoints.media import PROMPTS

    processor, hf = epd_language_processor(model_type, folder)
    prompt = " ".join([PROMPTS[model_type][modality]] * len(items))
    prompt_ids = hf.tokenizer.encode(prompt, add_special_tokens=False)
    wire = [png_b64_of(item) if modality == "image" else frames_b64(item) for item in items]
    ours = httpx.post(url + "/encode", json={"req_id": f"ref-{time.monotonic_ns()}", "modality": modality,
                                            "mm_items": wire, "return_embedding": True}, timeout=120).json()
    rows = base64.b64decode(ours["embedding"])
    data = {"image_data": [{"url": item} for item in wire]} if modality == "image" else \
        {"video_data": [{"url": item} for item in wire]}
    request = GenerateReqInput(input_ids=list(prompt_ids), rid=f"req{time.monotonic_ns()}", **data)
    receiver = tokenizer_receiver([url], "zmq_to_tokenizer")
    receiver.model_type = model_type
    try:
        out = asyncio.run(receiver.recv_mm_data(request, processor, list(prompt_ids)))
        error = None if out is not None else "recv_mm_data returned None (see the log above)"
    except Exception as exc:  # noqa: BLE001 (SGLang's refusal is the outcome to report)
        out, error = None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    if out is None:
        record(step, False, error)
        return
    token = PROMPTS[model_type]["video_row_token" if modality == "video" else "image_token"]
    if model_type == "glm5_next" and modality == "video":
        token = "<|video|>"  # SGLang's GLM language side fills a video with its video token (HF: image tokens)
    count = sum(1 for t in out.input_ids if t == hf.tokenizer.convert_tokens_to_ids(token))
    kept = torch.cat([item.precomputed_embeddings for item in out.mm_items]).contiguous()
    same_rows = kept.view(-1).view(torch.uint8).numpy().tobytes() == rows
    detail = (f"{ours['embedding_shape'][0]} rows, grids {[i['grid_thw'] for i in ours['items']]}; get_mm_data: "
              f"{count} placeholders, {len(out.mm_items)} items, rows {'ours' if same_rows else 'DIFFERENT'}")
    ok = count == ours["embedding_shape"][0] == placeholders and same_rows
    if model_type != "glm5_next" or modality == "image":
        media = {"images": items} if modality == "image" else {"videos": items, "do_sample_frames": False}
        if modality == "video":  # frames sent as images are at our --video-fps (MiniMax writes their times)
            fps = float(httpx.get(url + "/server_info", timeout=30).json()["settings"]["video_fps"])
            media["video_metadata"] = [{"fps": fps, "frames_indices": list(range(len(frames))),
                                        "total_num_frames": len(frames)} for frames in items]
        hf_ids = hf(text=[prompt], return_tensors="pt", **media)["input_ids"][0].tolist()
        ok &= hf_ids == list(out.input_ids)
        detail += f"; input_ids {'==' if hf_ids == list(out.input_ids) else '!='} transformers' full processor's"
    record(step, ok, detail)


def png_b64_of(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def kimi_glm5_minimax_checks(work) -> None:
    """Kimi K2.5, GLM-5-Next and MiniMax-M3 VL, images and videos, each a tiny checkpoint folder served by us."""
    from pathlib import Path

    from transformers import AutoProcessor

    from encode_server.bench.launcher import ServerProcess
    from tests.support.checkpoints.media import CHECKPOINTS, PROMPTS, sample_images
    from tests.support.tiny_parts import clip

    images = sample_images()[2:4]
    for model_type, build in CHECKPOINTS.items():
        folder = build(Path(work) / model_type)[1]
        hf = AutoProcessor.from_pretrained(folder)
        # MiniMax's full processor takes videos already resized to whole merged patches: give it such frames.
        clips = [clip(3, 56, 84, 1), clip(5, 112, 56, 2)]
        counts = {}
        for modality, items in (("image", images), ("video", clips)):
            media = {"images": items} if modality == "image" else {"videos": items, "do_sample_frames": False}
            text = " ".join([PROMPTS[model_type][modality]] * len(items))
            ids = hf(text=[text], return_tensors="pt", **media)["input_ids"][0].tolist()
            row_token = PROMPTS[model_type]["video_row_token" if modality == "video" else "image_token"]
            counts[modality] = ids.count(hf.tokenizer.convert_tokens_to_ids(row_token))
        with ServerProcess("--model", str(folder), "--wire-format", "sglang") as server:
            epd_case(model_type, folder, server.url, "image", images, counts["image"],
                     f"{model_type} image: 2 images through SGLang's receiver into its get_mm_data")
            if model_type == "kimi_k25":
                kimi_video_refused(folder, server.url, clips)
            else:
                epd_case(model_type, folder, server.url, "video", clips, counts["video"],
                         f"{model_type} video: 2 clips (3 and 5 frames) through SGLang's receiver into its get_mm_data")


def kimi_video_refused(folder, url: str, clips: list) -> None:
    """SGLang 0.5.23's Kimi K2.5 language side has no video path (`get_mm_data` builds image items from
    `img_grid_thw` only): our video rows arrive and are merged with their grid, and its `get_mm_data` fails on
    them (so SGLang fails the request), as it would on its own encoder's."""
    import httpx
    from sglang.srt.managers.io_struct import GenerateReqInput

    from tests.support.checkpoints.media import PROMPTS

    step = "kimi_k25 video: our rows reach SGLang, whose Kimi get_mm_data takes no video (the request fails there)"
    processor, hf = epd_language_processor("kimi_k25", folder)
    seen = {}
    own = processor.get_validated_mm_data

    def watched(prompt, embeddings, **meta):
        seen["embeddings"], seen["meta"] = embeddings, meta
        try:
            return own(prompt, embeddings, **meta)
        except Exception as exc:
            seen["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            raise

    processor.get_validated_mm_data = watched
    item = frames_b64(clips[0])
    ours = httpx.post(url + "/encode", json={"req_id": f"ref-{time.monotonic_ns()}", "modality": "video",
                                            "mm_items": [item], "return_embedding": True}, timeout=120).json()
    prompt_ids = hf.tokenizer.encode(PROMPTS["kimi_k25"]["video"], add_special_tokens=False)
    request = GenerateReqInput(input_ids=list(prompt_ids), rid=f"req{time.monotonic_ns()}",
                               video_data=[{"url": item}])
    receiver = tokenizer_receiver([url], "zmq_to_tokenizer")
    receiver.model_type = "kimi_k25"
    out = asyncio.run(receiver.recv_mm_data(request, processor, list(prompt_ids)))
    got = {modality.name: tuple(tensor.shape) for modality, tensor in seen.get("embeddings", {}).items()}
    grid = seen.get("meta", {}).get("video_grid_thw")
    grid = None if grid is None else grid.tolist()
    arrived = got == {"VIDEO": tuple(ours["embedding_shape"])} and grid == [i["grid_thw"] for i in ours["items"]]
    record(step, out is None and arrived and "error" in seen,
           f"received {got}, video_grid_thw {grid} (ours: {ours['embedding_shape']}, "
           f"{[i['grid_thw'] for i in ours['items']]}); get_mm_data: {seen.get('error', 'no error')}")


# --- the language side: the model's own SGLang processor on what SGLang's receiver merged -----------
#
# For the Qwen-VL architectures and Qwen2-Audio: a tiny checkpoint saved with its full processor and an offline
# byte-level tokenizer (tests/support/checkpoints/prompts.py), one of our encoders serving it, and SGLang's own
# language-side processor for it, built the way SGLang's receiver builds it (`_init_mm_processor`).
# A request goes out through SGLang's `recv_mm_data` (dispatch, then its receive path: unpickling,
# `_aggregate_embedding_part`, `get_mm_extra_meta`), which hands the merged parts to
# `mm_processor.get_validated_mm_data(prompt, embeddings, **received fields)` exactly as a prefill
# server does. Each (architecture, modality) is one small function in LANGUAGE_CASES; to add an
# architecture, add its checkpoint builder to LANGUAGE_CHECKPOINTS and its cases to LANGUAGE_CASES.

@dataclasses.dataclass
class LanguageRow:
    """One row of the language-side table."""

    architecture: str
    modality: str
    ok: bool
    rows: int | None = None  # our embedding rows for the request
    placeholders: int | None = None  # placeholder tokens in the input_ids SGLang's processor built
    same_input_ids: bool | None = None  # those input_ids equal transformers' processor's for the same media
    timestamps: str = "-"  # the `<t seconds>` SGLang wrote (Qwen3-VL, Qwen3.5 videos), or "none"
    own: float | None = None  # max relative difference of our rows from the model's own features, or None
    detail: str = ""


LANGUAGE_RESULTS: list[LanguageRow] = []


def record_language(row: LanguageRow) -> None:
    LANGUAGE_RESULTS.append(row)
    print(f"[{'PASS' if row.ok else 'FAIL'}] language side, {row.architecture} {row.modality}: {row.detail}",
          flush=True)


def sglang_language_processor(folder) -> tuple:
    """SGLang's language-side processor for a checkpoint folder, as its EPD receiver builds it.

    The settings are a `--language-only` server's, so SGLang's own check that the architecture may run
    disaggregated applies; the encoder URL in them is never contacted (nothing here starts a server). The
    prefix cache, which the processor does not touch, is off: for Qwen3.5's linear-attention layers its
    default needs a GPU platform."""
    allow_missing_einops()
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.disaggregation.encoder.receiver import MMReceiverHTTP
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=str(folder), device="cpu", language_only=True,
                             encoder_urls=["http://127.0.0.1:9"], encoder_transfer_backend="zmq_to_tokenizer",
                             disable_radix_cache=True)
    publish(server_args, role="tokenizer")
    model_config = ModelConfig.from_server_args(server_args)
    holder = MMReceiverHTTP.__new__(MMReceiverHTTP)
    holder._init_mm_processor(server_args, model_config.hf_config, model_config)
    return holder.mm_processor, model_config.hf_config.model_type


class ServedModel:
    """One architecture under test: its tiny checkpoint, our encoder serving it, SGLang's language-side
    processor and `transformers`' processor for it."""

    def __init__(self, model_type: str, folder, server) -> None:
        import httpx
        from transformers import AutoProcessor

        from tests.support.checkpoints.prompts import ARCHITECTURES, prompts_for

        self.model_type, self.folder, self.server = model_type, folder, server
        self.architecture = ARCHITECTURES[model_type]
        self.prompts = prompts_for(model_type)
        self.mm_processor, sglang_model_type = sglang_language_processor(folder)
        if sglang_model_type != model_type:
            raise RuntimeError(f"SGLang reads the folder as {sglang_model_type}, not {model_type}")
        self.hf_processor = AutoProcessor.from_pretrained(folder)
        self.reference_model = None  # the whole model, loaded when rows are compared with its own features
        settings = httpx.get(server.url + "/server_info", timeout=30).json()["settings"]
        self.video_fps = float(settings["video_fps"])

    def token_id(self, modality: str) -> int:
        return self.hf_processor.tokenizer.convert_tokens_to_ids(self.prompts.token[modality])

    def own_rows(self, modality: str, inputs) -> object:
        """The model's own features (`transformers`, the whole model loaded from the folder) for what its processor
        made of the media: the rows the language model receives in a monolithic server. None where the model has
        no `get_image_features` / `get_video_features` taking the processor's pixels and grid."""
        from tools.reference.model_reference import own_features, whole_model

        keys = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}
        if modality not in keys or not all(key in inputs for key in keys[modality]):
            return None
        if self.reference_model is None:
            self.reference_model = whole_model(self.folder)
        return own_features(self.reference_model, modality, *(inputs[key] for key in keys[modality]))


def ours(model: ServedModel, modality: str, items: list) -> dict:
    """Our own answer for the items in one request: rows, items (grids, timestamps), embedding bytes."""
    import httpx

    response = httpx.post(model.server.url + "/encode", timeout=120, json={
        "req_id": f"ours-{time.monotonic_ns()}", "modality": modality, "mm_items": items, "return_embedding": True})
    response.raise_for_status()
    return response.json()


def through_sglang(model: ServedModel, modality: str, items: list, prompt: str) -> tuple:
    """Send the items to our encoder through SGLang's tokenizer-side receiver (`recv_mm_data`; two parts when
    there are two or more items: our encoder listed twice) and return what the model's language-side processor
    built and what SGLang handed it (`RecordingProcessor`). A video as frames goes as `{"url": {"frames":
    [...]}}`, which SGLang's `_extract_url_data` passes on to us as `{"frames": [...]}`."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    urls = [model.server.url] * min(2, len(items))
    receiver = tokenizer_receiver(urls, "zmq_to_tokenizer")
    receiver.model_type = model.model_type
    recording = RecordingProcessor(model.mm_processor)
    data = [item if isinstance(item, str) else {"url": item} for item in items]
    request = GenerateReqInput(text=prompt, rid=f"req{time.monotonic_ns()}", **{f"{modality}_data": data})
    output = asyncio.run(receiver.recv_mm_data(request, recording, prompt))
    if output is None:
        raise RuntimeError("SGLang's receiver gave nothing (see the log above)")
    return output, recording


def check_language_side(model: ServedModel, modality: str, items: list, transformers_media: dict,
                        timestamps: bool) -> LanguageRow:
    """One request of `items` through SGLang; the checks every case shares.

    `transformers_media`: the same media as `transformers`' processor takes it (decoded as our server
    decodes it). `timestamps`: whether the model's prompt names each video patch's time."""
    import torch

    from tests.support.checkpoints.prompts import prompt_timestamps

    prompt = model.prompts.prompt(modality, len(items))
    reference = ours(model, modality, items)
    output, received = through_sglang(model, modality, items, prompt)
    rows = reference["embedding_shape"][0]
    token = model.token_id(modality)
    placeholders = sum(1 for token_id in output.input_ids if token_id == token)
    merged = received.embeddings
    (merged_modality, merged_rows), = merged.items()
    merged_bytes = merged_rows.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    same_bytes = merged_modality.name.lower() == modality and merged_bytes == base64.b64decode(reference["embedding"])
    processed = model.hf_processor(text=[prompt], return_tensors="pt", **transformers_media)
    expected = processed["input_ids"][0].tolist()
    same_ids = list(output.input_ids) == expected
    own, own_ok = model.own_rows(modality, processed), True
    if own is not None:
        ours_rows = torch.frombuffer(bytearray(base64.b64decode(reference["embedding"])), dtype=torch.float32)
        ours_rows = ours_rows.reshape(reference["embedding_shape"])
        own = float((ours_rows - own).norm() / own.norm()) if own.shape == ours_rows.shape else float("inf")
        own_ok = own <= 1e-5
    tokenizer = model.hf_processor.tokenizer
    written = prompt_timestamps(tokenizer.decode(list(output.input_ids)))
    if timestamps:
        ours_text = [f"{seconds:.1f}" for item in reference["items"] for seconds in item["video_timestamps"]]
        stamps_ok = bool(written) and written == prompt_timestamps(tokenizer.decode(expected)) == ours_text
        stamps = " ".join(written) or "none"
    else:
        stamps_ok, stamps = not written, "none"
    fields = {key: plain(value) for key, value in received.meta.items() if value is not None}
    ok = placeholders == rows and same_bytes and same_ids and stamps_ok and own_ok
    detail = (f"{len(items)} item(s), our rows {rows}, SGLang's prompt {placeholders} placeholders; merged rows "
              f"{'identical to ours' if same_bytes else 'DIFFERENT from ours'}; the model's own features on "
              f"transformers' processor output: {'-' if own is None else f'rel {own:.1e}'}; input_ids "
              f"{'equal' if same_ids else 'DIFFER from'} transformers'; timestamps {stamps}"
              f"{'' if stamps_ok else ' (MISMATCH with transformers or ours)'}; received {fields}")
    return LanguageRow(model.architecture, modality, ok, rows, placeholders, same_ids, stamps, own, detail)


def plain(value):
    """Tensors (and lists of them) as plain numbers, for printing."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


def png_frames(count: int, width: int, height: int, seed: int) -> list[str]:
    return [png_b64(width, height, seed * 100 + index) for index in range(count)]


def pil_of(b64: str):
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")


def wav_b64(seconds: float, rate: int, seed: int) -> str:
    import numpy as np
    import soundfile

    wave = (0.1 * np.random.default_rng(seed).standard_normal(int(seconds * rate))).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, wave, rate, format="WAV", subtype="FLOAT")
    return "data:audio/wav;base64," + base64.b64encode(buffer.getvalue()).decode()


def qwen_vl_images(model: ServedModel) -> LanguageRow:
    """Two images of different sizes (two parts)."""
    items = [png_b64(56, 84, seed=11), png_b64(112, 56, seed=12)]
    return check_language_side(model, "image", items, {"images": [pil_of(item) for item in items]}, timestamps=False)


def qwen_vl_videos(model: ServedModel, timestamps: bool = False) -> LanguageRow:
    """Two videos as frames (two parts): 5 frames (an odd count) and 4, sampled at our --video-fps."""
    clips = [png_frames(5, 64, 48, seed=21), png_frames(4, 96, 64, seed=22)]
    media = {"videos": [[pil_of(frame) for frame in frames] for frames in clips], "do_sample_frames": False,
             "video_metadata": [{"fps": model.video_fps, "frames_indices": list(range(len(frames))),
                                 "total_num_frames": len(frames)} for frames in clips]}
    return check_language_side(model, "video", [{"frames": frames} for frames in clips], media, timestamps)


def qwen3_vl_videos(model: ServedModel) -> LanguageRow:
    """As `qwen_vl_videos`, and the `<t seconds>` SGLang writes must be transformers' for the same frames."""
    return qwen_vl_videos(model, timestamps=True)


def qwen2_audio_clips(model: ServedModel) -> LanguageRow:
    """Two clips of different lengths (two parts), at the feature extractor's rate."""
    import soundfile

    rate = model.hf_processor.feature_extractor.sampling_rate
    items = [wav_b64(1.3, rate, seed=31), wav_b64(2.6, rate, seed=32)]
    waves = [soundfile.read(io.BytesIO(base64.b64decode(item.split(",", 1)[1])), dtype="float32")[0]
             for item in items]
    return check_language_side(model, "audio", items, {"audio": waves, "sampling_rate": rate}, timestamps=False)


#: model_type -> how its tiny checkpoint folder is built: `(model_type, folder) -> folder`.
def _prompt_checkpoint(model_type: str, folder):
    from tests.support.checkpoints.prompts import build

    return build(model_type, folder)


LANGUAGE_CHECKPOINTS = {model_type: _prompt_checkpoint for model_type in (
    "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "qwen2_audio")}

#: (model_type, modality, check): one row of the table each.
LANGUAGE_CASES = [
    ("qwen2_vl", "image", qwen_vl_images), ("qwen2_vl", "video", qwen_vl_videos),
    ("qwen2_5_vl", "image", qwen_vl_images), ("qwen2_5_vl", "video", qwen_vl_videos),
    ("qwen3_vl", "image", qwen_vl_images), ("qwen3_vl", "video", qwen3_vl_videos),
    ("qwen3_vl_moe", "image", qwen_vl_images), ("qwen3_vl_moe", "video", qwen3_vl_videos),
    ("qwen3_5", "image", qwen_vl_images), ("qwen3_5", "video", qwen3_vl_videos),
    ("qwen3_5_moe", "image", qwen_vl_images), ("qwen3_5_moe", "video", qwen3_vl_videos),
    ("qwen2_audio", "audio", qwen2_audio_clips),
]


def language_side(model_types: list[str] | None = None) -> None:
    """Every case of LANGUAGE_CASES, one encoder per architecture."""
    import tempfile
    from pathlib import Path

    from encode_server.bench.launcher import ServerProcess
    from tests.support.checkpoints.prompts import ARCHITECTURES

    wanted = list(dict.fromkeys(model_type for model_type, _, _ in LANGUAGE_CASES))
    for model_type in (model_types or wanted):
        cases = [(modality, check) for kind, modality, check in LANGUAGE_CASES if kind == model_type]
        try:
            with tempfile.TemporaryDirectory(prefix=f"compat-{model_type}-") as root:
                folder = LANGUAGE_CHECKPOINTS[model_type](model_type, Path(root) / model_type)
                with ServerProcess("--model", str(folder), "--wire-format", "sglang") as server:
                    model = ServedModel(model_type, folder, server)
                    for modality, check in cases:
                        try:
                            record_language(check(model))
                        except Exception as exc:
                            record_language(LanguageRow(model.architecture, modality, False, detail=repr(exc)[:600]))
                            traceback.print_exc()
        except Exception as exc:
            traceback.print_exc()
            for modality, _ in cases:
                record_language(LanguageRow(ARCHITECTURES.get(model_type, model_type), modality, False,
                                            detail=f"could not set up: {exc!r}"[:600]))


def print_language_table() -> None:
    print("\n| architecture | modality | our rows | SGLang placeholders | input_ids = transformers' "
          "| timestamps in SGLang's prompt | our rows against the model's own features (max rel) | result |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in LANGUAGE_RESULTS:
        same = "-" if row.same_input_ids is None else ("yes" if row.same_input_ids else "NO")
        print(f"| {row.architecture} | {row.modality} | {row.rows if row.rows is not None else '-'} | "
              f"{row.placeholders if row.placeholders is not None else '-'} | {same} | {row.timestamps} | "
              f"{'-' if row.own is None else f'{row.own:.1e}'} | {'PASS' if row.ok else 'FAIL'} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-qwen2.5-vl")
    parser.add_argument("--only-omni", action="store_true", help="run only the Omni language-side checks")
    parser.add_argument("--families", nargs="*", default=list(AV_FAMILIES), choices=list(AV_FAMILIES),
                        help="image + video + audio families whose SGLang get_mm_data is checked (tiny checkpoints "
                             "built here; their SGLang processors need einops, and video files need av)")
    parser.add_argument("--only-families", action="store_true",
                        help="run only the image + video + audio families' checks (--families)")
    parser.add_argument("--architectures", nargs="+", metavar="MODEL_TYPE",
                        help="the Qwen-VL / Qwen2-Audio language-side step for these model types only "
                             f"(default: {' '.join(LANGUAGE_CHECKPOINTS)})")
    parser.add_argument("--language-side-only", action="store_true",
                        help="run only the Qwen-VL / Qwen2-Audio language-side step")
    args = parser.parse_args()
    quiet()
    if args.only_omni:
        omni_language_side()
        return print_results()
    if args.only_families:
        for family in args.families:
            av_family_checks(family)
        return report()
    import httpx
    import sglang

    from encode_server.bench.launcher import ServerProcess

    print(f"SGLang {sglang.__version__} from {os.path.dirname(sglang.__file__)}", flush=True)
    if args.language_side_only:
        language_side(args.architectures)
        return report()
    flags = ("--model", args.model, "--wire-format", "sglang", "--send-timeout-s", str(SEND_TIMEOUT_S))
    image_a, image_b = png_b64(56, 84, seed=1), png_b64(112, 56, seed=2)
    data_uri_b = "data:image/png;base64," + image_b
    with ServerProcess(*flags) as first, ServerProcess(*flags) as second:
        info = httpx.get(first.url + "/server_info").json()["settings"]
        record("our servers start with --wire-format sglang", info.get("wire_format") == "sglang",
               f"wire_format={info.get('wire_format')!r}, "
               f"sglang_embedding_class={info.get('sglang_embedding_class')!r}")
        both = reference(first.url, [image_a, data_uri_b])
        tokenizer_mode([first.url], [image_a, data_uri_b], both, "zmq_to_tokenizer: one encoder, two images")
        tokenizer_mode([first.url, second.url], [image_a, data_uri_b], both,
                       "zmq_to_tokenizer: two encoders, two parts merged in order")
        ranks = Ranks()
        try:
            scheduler_mode(ranks, [first.url], [image_a, data_uri_b], both,
                           "zmq_to_scheduler: 2 TP ranks (127.0.0.1 and [::1]), receive_count 2, one encoder")
            scheduler_mode(ranks, [first.url, second.url], [image_a, data_uri_b], both,
                           "zmq_to_scheduler: 2 TP ranks, two encoders, two parts merged in order")
            corrupt_image(ranks, first.url, image_a)
        finally:
            ranks.close()
        never_registered(first.url, image_a)
    registry_round_trip(flags)
    omni_language_side()
    for family in args.families:
        av_family_checks(family)
    with tempfile.TemporaryDirectory() as work:
        kimi_glm5_minimax_checks(work)
    language_side(args.architectures)
    return report()


def report() -> int:
    """The steps' table, the Qwen-VL / Qwen2-Audio language side's table, and the exit status (0: every row
    passed, or stopped inside SGLang on a defect of its own, `sglang_missing_attribute`)."""
    if RESULTS or SGLANG_SIDE:
        width = max(len(step) for step in [step for step, _, _ in RESULTS] + [step for step, _ in SGLANG_SIDE])
        print("\n| step | result |\n| --- | --- |")
        for step, ok, _ in RESULTS:
            print(f"| {step.ljust(width)} | {'PASS' if ok else 'FAIL'} |")
        for step, reason in SGLANG_SIDE:
            print(f"| {step.ljust(width)} | SGLang-side: {reason} |")
    if LANGUAGE_RESULTS:
        print_language_table()
    outcomes = [ok for _, ok, _ in RESULTS] + [row.ok for row in LANGUAGE_RESULTS]
    passed = sum(outcomes)
    print(f"\n{passed} passed, {len(outcomes) - passed} failed, {len(SGLANG_SIDE)} SGLang-side (SGLang's defect, "
          "not ours: the reasons are in the table)")
    return 0 if (outcomes or SGLANG_SIDE) and passed == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
