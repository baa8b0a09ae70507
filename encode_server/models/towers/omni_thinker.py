"""The adapter and loader shared by the Omni thinkers (Qwen2.5-Omni, Qwen3-Omni): one server, both towers.

An Omni checkpoint holds a *thinker* (vision tower with its merger, audio tower, language model) and a
*talker* (speech output). What the thinker's forward splices into the prompt at its placeholders is
`get_image_features` / `get_video_features` (the vision tower's merged rows, with deepstack features on
Qwen3-Omni) and `get_audio_features` (the audio tower's rows); this adapter computes exactly those, and
builds and loads only the two towers (`thinker.visual.*`, `thinker.audio_tower.*`): never the language
model, the talker or the vocoder.

Images and videos go through `GridVisionAdapter` (`towers/grid_vision.py`) as Qwen2.5-VL's and
Qwen3-VL's do: the tower's patch grid, `t*h*w / merge^2` rows. Video frames are sized as the model's
full processor sizes them: its class-level `videos_kwargs` (a `size` of 128 to 768 merged patches per
frame) are passed on every call and override the folder's video processor `size`. Audio clips go
through `OmniAudio` (`processors/omni_audio.py`) with the family's `OmniAudioRule`; the processor is
`OmniThinkerProcessor`, the audio tower's forward `audio_rows`.

Rows are `[tokens, hidden]` for audio and `[tokens, hidden * (1 + k)]` for images and videos (`k`
deepstack blocks, Qwen3-Omni only): `ModelInfo.deepstack_modalities` says so.

`use_audio_in_video` (the processor's `load_audio_from_video`): the thinker computes a video's audio
track as any other audio clip (`get_audio_features`) and only *places* its rows between the video's, in
2-second chunks; the rows are the same. A client sends the track as an audio item of its own; the
interleaving (prompt expansion and positions) is the prefill side's job. SGLang 0.5.23's language side
(`QwenVLImageProcessor.get_mm_data`) always passes `use_audio_in_video=False`, so through SGLang that
layout cannot be served; this server never reads a video file's audio track.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from encode_server.models.base import ModelInfo
from encode_server.models.layers.packed_attention import use_packed_attention
from encode_server.models.layers.patch_embed import to_host
from encode_server.models.towers.grid_vision import (
    GridVisionAdapter,
    RunTower,
    check_grid,
    deepstack_count,
    transformers_class,
)
from processors.base import PreparedBatch
from processors.omni_audio import MODALITIES, OmniAudio, OmniAudioRule, OmniThinkerProcessor
from processors.video_patches import VideoPatcher

#: Where an Omni checkpoint keeps the thinker's towers: `thinker.visual.*` as published, `thinker.model.visual.*`
#: as `transformers` holds them in memory.
THINKER_PREFIXES = ("thinker.model.", "thinker.", "model.")


class OmniThinkerAdapter(GridVisionAdapter):
    """Images and videos through the thinker's vision tower, audio through its audio tower."""

    processor: OmniThinkerProcessor

    def __init__(self, info: ModelInfo, tower: torch.nn.Module, processor: OmniThinkerProcessor, run_tower: RunTower,
                 audio_tower: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(info, tower, processor, run_tower, device, dtype)
        self.encoder["audio_tower"] = audio_tower.to(device=device, dtype=dtype).eval()
        self.audio_tower = self.encoder["audio_tower"]
        self.packed_audio_attention = use_packed_attention(self.audio_tower, blocks="layers", attention="self_attn")

    @torch.inference_mode()
    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        if batch.modality == "audio":
            return to_host(audio_rows(self.audio_tower, self.processor.audio.rule, batch, self.device, self.dtype))
        return super().forward(batch)

    def warmup(self) -> None:
        """Both towers (the health probe, an image, exercises the vision tower only)."""
        super().warmup()
        self.forward(self.processor.preprocess("audio", [self.processor.audio.sample_item()]))


def audio_rows(tower: torch.nn.Module, rule: OmniAudioRule, batch: PreparedBatch, device: torch.device,
               dtype: torch.dtype) -> torch.Tensor:
    """The batch's rows `[sum rows, width]` (on `device`), one tower call per `rule.tower_groups` group: the
    clips' real frames concatenated along time with each clip's length (`feature_lens`), as the thinker's
    `get_audio_features` hands them to its audio tower."""
    lens = [int(n) for n in batch.inputs["feature_lens"].tolist()]
    starts = np.cumsum([0, *lens]).tolist()
    features = batch.inputs["input_features"]
    rows: list[torch.Tensor | None] = [None] * len(lens)
    for group in rule.tower_groups(lens):
        clips = torch.cat([features[starts[i]:starts[i + 1]] for i in group])
        group_lens = torch.tensor([lens[i] for i in group], dtype=torch.long, device=device)
        out = tower(clips.to(device=device, dtype=dtype).T, feature_lens=group_lens).last_hidden_state
        for index, part in zip(group, torch.split(out, [batch.layouts[i].tokens for i in group])):
            rows[index] = part
    return torch.cat(rows)  # type: ignore[arg-type]


@dataclass(frozen=True)
class OmniSpec:
    """What an Omni family's loader needs to know: classes by their path under `transformers.models`."""

    family: str
    config_class: str
    vision_tower_class: str
    audio_tower_class: str
    processor_class: str
    audio_rule: OmniAudioRule
    run_tower: RunTower
    #: Extra consistency checks of the thinker config against the processor; returns a problem or None.
    check: Callable[[Any, Any], str | None] | None = None


def processor_defaults(processor_class: Any, modality_kwargs: str) -> dict[str, Any]:
    """A full processor's class-level defaults for one modality (`videos_kwargs`, `audio_kwargs`): what it passes
    on every call unless the caller overrides them (the lowest priority in `ProcessorMixin._merge_kwargs`, but
    above the sub-processor's own saved settings, which are not call arguments)."""
    return dict(getattr(processor_class, modality_kwargs, None) or {})


def video_patcher(folder: Path, processor_class: Any) -> VideoPatcher:
    """The folder's video processor settings, with the `size` the full processor passes on every call."""
    from transformers.image_utils import SizeDict

    from processors.video_patches import load_video_processor

    settings = load_video_processor(folder, default="Qwen2VLVideoProcessor")
    size = processor_defaults(processor_class, "videos_kwargs").get("size")
    if size:
        settings.size = SizeDict(**size)
    return VideoPatcher(settings)


def build_adapter(name: str, spec: OmniSpec, vision_tower: torch.nn.Module, audio_tower: torch.nn.Module,
                  image_processor: Any, video: VideoPatcher, audio: OmniAudio, device: torch.device,
                  dtype: torch.dtype) -> OmniThinkerAdapter:
    vision, audio_config = vision_tower.config, audio_tower.config
    width = int(vision.out_hidden_size)
    if int(audio_config.output_dim) != width:
        raise ValueError(f"the audio tower's rows ({audio_config.output_dim} wide) and the vision tower's "
                         f"({width} wide) do not have the language model's one width")
    info = ModelInfo(name=name, family=spec.family, modalities=MODALITIES, hidden_size=width,
                     deepstack=deepstack_count(vision), deepstack_modalities=("image", "video"))
    processor = OmniThinkerProcessor(image_processor, video, audio)
    check_grid(processor, vision)
    return OmniThinkerAdapter(info, vision_tower, processor, spec.run_tower, audio_tower, device, dtype)


def build_tiny_thinker(name: str, spec: OmniSpec, vision: dict[str, Any], audio: dict[str, Any],
                       image_processor: Any, video: VideoPatcher, feature_extractor: Any, device: torch.device,
                       dtype: torch.dtype) -> OmniThinkerAdapter:
    """A built-in tiny thinker: the spec's two towers built from these config values (sdpa attention, fixed
    seed, float32), served with the given image processor, video settings and feature extractor."""
    from encode_server.models.builtin import seeded

    towers = [(transformers_class(path), values) for path, values in
              ((spec.vision_tower_class, vision), (spec.audio_tower_class, audio))]
    configs = [tower.config_class(**values) for tower, values in towers]
    for config in configs:
        config._attn_implementation = "sdpa"
    vision_tower, audio_tower = seeded(lambda: [tower._from_config(config).float()
                                                for (tower, _), config in zip(towers, configs)])
    audio_items = OmniAudio(spec.audio_rule, feature_extractor, int(feature_extractor.sampling_rate))
    return build_adapter(name, spec, vision_tower, audio_tower, image_processor, video, audio_items, device, dtype)


def load_omni_thinker(folder: Path, device: torch.device, dtype: torch.dtype, spec: OmniSpec) -> OmniThinkerAdapter:
    """The thinker's vision and audio towers of an Omni checkpoint folder, with the image processor, video
    processor settings and feature extractor the model's full processor would use."""
    from transformers import AutoFeatureExtractor, AutoImageProcessor

    from encode_server.models.loading.checkpoint import CheckpointError, load_encoder_modules, read_config

    folder = Path(folder)
    config_class = transformers_class(spec.config_class)
    model_type = read_config(folder).get("model_type")
    if model_type != config_class.model_type:
        raise CheckpointError(f"{folder}: model_type {model_type!r} is not {config_class.model_type!r}")
    thinker = config_class.from_pretrained(folder).thinker_config
    processor_class = transformers_class(spec.processor_class)
    if spec.check is not None and (problem := spec.check(thinker, processor_class)):
        raise CheckpointError(f"{folder}: {problem}")
    vision_class, audio_class = transformers_class(spec.vision_tower_class), transformers_class(spec.audio_tower_class)
    for sub in (thinker.vision_config, thinker.audio_config):
        sub._attn_implementation = "sdpa"
    modules = load_encoder_modules(folder, lambda: {"visual": vision_class._from_config(thinker.vision_config),
                                                    "audio_tower": audio_class._from_config(thinker.audio_config)},
                                   prefixes=THINKER_PREFIXES)
    try:
        image_processor = AutoImageProcessor.from_pretrained(folder)
        video = video_patcher(folder, processor_class)
        extractor = AutoFeatureExtractor.from_pretrained(folder)
        audio_kwargs = processor_defaults(processor_class, "audio_kwargs")
        if int(extractor.feature_size) != int(thinker.audio_config.num_mel_bins):
            raise ValueError(f"the feature extractor's {extractor.feature_size} mel bins are not the audio tower's "
                             f"{thinker.audio_config.num_mel_bins}")
        audio = OmniAudio(spec.audio_rule, extractor, int(audio_kwargs.get("sampling_rate", extractor.sampling_rate)))
        return build_adapter(folder.name, spec, modules["visual"], modules["audio_tower"], image_processor, video,
                             audio, device, dtype)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder}: {exc}") from None


# --- tensor parallel -----------------------------------------------------------------------------

def audio_heads_split(adapter: OmniThinkerAdapter, world: int) -> bool:
    return all(layer.self_attn.num_heads % world == 0 for layer in adapter.audio_tower.layers)


def shard_audio_tower(adapter: OmniThinkerAdapter, mesh: Any) -> bool:
    """Every audio layer: q, k, v column-wise and `out_proj` row-wise, fc1 column-wise and fc2 row-wise (the
    Qwen2-Audio plan). A tower whose heads do not split over the ranks stays whole on every rank (each rank then
    computes the same audio rows); returns whether it was split."""
    from encode_server.models.sharding.blocks import split_linears

    world = mesh.size()
    if not audio_heads_split(adapter, world):
        return False
    for layer in adapter.audio_tower.layers:
        attention = layer.self_attn
        attention.num_heads //= world
        split_linears(attention, mesh, colwise=["q_proj", "k_proj", "v_proj"], rowwise=["out_proj"])
        split_linears(layer, mesh, colwise=["fc1"], rowwise=["fc2"])
    return True
