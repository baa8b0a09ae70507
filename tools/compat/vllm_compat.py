"""Drive this encoder as vLLM's encoder instance ("E") with vLLM's own, unchanged code, and print tables.

Runs in a side venv that `tools/compat/vllm_compat.sh [VERSION]` builds (vLLM 0.33.0 or 0.32.0 without its GPU
kernels, what its hasher, media loader, chat parsing, multimodal processors and ECExampleConnector import, and this
server's dependencies), from the repository root; the server is told the side venv's vLLM version
(`--ec-vllm-version`), as a deployment tells it its consumers':

    VLLM_TARGET_DEVICE=cpu .vllm-venv/bin/python tools/compat/vllm_compat.py [--families all|qwen2_5_vl,...]
    VLLM_TARGET_DEVICE=cpu .vllm-venv-0.32.0/bin/python tools/compat/vllm_compat.py --families qwen2_5_vl

For each family it builds a tiny full checkpoint folder (language model, full processor and a tiny
tokenizer, as the parity tests do; the recent families with the server's own `transformers`), starts
this server on it with `--ec-storage` (loopback only), and, for each modality the family serves (two
images, two MPEG-4 clips, a 16 kHz WAV and a 44.1 kHz stereo FLAC, each item in its own prompt), plays
vLLM's EPD roles against it:

- the proxy: one `POST /v1/chat/completions` per media item, the user's body with `max_tokens` 1 and
  `stream` false, header `x-request-id`, failing on any non-200 (`disagg_epd_proxy.py`'s fan-out);
- the consumer (`--model <folder>`, `--ec-transfer-config` ECExampleConnector/ec_consumer): vLLM's chat
  parsing (`parse_chat_messages`: its media connector fetches and decodes the items), its multimodal
  processor (`apply`: the items' `mm_hash` identifiers and placeholder ranges), a real `Request` built
  from them as the engine builds it, and the connector's scheduler side (`has_cache_item`,
  `update_state_after_alloc`, `build_connector_meta`) and worker side (`bind_connector_metadata`,
  `start_load_caches` into an encoder cache dict).

Every loaded tensor must have exactly the rows of vLLM's placeholder (`get_num_embeds`) and be
bit-identical to this server's native `/encode` rows for what vLLM decoded (an image's pixels as a
lossless PNG, a video's sampled frames as PNG frames, an audio clip's resampled waveform as a float
WAV); a video's rows must also equal, within 1e-5 relative, the model's own video features
(`transformers`' `get_video_features`, the whole model loaded from the folder) on what vLLM's processor
made of the item: the rows the language model receives in a monolithic vLLM. A modality this server
refuses in this mode (a 400 naming why) gets a row saying so. Qwen2.5-VL
also runs the scenarios: http images (from a loopback server), an EXIF-rotated JPEG, a
transparent PNG, an RGB PNG with a tRNS chunk (whose identifier differs between 0.32 and 0.33; a server told the
other version misses it), the consumer looking an item up before it is written (0.32 leaves an empty folder there),
a uuid part, the current example proxy's grouped request (an encoder's items in one request, with a uuid each
and without, `ec_transfer_params` matched back by `item_indices`), a corrupt image (4xx naming it, nothing
written), a repeated image and a file vLLM's own producer wrote (`save_caches`; no second encode), 16 concurrent
requests (while a reader opens every file that appears: never a partial one), and the storage bound (evictions,
oldest first). Not run by CI (the install is several GB).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import copy
import http.server
import io
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
import uuid
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RESULTS: list[tuple[str, bool, str]] = []
LAST_CHECK: dict[str, bool] = {}  # what the last check_round_trip found: identifiers, bits, counts
FAMILY_ROWS: list[tuple[str, str, str, str, str]] = []


def record(step: str, ok: bool, detail: str = "") -> bool:
    RESULTS.append((step, ok, detail))
    print(f"[{'PASS' if ok else 'FAIL'}] {step}" + (f": {detail}" if detail else ""), flush=True)
    return ok


def quiet() -> None:
    warnings.filterwarnings("ignore")
    import logging

    for name in ("vllm", "transformers", "httpx", "urllib3"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


# --- media ---------------------------------------------------------------------------------------


def random_png(width: int, height: int, seed: int, mode: str = "RGB", transparency: tuple | None = None) -> bytes:
    """Random pixels as a PNG; `transparency` (an RGB colour) writes a tRNS chunk into an RGB one."""
    import numpy as np
    from PIL import Image

    channels = {"RGB": 3, "RGBA": 4}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    if transparency is not None:
        pixels[: height // 2, : width // 2] = transparency  # a quarter of the image is the transparent colour
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode).save(buffer, "PNG", **({"transparency": transparency} if transparency else {}))
    return buffer.getvalue()


def rotated_jpeg(width: int, height: int, seed: int) -> bytes:
    """A JPEG stored sideways with EXIF orientation 6 (display rotated 90 degrees clockwise)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90, exif=exif.tobytes())
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(url: str, part_uuid: str | None = None) -> dict:
    part = {"type": "image_url", "image_url": {"url": url}}
    if part_uuid is not None:
        part["uuid"] = part_uuid
    return part


def chat_body(model: str, parts: list[dict]) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": [*parts, {"type": "text",
                                                                                "text": "describe this"}]}]}


class MediaServer:
    """Serves files from a dict on 127.0.0.1 (the http images both sides fetch)."""

    def __init__(self, files: dict[str, tuple[bytes, str]]) -> None:
        files_ = files

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                body, mime = files_.get(self.path, (None, None))
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", mime)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()


# --- the proxy -------------------------------------------------------------------------------------


async def proxy_fanout(e_url: str, body: dict, request_id: str) -> list[tuple[int, dict]]:
    """disagg_epd_proxy.py's encoder step: one request per media item (text removed), max_tokens 1, not
    streamed, header x-request-id; the proxy fails the whole request unless every answer is a 200."""
    import aiohttp

    items = [part for message in body["messages"] if isinstance(message.get("content"), list)
             for part in message["content"]
             if part.get("type") in ("image_url", "video_url", "audio_url", "input_audio")]

    async def one(session, item):
        request = copy.deepcopy(body)
        request["messages"] = [{"role": "user", "content": [item]}]
        request["max_tokens"] = 1
        request["stream"] = False
        request.pop("stream_options", None)
        async with session.post(f"{e_url}/v1/chat/completions", json=request,
                                headers={"x-request-id": request_id}) as response:
            return response.status, await response.json()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        return await asyncio.gather(*(one(session, item) for item in items))


