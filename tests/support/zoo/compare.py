"""One model type: build (or reuse) its tiny folder, take the reference rows from the full model, take the
server's rows from its own loader and adapter, and compare. `python -m tests.support.zoo.compare TYPE WORK` prints one
JSON line per (model type, modality) pair, prefixed with `ZOO-RESULT `; the driver runs it in a subprocess.

Results: `exact` (same rows per item, and the fused batch equals the concatenation), `wrong` (row counts or
values differ), `refused` (CheckpointError at load, ItemError at preprocess), `error` (any other exception in
the server's code), `not applicable`, `unbuildable` (the tiny folder or the reference cannot be made).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

TOLERANCE = 1e-4
IMAGE_SIZES = ((40, 56), (120, 48), (90, 200))  # (width, height)
AUDIO_SECONDS = (1.3, 3.1)
#: Video clips as the server samples them: (frames, width, height, every n-th frame of a source at CLIP_FPS).
CLIPS = ((4, 56, 84, 2), (6, 112, 56, 3))  # sides of 28 pixels: some video processors do not resize
CLIP_FPS = 6.0
RESULT_PREFIX = "ZOO-RESULT "


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:400]}" if text else type(exc).__name__


def sample_images() -> list[Any]:
    from PIL import Image

    return [Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))
            for seed, (w, h) in enumerate(IMAGE_SIZES)]


def sample_clips() -> list[Any]:
    """Clips of random frames with where they come from (`VideoClip`: the item the server's decoder makes)."""
    from PIL import Image

    from processors.video_clip import VideoClip

    clips = []
    for seed, (count, width, height, step) in enumerate(CLIPS):
        rng = np.random.default_rng(100 + seed)
        frames = [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)) for _ in range(count)]
        clips.append(VideoClip(frames, CLIP_FPS, range(0, count * step, step)))
    return clips


def sample_audio(rate: int) -> list[np.ndarray]:
    clips = []
    for seed, seconds in enumerate(AUDIO_SECONDS):
        n = int(round(seconds * rate))
        t = np.arange(n) / rate
        noise = np.random.default_rng(seed).standard_normal(n)
        clips.append((0.3 * np.sin(2 * np.pi * (220 + 60 * seed) * t) + 0.05 * noise).astype(np.float32))
    return clips


def sampling_rate(processor: Any) -> int:
    for name in ("feature_extractor", "audio_processor"):
        sub = getattr(processor, name, None)
        if sub is not None and getattr(sub, "sampling_rate", None):
            return int(sub.sampling_rate)
    return 16000