def fanout(e_url: str, body: dict, request_id: str | None = None) -> list[tuple[int, dict]]:
    return asyncio.run(proxy_fanout(e_url, body, request_id or uuid.uuid4().hex))


# --- the consumer ----------------------------------------------------------------------------------


class Consumer:
    """A vLLM consumer's multimodal front and EC connector, for one model folder and one storage."""

    def __init__(self, folder: Path, storage: Path, algorithm: str = "blake3") -> None:
        from vllm.config import ECTransferConfig, ModelConfig, VllmConfig
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector
        from vllm.multimodal import MULTIMODAL_REGISTRY

        self.model = str(folder)
        self.model_config = ModelConfig(model=self.model, tokenizer=self.model, dtype="float32", max_model_len=4096,
                                        mm_hasher_algorithm=algorithm)
        self.processor = MULTIMODAL_REGISTRY.create_processor(self.model_config)
        transfer = ECTransferConfig(ec_connector="ECExampleConnector", ec_role="ec_consumer",
                                    ec_connector_extra_config={"shared_storage_path": str(storage)})
        from vllm.config import CacheConfig

        # Prefix caching on, as `vllm serve` has it by default (some hybrid models' configs need it).
        cache = {"cache_config": CacheConfig(enable_prefix_caching=True, mamba_block_size=4096)}  # max_model_len
        self.vllm_config = VllmConfig(model_config=self.model_config, ec_transfer_config=transfer, **cache)
        self.reference_model = None  # the whole model, loaded when a video is compared with its own features
        self.scheduler_side = ECExampleConnector(self.vllm_config, ECConnectorRole.SCHEDULER)
        self.worker_side = ECExampleConnector(self.vllm_config, ECConnectorRole.WORKER)
        self.producer_config = VllmConfig(model_config=self.model_config, **cache, ec_transfer_config=ECTransferConfig(
            ec_connector="ECExampleConnector", ec_role="ec_producer",
            ec_connector_extra_config={"shared_storage_path": str(storage)}))

    def parse(self, body: dict):
        """vLLM's chat parsing: the items as its media connector loads them, and the parts' uuids."""
        try:
            from vllm.renderers.chat_utils.chat_message import parse_chat_messages
        except ImportError:  # vLLM 0.32: one module
            from vllm.renderers.chat_utils import parse_chat_messages

        _conversation, mm_data, mm_uuids = parse_chat_messages(body["messages"], self.model_config, "string")
        return mm_data, mm_uuids

    def process(self, mm_data, mm_uuids):
        """vLLM's multimodal processor on those items: identifiers and placeholder ranges."""
        from vllm.multimodal.parse import parse_mm_uuids
        from vllm.multimodal.processing.context import TimingContext
        from vllm.multimodal.processing.inputs import ProcessorInputs

        counts = {modality: len(items) if isinstance(items, list) else 1 for modality, items in mm_data.items()}
        text = self.processor.dummy_inputs.get_dummy_text(counts)
        prompt = self.processor.info.get_tokenizer().encode(text)
        inputs = ProcessorInputs(prompt, self.processor.info.parse_mm_data(mm_data), parse_mm_uuids(mm_uuids))
        return self.processor.apply(inputs, TimingContext(enabled=False))

    def load(self, processed) -> tuple[list, dict]:
        """The connector's path: a Request as the engine builds it, has_cache_item and
        update_state_after_alloc per item, build_connector_meta, then the worker's start_load_caches."""
        from vllm import SamplingParams
        from vllm.multimodal.inputs import MultiModalFeatureSpec
        from vllm.v1.request import Request

        features = []
        for modality, hashes in processed["mm_hashes"].items():
            for index, mm_hash in enumerate(hashes):
                feature = MultiModalFeatureSpec(data=None, modality=modality, identifier=mm_hash,
                                                mm_position=processed["mm_placeholders"][modality][index],
                                                mm_hash=mm_hash)
                feature.item_index = index  # which item of its modality (for the reference rows)
                features.append(feature)
        features.sort(key=lambda feature: feature.mm_position.offset)
        request = Request(f"compat-{uuid.uuid4().hex[:8]}", processed["prompt_token_ids"],
                          SamplingParams(max_tokens=1), None, mm_features=features)
        for index, feature in enumerate(features):
            if self.scheduler_side.has_cache_item(feature.identifier):
                self.scheduler_side.update_state_after_alloc(request, index)
        meta = self.scheduler_side.build_connector_meta(None)  # ECExampleConnector does not read it
        self.worker_side.bind_connector_metadata(meta)
        encoder_cache: dict = {}
        self.worker_side.start_load_caches(encoder_cache)
        self.worker_side.clear_connector_metadata()
        return features, encoder_cache

    def decoded(self, mm_data: dict, modality: str, index: int):
        """What vLLM's consumer decoded for one item, as its processor gets it: a PIL image, a video's frames
        array, or (waveform, rate) after its data parser resampled it to the model's rate."""
        import numpy as np

        items = mm_data[modality] if isinstance(mm_data[modality], list) else [mm_data[modality]]
        if modality == "image":
            return getattr(items[index], "media", items[index])
        if modality == "video":
            frames = self.processor.info.parse_mm_data({"video": items})["video"].get(index)
            frames = frames[0] if isinstance(frames, tuple) else frames
            return np.asarray(getattr(frames, "media", frames))
        parser = self.processor.info.get_data_parser()
        samples = self.processor.info.parse_mm_data({"audio": items})["audio"].get(index)
        return np.asarray(samples), int(parser.audio_resampler.target_sr)

    def own_video_rows(self, processed, index: int):
        """The model's own video features (`transformers`, the whole model loaded from the folder) on what vLLM's
        processor made of video `index`: the rows its language model receives in a monolithic vLLM. None where the
        model has no `get_video_features(pixel_values_videos, video_grid_thw)`."""
        import torch

        from tools.reference.model_reference import own_features, whole_model

        data = processed["mm_kwargs"]["video"][index].get_data()
        if "pixel_values_videos" not in data or "video_grid_thw" not in data:
            return None
        if self.reference_model is None:
            self.reference_model = whole_model(self.model)
        pixels = data["pixel_values_videos"]
        if pixels.dtype == torch.uint8:  # vLLM 0.33 rescales and normalises on the device, in the model's forward
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.layers.fusion.mm_input_norm import build_mm_input_norm

            with set_current_vllm_config(self.vllm_config):
                pixels = build_mm_input_norm(self.model_config)(pixels, torch.float32)  # as the vision tower calls it
        return own_features(self.reference_model, "video", pixels, data["video_grid_thw"].reshape(-1, 3))

    def identifiers(self, body: dict) -> list[str]:
        mm_data, mm_uuids = self.parse(body)
        return [h for hashes in self.process(mm_data, mm_uuids)["mm_hashes"].values() for h in hashes]

    def vllm_producer_save(self, identifier: str, rows) -> None:
        """vLLM's own producer writing an item (ECExampleConnector.save_caches, ec_producer role)."""
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

        ECExampleConnector(self.producer_config, ECConnectorRole.WORKER).save_caches({identifier: rows}, identifier)


# --- our side --------------------------------------------------------------------------------------


def png_b64(image) -> str:
    """The pixels vLLM decoded as a PNG without a tRNS chunk: its consumers' processors read RGB pixels as they are
    (vLLM 0.32 keeps an RGB image with a tRNS chunk, which a newer `convert_to_rgb` would composite)."""
    image = image.convert("RGB")
    image.info.pop("transparency", None)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def native_rows(url: str, image, modality: str = "image") -> object:
    """This server's native /encode rows for what vLLM decoded: a PIL image (sent as a lossless PNG), a video's
    frames array (`{"frames": [PNG, ...]}`) or a waveform at the model's rate (a 32-bit float WAV)."""
    import httpx
    import numpy as np
    import soundfile
    import torch
    from PIL import Image

    if modality == "video":
        item = {"frames": [png_b64(Image.fromarray(frame)) for frame in image]}
    elif modality == "audio":
        samples, rate = image
        buffer = io.BytesIO()
        soundfile.write(buffer, np.asarray(samples, dtype=np.float32), rate, format="WAV", subtype="FLOAT")
        item = base64.b64encode(buffer.getvalue()).decode()
    else:
        item = png_b64(image)
    response = httpx.post(f"{url}/encode", json={"req_id": f"ref-{uuid.uuid4().hex[:8]}", "modality": modality,
                                                 "mm_items": [item], "return_embedding": True}, timeout=300).json()
    if "embedding" not in response:
        raise RuntimeError(f"native /encode refused vLLM's {modality}: {response}")
    dtype = {"float32": np.float32, "float16": np.float16}.get(response["dtype"])
    raw = base64.b64decode(response["embedding"])
    if response["dtype"] == "bfloat16":
        return torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).reshape(response["embedding_shape"])
    return torch.from_numpy(np.frombuffer(raw, dtype=dtype).reshape(response["embedding_shape"]).copy())


def metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


#: The interpreter the server runs in (`--server-python`): by default the project's own environment, as a
#: deployment runs it beside vLLM (whose transformers pin may be older than the project's).
SERVER_PYTHON: list[str] = []


def start_server(folder: Path, storage: Path, *extra: str, version: str | None = None):
    """This server on `folder` with `--ec-storage`, told the consumers run this side venv's vLLM (or `version`)."""
    import vllm

    from tests.support.helpers import ServerProcess

    return ServerProcess("--model", str(folder), "--ec-storage", str(storage), "--allow-private-urls", "true",
                         "--cache-bytes", "0", "--ec-vllm-version", version or vllm.__version__, *extra,
                         startup_timeout=300, python=SERVER_PYTHON[0])


def check_round_trip(consumer: Consumer, server_url: str, body: dict, step: str,
                     expect_ids: list[str] | None = None) -> tuple[bool, list[int], list[int]]:
    """Proxy fan-out, then vLLM's consumer loads every item; rows equal to our native rows bit for bit.
    Returns (ok, vLLM's placeholder counts, our row counts)."""
    import torch

    from tests.support.helpers import rel_diff

    answers = fanout(server_url, body)
    if not all(status == 200 and answer.get("object") == "chat.completion" for status, answer in answers):
        record(step, False, f"encoder answers {[(s, str(a)[:200]) for s, a in answers]}")
        return False, [], []
    mm_data, mm_uuids = consumer.parse(body)
    processed = consumer.process(mm_data, mm_uuids)
    features, loaded = consumer.load(processed)
    placeholder_counts = [feature.mm_position.get_num_embeds() for feature in features]
    ours, problems, own_diffs = [], [], []
    bits_ok = counts_ok = bool(features)
    for feature in features:
        tensor = loaded.get(feature.identifier)
        if tensor is None:
            problems.append(f"{feature.identifier[:16]} not loaded (has_cache_item false)")
            continue
        ours.append(int(tensor.shape[0]))
        reference = native_rows(server_url, consumer.decoded(mm_data, feature.modality, feature.item_index),
                                feature.modality)
        if tensor.shape[0] != feature.mm_position.get_num_embeds():
            counts_ok = False
            problems.append(f"{tensor.shape[0]} rows for {feature.mm_position.get_num_embeds()} placeholders")
        if tensor.dtype != reference.dtype or not torch.equal(tensor, reference):
            bits_ok = False
            problems.append(f"rows differ from native /encode ({tensor.dtype} {tuple(tensor.shape)} vs "
                            f"{reference.dtype} {tuple(reference.shape)})")
        if feature.modality == "video":
            own = consumer.own_video_rows(processed, feature.item_index)
            if own is not None:
                difference = rel_diff(tensor.float(), own.float()) if own.shape == tensor.shape else float("inf")
                own_diffs.append(difference)
                if difference > 1e-5:
                    problems.append(f"video rows differ from the model's own features on vLLM's processor output "
                                    f"(rel {difference:.2e}, shapes {tuple(tensor.shape)} vs {tuple(own.shape)})")
    if expect_ids is not None and [f.identifier for f in features] != expect_ids:
        problems.append(f"identifiers {[f.identifier for f in features]} != {expect_ids}")
    stored = [item["identifier"] for _, answer in answers for item in answer["encoder_cache"]]
    ids_ok = sorted(stored) == sorted(f.identifier for f in features)
    if not ids_ok:
        problems.append(f"our identifiers {stored} != vLLM's {[f.identifier for f in features]}")
    LAST_CHECK.update(ids=ids_ok, bits=bits_ok and len(ours) == len(features), counts=counts_ok,
                      own=max(own_diffs) if own_diffs else None)
    ok = record(step, not problems, "; ".join(problems) or f"{len(features)} items, rows {placeholder_counts}, "
                                                          f"identifiers {[f.identifier[:12] for f in features]}")
    return ok, placeholder_counts, ours