class EmbedsGrabber:
    """Pre-hooks on every submodule whose forward takes `inputs_embeds`: keeps the first call that receives a
    tensor of the prompt's length (the decoder the model splices rows for)."""

    def __init__(self, model: torch.nn.Module, length: int) -> None:
        import inspect

        self.length, self.found, self.where, self.handles = length, None, None, []
        for name, module in model.named_modules():
            if module is model:
                continue
            try:
                parameters = inspect.signature(module.forward).parameters
            except (TypeError, ValueError):
                continue
            if "inputs_embeds" in parameters and ("past_key_values" in parameters or "use_cache" in parameters):
                self.handles.append(module.register_forward_pre_hook(self.hook(name), with_kwargs=True))
            elif name.endswith("layers.0") and "hidden_states" in parameters:  # a decoder that embeds inside
                self.handles.append(module.register_forward_pre_hook(self.first_layer(name), with_kwargs=True))
        self.fallback, self.fallback_where = None, None

    def first_layer(self, name: str):
        def grab(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            if self.fallback is None and isinstance(hidden, torch.Tensor) and hidden.ndim == 3 \
                    and hidden.shape[1] == self.length:
                self.fallback, self.fallback_where = hidden.detach().clone(), name
        return grab

    def hook(self, name: str):
        def grab(module, args, kwargs):
            embeds = kwargs.get("inputs_embeds")
            if self.found is None and isinstance(embeds, torch.Tensor) and embeds.ndim == 3 \
                    and embeds.shape[1] == self.length:
                self.found, self.where = embeds.detach().clone(), name
        return grab

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def takes_media_only_in_chat_requests(processor: Any) -> bool:
    """Voxtral's processor: its tokenizer is `mistral_common`'s, which writes the media tokens of a chat request
    itself; its `__call__` refuses audio."""
    return type(getattr(processor, "tokenizer", None)).__name__ == "MistralCommonBackend"


def chat_request_inputs(processor: Any, modality: str, item: Any, rate: int) -> dict:
    """The item alone in a user message (a float32 WAV, as a client would send the clip), through the processor's
    own chat request."""
    import base64
    import io

    import soundfile

    if modality != "audio":
        raise ValueError(f"no {modality} in a chat request here")
    buffer = io.BytesIO()
    soundfile.write(buffer, item, rate, format="WAV", subtype="FLOAT")
    content = {"type": "audio", "base64": base64.b64encode(buffer.getvalue()).decode()}
    return processor.apply_chat_template([{"role": "user", "content": [content]}], tokenize=True, return_dict=True,
                                         return_tensors="pt")


def processor_inputs(processor: Any, modality: str, token: str, item: Any, rate: int) -> dict:
    if takes_media_only_in_chat_requests(processor):
        return chat_request_inputs(processor, modality, item, rate)
    text = f"describe {token}"
    extra = {"return_mm_token_type_ids": True} if "mm_token_type_ids" in getattr(processor, "model_input_names",
                                                                                 ()) else {}
    if modality == "image":
        return processor(text=[text], images=[item], return_tensors="pt", **extra)
    if modality == "audio":
        return processor(text=[text], audio=[item], sampling_rate=rate, return_tensors="pt", **extra)
    if modality == "video":  # the frames as uint8 (T, H, W, C), unsampled, with the source they come from
        from transformers.video_utils import VideoMetadata

        frames = np.stack([np.asarray(frame) for frame in item])
        total = item.frames_indices[-1] + 1
        metadata = VideoMetadata(total_num_frames=total, fps=item.fps, frames_indices=list(item.frames_indices),
                                 duration=total / item.fps)
        return processor(text=[text], videos=[frames], do_sample_frames=False, video_metadata=[metadata],
                         return_tensors="pt", **extra)
    raise ValueError(modality)


#: Processor attributes naming what a prompt holds for one item, when it is not the token the rows fill
#: (Gemma 3 expands its begin-of-image token, Qianfan-OCR its
#: image_placeholder_token); "" is a prompt with no token (the processor adds it, Fuyu).
PROMPT_TOKENS = {"image": ("boi_token", "start_image_token", "image_start_token", "image_placeholder_token"),
                 "audio": ("boa_token", "audio_start_token"),
                 "video": ("video_start_token",)}


def token_attribute(processor: Any, name: str) -> str | None:
    value = getattr(processor, name, None)
    value = getattr(value, "content", value)
    return value if isinstance(value, str) and value else None


def prompt_candidates(processor: Any, modality: str, token: str) -> list[str]:
    """The prompt forms tried in order: the token, the tokens a prompt holds instead, the token framed by the
    processor's start and end tokens (HunYuan-VL refuses a bare `<image>`: "must be formatted as
    <image_start><image><image_end>"), and no token."""
    found = [token]
    for name in PROMPT_TOKENS[modality]:
        value = token_attribute(processor, name)
        if value is not None and value not in found:
            found.append(value)
    start, end = (token_attribute(processor, f"{modality}_{side}_token") for side in ("start", "end"))
    if start is not None and end is not None and start + token + end not in found:
        found.append(start + token + end)
    return found + [""]


def reference_all(model: Any, processor: Any, modality: str, token: str, token_id: int, items: list[Any],
                  rate: int) -> list[torch.Tensor]:
    """The reference rows of each item, with the first prompt form under which the full model runs."""
    failure: Exception | None = None
    for prompt in prompt_candidates(processor, modality, token):
        try:
            return [reference_rows(model, processor, modality, prompt, token_id, item, rate) for item in items]
        except NotSpliced:
            raise
        except Exception as exc:  # noqa: BLE001 (try the next prompt form; the first failure is reported)
            failure = failure or exc
    raise failure


def reference_rows(model: Any, processor: Any, modality: str, token: str, token_id: int, item: Any,
                   rate: int) -> torch.Tensor:
    inputs = processor_inputs(processor, modality, token, item, rate)
    dtype = next(model.parameters()).dtype  # as a caller casts them (Llama 4's processor gives bfloat16 pixels)
    inputs = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in inputs.items()}
    ids = inputs["input_ids"]
    grabber = EmbedsGrabber(model, ids.shape[1])
    # an Omni model's top level only generates (no forward): its thinker is the model that reads the media
    runner = model.thinker if type(model).forward is torch.nn.Module.forward and hasattr(model, "thinker") else model
    try:
        with torch.no_grad():
            runner(**inputs)
    finally:
        grabber.remove()
    if grabber.found is None and grabber.fallback is not None:  # its first decoder layer's input instead
        grabber.found, grabber.where = grabber.fallback, grabber.fallback_where
    if grabber.found is None:
        raise RuntimeError("no submodule received inputs_embeds of the prompt's length")
    mask = ids[0] == token_id
    if not mask.any():
        raise RuntimeError(f"the processor put no {token!r} (id {token_id}) in the prompt")
    rows = grabber.found[0][mask]
    embedding = runner.get_input_embeddings()
    plain = embedding(ids[0][mask]) if embedding is not None else None
    if plain is not None and plain.shape == rows.shape and torch.equal(plain.to(rows.dtype), rows):
        raise NotSpliced(f"the decoder ({grabber.where}) receives the placeholder's own embedding: nothing spliced")
    return rows.float()


def load_reference_model(model_class: type, folder: Path) -> torch.nn.Module:
    """`from_pretrained`; where that asks for files beyond the weights (Qwen2.5-Omni's speaker dictionary, for
    a talker not built here), `PreTrainedModel.from_pretrained` for the class (the weights, no extra files)."""
    try:
        return model_class.from_pretrained(folder, dtype=torch.float32).eval()
    except OSError:  # the generic loader (key renames included), without the class's extra files
        from transformers import PreTrainedModel

        return PreTrainedModel.from_pretrained.__func__(model_class, folder, dtype=torch.float32).eval()