# --- the families ----------------------------------------------------------------------------------


def build_qwen_family(name: str, folder: Path) -> Path:
    from tests.support.checkpoints.qwen_vl import qwen2_vl_checkpoint, qwen25_vl_checkpoint
    from tools.reference.reference_prefill_counts import PROCESSOR_FILES, qwen_full_processor

    build, processor_class, video = {
        "qwen2_5_vl": (qwen25_vl_checkpoint, "Qwen2_5_VLProcessor", {"min_pixels": 28 * 28 * 8,
                                                                      "max_pixels": 28 * 28 * 48}),
        "qwen2_vl": (qwen2_vl_checkpoint, "Qwen2VLProcessor", {"min_pixels": 28 * 28 * 2,
                                                               "max_pixels": 28 * 28 * 256}),
    }[name]
    _model, image_processor, folder = build(folder)
    for file in PROCESSOR_FILES:
        (folder / file).unlink(missing_ok=True)
    qwen_full_processor(processor_class, image_processor, video).save_pretrained(folder)
    return folder


def build_internvl(folder: Path) -> Path:
    from tests.support.checkpoints.internvl import internvl_checkpoint
    from tools.reference.reference_prefill_counts import PROCESSOR_FILES, internvl_full_processor

    model, image_processor, folder = internvl_checkpoint(folder)
    for file in PROCESSOR_FILES:
        (folder / file).unlink(missing_ok=True)
    internvl_full_processor(model, image_processor).save_pretrained(folder)
    return folder


def build_grid_family(model_type: str, folder: Path) -> Path:
    from transformers import AutoTokenizer

    from tests.support.checkpoints.grid_vision import build_model, write_processor_files

    build_model(model_type, 5).save_pretrained(folder)
    folder = write_processor_files(folder, model_type, "nested")
    if model_type == "glm4v":
        # vLLM builds GLM-4V's prompt from the config's token ids: point them at the tiny tokenizer's tokens.
        tokenizer = AutoTokenizer.from_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
        for key, token in (("image_token_id", "<|image|>"), ("video_token_id", "<|video|>"),
                           ("image_start_token_id", "<|begin_of_image|>"), ("image_end_token_id", "<|end_of_image|>"),
                           ("video_start_token_id", "<|begin_of_video|>"), ("video_end_token_id", "<|end_of_video|>")):
            config[key] = tokenizer.convert_tokens_to_ids(token)
        (folder / "config.json").write_text(json.dumps(config))
        spell_out_normalisation(folder)
    if model_type == "qwen3_vl":
        # vLLM finds Qwen3-VL's video placeholders by the config's token ids: point them at the tiny tokenizer's.
        tokenizer = AutoTokenizer.from_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
        for key, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                           ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")):
            config[key] = tokenizer.convert_tokens_to_ids(token)
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def spell_out_normalisation(folder: Path) -> None:
    """Write the image processor's rescale and normalisation settings into processor_config.json, as published
    checkpoints have them. A folder saved by `transformers` 5 leaves out settings equal to the class defaults, and
    vLLM 0.33's device-side normalisation (`mm_input_norm._load_norm_params`) reads only keys present in the files:
    without them it feeds GLM-4V's tower raw 0-255 pixels."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(folder)
    config = json.loads((folder / "processor_config.json").read_text())
    config["image_processor"].update(do_rescale=processor.do_rescale, rescale_factor=processor.rescale_factor,
                                     do_normalize=processor.do_normalize, image_mean=list(processor.image_mean),
                                     image_std=list(processor.image_std))
    (folder / "processor_config.json").write_text(json.dumps(config))


def build_other(name: str, folder: Path) -> Path:
    from tests.support.checkpoints.gemma3 import gemma3_checkpoint
    from tests.support.checkpoints.llava_onevision import llava_onevision_checkpoint
    from tests.support.checkpoints.mistral3 import mistral3_checkpoint

    folder.mkdir(parents=True, exist_ok=True)
    if name == "gemma3":
        from transformers import AutoTokenizer

        gemma3_checkpoint(folder)
        # vLLM's Gemma 3 processor looks up the newline runs Gemma's real tokenizer has as single tokens.
        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.add_tokens(["\n", "\n\n", "\n\n\n", "\n\n\n\n"])
        tokenizer.save_pretrained(folder)
    elif name == "llava_onevision":
        # vLLM 0.33 packs (and counts) LLaVA-OneVision rows with anyres_max_9 whatever the checkpoint says,
        # as every released checkpoint says; the fixture's anyres_max_2 is set to that (the producer refuses
        # other values at start-up: see fronts.vllm.producer.check_vllm_layout).
        llava_onevision_checkpoint(folder)
        for file in ("config.json", "processor_config.json"):
            settings = json.loads((folder / file).read_text())
            settings["vision_aspect_ratio"] = "anyres_max_9"
            (folder / file).write_text(json.dumps(settings))
    elif name == "mistral3":
        mistral3_checkpoint(folder)
    return folder


def build_qwen2_audio(folder: Path) -> Path:
    from tests.support.checkpoints.qwen2_audio import qwen2_audio_checkpoint, qwen2_audio_full_processor

    _model, extractor, folder = qwen2_audio_checkpoint(folder)
    qwen2_audio_full_processor(extractor).save_pretrained(folder)
    return folder


def in_server_python(function: str, *args: str) -> Path:
    """Run one of this module's checkpoint builders in the server's interpreter: the recent families' tiny
    checkpoints are built with the project's `transformers` (newer than the one vLLM 0.33 pins); vLLM then
    reads the saved folder with its own."""
    import subprocess

    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from pathlib import Path; "
            f"from tools.compat.vllm_compat import {function}; print({function}(*{args!r}[:-1], Path({args[-1]!r})))")
    done = subprocess.run([SERVER_PYTHON[0], "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"building the checkpoint failed: {done.stderr[-600:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def build_omni(model_type: str, folder: Path) -> Path:
    from tests.support.checkpoints.qwen_omni import checkpoint

    _model, folders = checkpoint(folder, model_type, 7, layouts=("flat",))
    return folders["flat"]


def build_new_family(name: str, folder: Path) -> Path:
    from tests.support.checkpoints.dots3_note import dots3_note_checkpoint
    from tests.support.checkpoints.glm5_next import glm5_next_checkpoint
    from tests.support.checkpoints.kimi_k25 import kimi_k25_checkpoint
    from tests.support.checkpoints.minimax_m3_vl import minimax_m3_vl_checkpoint
    from tests.support.checkpoints.muse_spark import muse_spark_checkpoint

    builder = {"kimi_k25": kimi_k25_checkpoint, "glm5_next": glm5_next_checkpoint,
               "minimax_m3_vl": minimax_m3_vl_checkpoint, "muse_spark": muse_spark_checkpoint,
               "dots3_note": dots3_note_checkpoint}[name]
    folder.mkdir(parents=True, exist_ok=True)
    _model, folder = builder(folder)
    if name == "muse_spark":  # vLLM's MuseSparkTextConfig reads a field the tiny config leaves at its default
        config = json.loads((folder / "config.json").read_text())
        config.setdefault("text_config", {}).setdefault("num_shared_experts", 0)
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def consumer_folder(name: str, folder: Path) -> Path:
    """The folder the vLLM consumer is started on: the checkpoint itself, except for Dots3-Note, whose vLLM config
    class is a flat DeepSeek-V3 config: a copy with the text fields at the top level and no `text_config` (the
    weights and processor files are the same), naming the architecture vLLM registers for Dots3-Note
    (`Dots3NoteForCausalLM`, where transformers saves its own class name). The text config's empty
    `per_layer_config`, which this server's newer transformers writes for every layer stack, is left out of that
    copy: the side venv's older transformers takes any `per_layer_config`, even an empty one, for a heterogeneous
    model, which vLLM refuses for MLA."""
    if name != "dots3_note":
        return folder
    copy = folder.with_name(folder.name + "-vllm")
    shutil.copytree(folder, copy, dirs_exist_ok=True)
    config = json.loads((copy / "config.json").read_text())
    config.update({key: value for key, value in config.pop("text_config", {}).items()
                   if key not in ("model_type", "architectures") and not (key == "per_layer_config" and not value)})
    config["architectures"] = ["Dots3NoteForCausalLM"]
    (copy / "config.json").write_text(json.dumps(config))
    return copy


#: family -> (how to build its tiny full checkpoint, the modalities it serves)
FAMILIES = {
    "qwen2_5_vl": (lambda folder: build_qwen_family("qwen2_5_vl", folder), ("image", "video")),
    "qwen2_vl": (lambda folder: build_qwen_family("qwen2_vl", folder), ("image", "video")),
    "qwen3_vl": (lambda folder: build_grid_family("qwen3_vl", folder), ("image", "video")),
    "glm4v": (lambda folder: build_grid_family("glm4v", folder), ("image", "video")),
    "internvl": (build_internvl, ("image",)),
    "gemma3": (lambda folder: build_other("gemma3", folder), ("image",)),
    "llava_onevision": (lambda folder: build_other("llava_onevision", folder), ("image",)),
    "mistral3": (lambda folder: build_other("mistral3", folder), ("image",)),
    "qwen2_audio": (build_qwen2_audio, ("audio",)),
    "qwen2_5_omni": (lambda folder: in_server_python("build_omni", "qwen2_5_omni", str(folder)),
                     ("image", "video", "audio")),
    "qwen3_omni_moe": (lambda folder: in_server_python("build_omni", "qwen3_omni_moe", str(folder)),
                       ("image", "video", "audio")),
    **{name: (lambda folder, name=name: in_server_python("build_new_family", name, str(folder)), modalities)
       for name, modalities in (("kimi_k25", ("image", "video")), ("glm5_next", ("image", "video")),
                                ("minimax_m3_vl", ("image", "video")), ("muse_spark", ("image", "video", "audio")),
                                ("dots3_note", ("image", "video", "audio")))},
}
#: Families we serve that no vLLM model class is fixed for.
NOT_APPLICABLE = {"generic": "any model transformers can count; no vLLM model class is fixed for it"}


def make_clip(width: int, height: int, frames: int, fps: int, seed: int) -> bytes:
    """A small MPEG-4 clip of noisy frames (PyAV), as a user might send one."""
    import av
    import numpy as np

    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(frames):
            pixels = np.clip(np.full((height, width, 3), 25 * index % 256) + rng.integers(0, 80, (height, width, 3)),
                             0, 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def make_audio(rate: int, channels: int, seconds: float, fmt: str, seed: int) -> bytes:
    import numpy as np
    import soundfile

    rng = np.random.default_rng(seed)
    t = np.arange(int(rate * seconds)) / rate
    wave = np.stack([0.3 * np.sin(2 * np.pi * (200 + 150 * c) * t) + 0.05 * rng.standard_normal(t.size)
                     for c in range(channels)], axis=1).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, wave, rate, format=fmt, subtype="PCM_16")
    return buffer.getvalue()


def modality_parts(modality: str) -> tuple[list[dict], str]:
    """Two items of the modality as a user's chat parts, and what they are (for the table)."""
    if modality == "image":
        return [image_part(data_url(random_png(90, 60, 11))), image_part(data_url(random_png(41, 130, 12)))], \
            "images 90x60 and 41x130"
    if modality == "video":
        return [{"type": "video_url", "video_url": {"url": data_url(make_clip(64, 48, 12, 6, 13), "video/mp4")}},
                {"type": "video_url", "video_url": {"url": data_url(make_clip(40, 56, 30, 10, 14), "video/mp4")}}], \
            "MPEG-4 clips 64x48 (12 frames at 6 fps) and 40x56 (30 at 10)"
    return [{"type": "input_audio", "input_audio": {"data": base64.b64encode(
                make_audio(16000, 1, 1.0, "WAV", 15)).decode(), "format": "wav"}},
            {"type": "audio_url", "audio_url": {"url": data_url(make_audio(44100, 2, 0.7, "FLAC", 16),
                                                                "audio/flac")}}], \
        "a 16 kHz mono WAV (1 s) and a 44.1 kHz stereo FLAC (0.7 s)"