class NotSpliced(Exception):
    pass


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.abs().max())
    return float((a.double() - b.double()).abs().max()) / max(scale, 1e-30)


def compare_modality(adapter: Any, refs: list[torch.Tensor], items: list[Any], modality: str) -> tuple[str, str]:
    from processors.base import ItemError

    info = adapter.info
    width = info.hidden_size if info.deepstack_of(modality) else None
    try:
        ours = []
        for item in items:
            batch = adapter.processor.preprocess(modality, [item])
            rows = adapter.forward(batch)
            ours.append(rows[:, :width] if width else rows)
        fused_batch = adapter.processor.preprocess(modality, list(items))
        fused = adapter.forward(fused_batch)
        fused = fused[:, :width] if width else fused
    except ItemError as exc:
        return "refused", f"ItemError at preprocess: {first_line(exc)}"
    counts_ref, counts_ours = [r.shape[0] for r in refs], [o.shape[0] for o in ours]
    if counts_ref != counts_ours:
        return "wrong", f"rows per item: reference {counts_ref}, ours {counts_ours}"
    widths = {o.shape[1] for o in ours} | {r.shape[1] for r in refs}
    if len(widths) != 1:
        return "wrong", f"row widths differ: reference {refs[0].shape[1]}, ours {ours[0].shape[1]}"
    diffs = [rel(o, r) for o, r in zip(ours, refs)]
    if max(diffs) > TOLERANCE:
        return "wrong", "max|diff|/max|ref| per item: " + ", ".join(f"{d:.2e}" for d in diffs)
    joined = torch.cat(ours)
    if fused.shape != joined.shape:
        return "wrong", f"fused batch gave {tuple(fused.shape)} rows, the items alone {tuple(joined.shape)}"
    fused_diff = rel(fused, torch.cat(refs))
    if fused_diff > TOLERANCE:
        return "wrong", f"fused batch differs from the reference by {fused_diff:.2e} (items alone: ok)"
    return "exact", f"rows {counts_ref}, max rel diff {max(diffs + [fused_diff]):.1e}"


def run_type(model_type: str, work: Path) -> list[dict]:
    from tests.support.zoo.build import Unbuildable, build
    from tests.support.zoo.catalog import NOT_APPLICABLE

    def result(modality: str, outcome: str, detail: str) -> dict:
        return {"model_type": model_type, "modality": modality, "result": outcome, "detail": detail}

    if model_type in NOT_APPLICABLE:
        return [result("-", "not applicable", NOT_APPLICABLE[model_type])]
    folder = work / model_type
    manifest_path = folder / "zoo.json"
    try:
        if manifest_path.exists():
            manifest = json.loads(manifest_path.read_text())
        else:
            manifest = build(model_type, folder)
    except Unbuildable as exc:
        return [result("-", "unbuildable", str(exc))]
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        return [result("-", "unbuildable", f"build: {first_line(exc)}")]
    tokens = {m: t for m, t in manifest["tokens"].items() if m in ("image", "audio", "video")}
    if not tokens:
        return [result("-", "unbuildable", "no image, audio or video placeholder token found in the processor")]
    import transformers
    from transformers import AutoProcessor

    try:
        model = load_reference_model(getattr(transformers, manifest["model_class"]), folder)
        processor = AutoProcessor.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        return [result(m, "unbuildable", f"reference load: {first_line(exc)}") for m in tokens]
    rate = sampling_rate(processor)
    items = {"image": sample_images(), "audio": sample_audio(rate), "video": sample_clips()}
    references: dict[str, list[torch.Tensor]] = {}
    out = []
    for modality, (token, token_id) in tokens.items():
        try:
            references[modality] = reference_all(model, processor, modality, token, token_id, items[modality],
                                                 rate)
        except NotSpliced as exc:
            out.append(result(modality, "not applicable", str(exc)))
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            out.append(result(modality, "unbuildable", f"reference forward: {first_line(exc)}"))
    if not references:
        return out
    del model
    from encode_server.models.loading.checkpoint import CheckpointError
    from encode_server.models.registry import load_checkpoint

    try:
        adapter = load_checkpoint(folder, torch.device("cpu"), torch.float32)
    except CheckpointError as exc:
        return out + [result(m, "refused", f"at load: {first_line(exc)}") for m in references]
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        return out + [result(m, "error", f"at load: {first_line(exc)}") for m in references]
    for modality, refs in references.items():
        if not adapter.supports(modality):
            out.append(result(modality, "refused", f"the {adapter.info.family} adapter serves only "
                                                   f"{', '.join(adapter.info.modalities)}"))
            continue
        try:
            outcome, detail = compare_modality(adapter, refs, items[modality], modality)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            outcome, detail = "error", f"{adapter.info.family}: {first_line(exc)}"
        out.append(result(modality, outcome, f"[{adapter.info.family}] {detail}"))
    return out


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    model_type, work = sys.argv[1], Path(sys.argv[2])
    for row in run_type(model_type, work):
        print(RESULT_PREFIX + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