def family_check(name: str, work: Path) -> None:
    """Two items of each modality the family serves through proxy, server and consumer; one table row each."""
    build, modalities = FAMILIES[name]
    folder = work / name
    storage = work / f"ec-{name}"
    try:
        folder = build(folder)
        consumer = Consumer(consumer_folder(name, folder), storage)
    except Exception as exc:
        traceback.print_exc()
        record(f"{name}: vLLM consumer set-up", False, f"{type(exc).__name__}: {str(exc)[:300]}")
        for modality in modalities:
            FAMILY_ROWS.append((name, modality, "-", "-", "-", "-", "-", "-",
                                f"vLLM could not set up its consumer: {type(exc).__name__}: {str(exc)[:160]}"))
        return
    try:
        with start_server(folder, storage, "--ec-model-id", consumer.model) as server:
            for modality in modalities:
                parts, _what = modality_parts(modality)
                theirs, ours, flags, failures, refusal = [], [], {"ids": True, "bits": True}, [], None
                own = []
                for index, part in enumerate(parts):  # one item per prompt (some models take one video)
                    body = chat_body(consumer.model, [part])
                    step = f"{name} {modality} item {index}: proxy, store, consumer load"
                    try:
                        answers = fanout(server.url, body)
                        refused = [answer.get("error", {}).get("message", "") for status, answer in answers
                                   if status != 200]
                        if refused:
                            refusal = refused[0]
                            record(step, 400 <= answers[0][0] < 500 and f"{modality}" in refusal,
                                   f"refused: {refusal[:300]}")
                            break
                        LAST_CHECK.clear()
                        ok, item_theirs, item_ours = check_round_trip(consumer, server.url, body, step)
                        theirs += item_theirs
                        ours += item_ours
                        for key in flags:
                            flags[key] = flags[key] and LAST_CHECK.get(key, False)
                        if LAST_CHECK.get("own") is not None:
                            own.append(LAST_CHECK["own"])
                        if not ok:
                            failures.append(RESULTS[-1][2])
                    except Exception as exc:
                        traceback.print_exc()
                        record(step, False, f"{type(exc).__name__}: {str(exc)[:300]}")
                        failures.append(f"{type(exc).__name__}: {str(exc)[:200]}")
                        flags = {"ids": None, "bits": None}
                yes = {True: "yes", False: "no", None: "-"}
                if refusal is not None:
                    FAMILY_ROWS.append((name, modality, type(consumer.processor).__name__, "-", "-", "-", "-", "-",
                                        f"refused with a 400: {refusal[:220]}"))
                    continue
                FAMILY_ROWS.append((name, modality, type(consumer.processor).__name__, str(theirs), str(ours),
                                    yes[flags["ids"]], yes[flags["bits"]],
                                    f"{max(own):.1e}" if own else "-",
                                    "agrees" if not failures else f"differs: {failures[0][:200]}"))
    except Exception as exc:
        traceback.print_exc()
        record(f"{name}: server", False, f"{type(exc).__name__}: {str(exc)[:300]}")


# --- the Qwen2.5-VL scenarios ----------------------------------------------------------------------


def storage_files(storage: Path) -> list[str]:
    return sorted(str(path.relative_to(storage)) for path in storage.rglob("*") if path.is_file())


def scenarios(work: Path) -> None:
    import httpx
    import torch

    folder = build_qwen_family("qwen2_5_vl", work / "scenarios-qwen2_5_vl")
    storage = work / "ec-scenarios"
    consumer = Consumer(folder, storage)
    model = consumer.model
    media = MediaServer({"/cat.png": (random_png(120, 80, 21), "image/png"),
                         "/rotated.jpg": (rotated_jpeg(96, 40, 22), "image/jpeg")})
    try:
        with start_server(folder, storage) as server:
            url = server.url
            check_round_trip(consumer, url, chat_body(model, [image_part(f"{media.url}/cat.png")]),
                             "http image from a loopback server")
            check_round_trip(consumer, url, chat_body(model, [image_part(data_url(rotated_jpeg(96, 40, 23),
                                                                                  "image/jpeg"))]),
                             "EXIF-rotated JPEG (data: URL)")
            check_round_trip(consumer, url, chat_body(model, [image_part(f"{media.url}/rotated.jpg")]),
                             "EXIF-rotated JPEG (http)")
            check_round_trip(consumer, url, chat_body(model, [image_part(data_url(random_png(70, 50, 24, "RGBA")))]),
                             "transparent PNG (composited on white, io_config in the hash)")
            trns = random_png(66, 54, 28, transparency=(10, 20, 30))
            check_round_trip(consumer, url, chat_body(model, [image_part(data_url(trns))]),
                             "RGB PNG with a tRNS chunk (0.32: kept as it is; 0.33: composited on white)")
            check_round_trip(consumer, url, chat_body(model, [image_part(data_url(random_png(60, 60, 25)),
                                                                         "compat-item-1")]),
                             "uuid part (identifier is the uuid)", expect_ids=["compat-item-1"])
            looked_up_first(consumer, url, storage, model)
            grouped(consumer, url, model)

            # A corrupt image: our 4xx names it, nothing is written; vLLM's own parsing refuses it too.
            before = storage_files(storage)
            bad = chat_body(model, [image_part(data_url(b"\x89PNG broken"))])
            answers = fanout(url, bad)
            status, answer = answers[0]
            message = answer.get("error", {}).get("message", "")
            try:
                consumer.parse(bad)
                vllm_refused = "vLLM parsed it"
            except Exception as exc:
                vllm_refused = f"vLLM refuses it too ({type(exc).__name__})"
            record("corrupt image: 4xx naming the part, nothing written",
                   400 <= status < 500 and "messages[0].content[0]" in message and storage_files(storage) == before,
                   f"{status} {message!r}; {vllm_refused}")

            # A repeated image is a hit: no second encode, no second write.
            repeated = chat_body(model, [image_part(data_url(random_png(64, 64, 26)))])
            check_round_trip(consumer, url, repeated, "first sending of an image")
            writes, hits = metric(url, "encoder_ec_storage_writes_total"), metric(url, "encoder_ec_storage_hits_total")
            forwards = metric(url, "encoder_batch_size_count")
            answers = fanout(url, repeated)
            record("repeated image: a hit, not encoded again",
                   answers[0][0] == 200 and answers[0][1]["encoder_cache"][0]["hit"]
                   and metric(url, "encoder_ec_storage_writes_total") == writes
                   and metric(url, "encoder_ec_storage_hits_total") == hits + 1
                   and metric(url, "encoder_batch_size_count") == forwards,
                   f"writes {writes:g} -> {metric(url, 'encoder_ec_storage_writes_total'):g}, hits {hits:g} -> "
                   f"{metric(url, 'encoder_ec_storage_hits_total'):g}")

            # A file vLLM's own producer wrote (save_caches) is a hit too, and the consumer loads it.
            theirs = chat_body(model, [image_part(data_url(random_png(50, 70, 27)))])
            identifier = consumer.identifiers(theirs)[0]
            mm_data, _ = consumer.parse(theirs)
            rows = native_rows(url, mm_data["image"][0].media)
            consumer.vllm_producer_save(identifier, rows)
            writes = metric(url, "encoder_ec_storage_writes_total")
            answers = fanout(url, theirs)
            _, loaded = consumer.load(consumer.process(*consumer.parse(theirs)))
            record("a file vLLM's own producer wrote: a hit, not encoded again",
                   answers[0][0] == 200 and answers[0][1]["encoder_cache"][0]["hit"]
                   and metric(url, "encoder_ec_storage_writes_total") == writes
                   and identifier in loaded and torch.equal(loaded[identifier], rows),
                   f"identifier {identifier[:16]}")

            concurrent(consumer, url, storage, model)
            record("no temporary file left in the storage", not any(".tmp" in name for name in storage_files(storage)),
                   f"{len(storage_files(storage))} files")
            print(httpx.get(f"{url}/metrics").text.count("encoder_ec_storage"), "EC storage series exported")
        other_version(consumer, folder, work)
        bounded(consumer, folder, work)
    finally:
        media.close()


def looked_up_first(consumer: Consumer, url: str, storage: Path, model: str) -> None:
    """The consumer looks an item up before it is written (vLLM 0.32's lookup leaves an empty folder at its
    identifier); our write then goes into that folder, and the consumer loads the item."""
    body = chat_body(model, [image_part(data_url(random_png(58, 62, 29)))])
    features, loaded = consumer.load(consumer.process(*consumer.parse(body)))
    identifier = features[0].identifier
    leftover = (storage / identifier).is_dir() and not any((storage / identifier).iterdir())
    check_round_trip(consumer, url, body, "an item the consumer looked up first (a miss"
                     + (", which left an empty folder)" if leftover else ")"))


def grouped(consumer: Consumer, url: str, model: str) -> None:
    """The current example proxy's encoder request: an encoder's images grouped into one request (no max_tokens),
    with a uuid each (sha256 of the URL, as its `content_uuid`) or without; its `ec_transfer_params` matched back
    per position by `item_indices`, and every item loaded by the consumer."""
    import hashlib

    import httpx

    for with_uuids in (True, False):
        images = [data_url(random_png(44 + 6 * i, 52, 40 + i + 10 * with_uuids)) for i in range(3)]
        parts = [image_part(images[i], hashlib.sha256(images[i].encode()).hexdigest() if with_uuids else None)
                 for i in range(3)] + [image_part(images[0], hashlib.sha256(images[0].encode()).hexdigest()
                                                  if with_uuids else None)]  # an item twice
        request = {"model": model, "messages": [{"role": "user", "content": parts}], "stream": False}
        response = httpx.post(f"{url}/v1/chat/completions", json=request,
                              headers={"x-request-id": f"grouped-{uuid.uuid4().hex[:6]}"}, timeout=300)
        step = f"grouped encoder request ({'a uuid per item' if with_uuids else 'no uuids'})"
        if response.status_code != 200:
            record(step, False, f"{response.status_code} {response.text[:200]}")
            continue
        params = response.json().get("ec_transfer_params") or {}
        by_index = {index: mm_hash for mm_hash, entry in params.items() for index in entry.get("item_indices", [])}
        body = chat_body(model, parts)
        expected = [f.identifier for f in sorted(consumer.load(consumer.process(*consumer.parse(body)))[0],
                                                 key=lambda feature: feature.mm_position.offset)]
        matched = [by_index.get(index) for index in range(len(parts))]
        if matched != expected:
            record(step, False, f"item_indices map {matched} != vLLM's identifiers {expected}")
            continue
        named = "named" if all("modality" in entry for entry in params.values()) else "not named"
        check_round_trip(consumer, url, body, f"{step}: item_indices match, modality {named}", expect_ids=expected)


def other_version(consumer: Consumer, folder: Path, work: Path) -> None:
    """A negative control of the one setting: a server told the other minor version identifies an RGB PNG with a
    tRNS chunk otherwise, and the consumer misses it."""
    import vllm

    other = "0.32.0" if vllm.__version__.startswith("0.33") else "0.33.0"
    storage = work / "ec-other-version"
    body = chat_body(consumer.model, [image_part(data_url(random_png(66, 54, 31, transparency=(10, 20, 30))))])
    with start_server(folder, storage, version=other) as server:
        answers = fanout(server.url, body)
    features, loaded = consumer.load(consumer.process(*consumer.parse(body)))
    ours = answers[0][1]["encoder_cache"][0]["identifier"] if answers[0][0] == 200 else None
    record(f"negative control: a server told vLLM {other} names a tRNS PNG otherwise, and this consumer misses it",
           ours is not None and ours != features[0].identifier and not loaded,
           f"ours {str(ours)[:12]}, vLLM's {features[0].identifier[:12]}, loaded {len(loaded)}")


def concurrent(consumer: Consumer, url: str, storage: Path, model: str) -> None:
    """16 requests at once (distinct images) while a reader opens every file as soon as it appears."""
    from safetensors.torch import load_file

    from tests.support.helpers import rel_diff

    stop = threading.Event()
    seen, broken = set(), []

    def reader():
        while not stop.is_set():
            for path in storage.glob("*/encoder_cache.safetensors"):
                if path in seen:
                    continue
                try:
                    load_file(str(path))["ec_cache"]
                    seen.add(path)
                except FileNotFoundError:
                    pass
                except Exception as exc:
                    broken.append(f"{path.parent.name[:12]}: {exc}")
                    seen.add(path)
            time.sleep(0.001)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    bodies = [chat_body(model, [image_part(data_url(random_png(40 + 7 * i, 90 - 3 * i, 100 + i)))]) for i in range(16)]
    batches_before = metric(url, "encoder_batch_size_count"), metric(url, "encoder_batch_size_sum")

    async def all_at_once():
        return await asyncio.gather(*(proxy_fanout(url, body, f"conc-{i}") for i, body in enumerate(bodies)))

    started = time.perf_counter()
    answers = asyncio.run(all_at_once())
    elapsed = time.perf_counter() - started
    stop.set()
    thread.join()
    batches = metric(url, "encoder_batch_size_count") - batches_before[0]
    items = metric(url, "encoder_batch_size_sum") - batches_before[1]
    ok_answers = all(status == 200 for answer in answers for status, _ in answer)
    record("16 concurrent requests answered 200", ok_answers,
           f"{elapsed:.2f} s, {items:g} requests in {batches:g} forwards (mean batch {items / max(batches, 1):.1f})")
    record("atomic writes: every file a reader saw was whole", not broken, "; ".join(broken[:3]) or
           f"{len(seen)} files opened as they appeared")
    failures = []
    for index, body in enumerate(bodies):
        mm_data, mm_uuids = consumer.parse(body)
        features, loaded = consumer.load(consumer.process(mm_data, mm_uuids))
        reference = native_rows(url, mm_data["image"][0].media)
        rows = loaded.get(features[0].identifier)
        # Rows from a fused forward equal the item's lone rows up to float32 rounding (the matrix multiplies
        # block their sums by the batch's row count); a neighbour's rows would differ in shape or entirely.
        if rows is None or rows.shape != reference.shape or rel_diff(rows, reference) > 1e-5:
            failures.append(index)
    record("16 concurrent requests: vLLM loads each item's own rows", not failures, f"failed: {failures}" if failures
           else "16 of 16 equal to the item's lone rows within 1e-5")


def bounded(consumer: Consumer, folder: Path, work: Path) -> None:
    """A small bound with no minimum age: the oldest items go, the newest stay, the metrics count them."""
    storage = work / "ec-bounded"
    images = [random_png(56, 56, 200 + i) for i in range(6)]
    with start_server(folder, storage, "--ec-storage-bytes", "0", "--ec-storage-min-age-s", "0") as server:
        fanout(server.url, chat_body(consumer.model, [image_part(data_url(images[0]))]))
        size = metric(server.url, "encoder_ec_storage_bytes")
    bound = int(size * 3.5)
    shutil.rmtree(storage)
    with start_server(folder, storage, "--ec-storage-bytes", str(bound), "--ec-storage-min-age-s", "0") as server:
        ids = []
        for image in images:
            body = chat_body(consumer.model, [image_part(data_url(image))])
            status, answer = fanout(server.url, body)[0]
            ids.append(answer["encoder_cache"][0]["identifier"])
            time.sleep(0.02)
        held = metric(server.url, "encoder_ec_storage_bytes")
        evictions = metric(server.url, "encoder_ec_storage_evictions_total")
    present = [identifier for identifier in ids if (storage / identifier / "encoder_cache.safetensors").exists()]
    record("storage bound: within --ec-storage-bytes, oldest evicted first",
           bool(present) and held <= bound and evictions == len(ids) - len(present) and present == ids[-len(present):],
           f"bound {bound} B, held {held:g} B, {evictions:g} evictions, kept the newest {len(present)} of {len(ids)}")
    shutil.rmtree(storage)
    with start_server(folder, storage, "--ec-storage-bytes", str(bound), "--ec-storage-min-age-s", "600") as server:
        for image in images:
            fanout(server.url, chat_body(consumer.model, [image_part(data_url(image))]))
        evictions = metric(server.url, "encoder_ec_storage_evictions_total")
        files = metric(server.url, "encoder_ec_storage_files")
    record("storage bound: nothing younger than --ec-storage-min-age-s is evicted", evictions == 0 and files == 6,
           f"{files:g} files, {evictions:g} evictions over a bound of {bound} B")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="all", help="comma-separated families, or all")
    parser.add_argument("--no-scenarios", action="store_true", help="only the per-family table")
    default_python = ROOT / ".venv" / "bin" / "python"
    parser.add_argument("--server-python", default=str(default_python) if default_python.exists() else sys.executable,
                        help="the interpreter that runs the server (default: the project's .venv, else this one)")
    args = parser.parse_args()
    SERVER_PYTHON.append(args.server_python)
    quiet()
    import vllm

    names = list(FAMILIES) if args.families == "all" else args.families.split(",")
    work = Path(tempfile.mkdtemp(prefix="vllm-compat-"))
    try:
        if not args.no_scenarios:
            try:
                scenarios(work)
            except Exception as exc:
                traceback.print_exc()
                record("Qwen2.5-VL scenarios", False, f"{type(exc).__name__}: {exc}")
        for name in names:
            family_check(name, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nvLLM {vllm.__version__} (the server told --ec-vllm-version {vllm.__version__}): one row per family and "
          f"modality (" +
          "; ".join(modality_parts(m)[1] for m in ("image", "video", "audio")) + ")\n")
    print("| family | modality | vLLM processor | vLLM placeholder rows | rows we stored | identifiers match | "
          "rows bit-identical to native `/encode` of vLLM's decode | video rows against the model's own features "
          "on vLLM's processor output (max rel) | verdict |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in FAMILY_ROWS:
        print("| " + " | ".join(row) + " |")
    for name, why in NOT_APPLICABLE.items():
        print(f"| {name} | - | - | - | - | - | - | - | not applicable: {why} |")
    passed = sum(ok for _, ok, _ in RESULTS)
    print(f"\n{passed} passed, {len(RESULTS) - passed} failed")
    return 0 if passed == len(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
