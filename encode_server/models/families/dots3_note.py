"""The dots3_note family: Dots3-Note's MoE vision tower (images, videos) and its audio encoder.

Vision. The tower is Qwen-grid shaped (`Dots3NoteVisionModel(pixels, grid_thw).pooler_output`, the
merger included) with a 2-D patch embedding: one frame per temporal patch. Images go through the
folder's Qwen2-VL image processor (`smart_resize` to multiples of `patch * merge` within its pixel
range; `1 x h x w` grids, `h * w / merge^2` rows), videos through its Qwen3-VL video processor's
settings (`VideoPatcher`: one clip-wide `smart_resize`; a `frames x h x w` grid), the rows the
full processor's `<|imgpad|>` / `<|video_pad|>` counts. The tower attends within each frame of each
item only and routes every patch to its experts on its own, so fused items do not see each other.
`GridVisionAdapter` runs it, as it runs the Qwen3-VL and GLM-4V towers.

Audio. Mono waveforms at 16 kHz, cut by `Dots3NoteFeatureExtractor` into chunks of
`chunk_length` seconds, each a 128-bin log-mel spectrogram padded to the chunk window. Three
stride-2 convolutions make one row per 8 mel frames: a chunk of `n` samples yields
`ceil(n / (hop * 8))` rows (1280 samples, 80 ms), a clip the sum over its chunks (the
extractor's `num_audio_tokens`, which the full processor inserts as `<|audio_comp_pad|>`). The
encoder masks every frame past a chunk's length before each convolution and attends only within the
chunk's rows, so chunks of clips of different lengths run in one forward (padded with zeros to the
longest) and each clip's rows are its own. The rows are `get_audio_features(...).pooler_output`:
the encoder, its final norm and the audio adapter.

Checkpoints: published ones store the towers as `vision_encoder.*` / `audio_encoder.*` with each
vision expert's `fc1`/`fc2`/`fc3` apart; `transformers`' conversion mapping renames them and stacks
the experts (`towers/vision_parts.py` applies it, converters included); the language model is
never built. The processors need torchvision (the image processor `transformers` saves for this model
is its torchvision one).

What SGLang reads: `grid_thw` for images and videos, an audio clip's row count (its `get_mm_data`
takes audio lengths as sequence lengths). No tensor-parallel plan: the vision tower's sparse blocks
hold up to 64 experts per block as stacked tensors, which no plan here splits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from encode_server.models.base import ModelInfo
from encode_server.models.family import Family
from encode_server.models.loading.checkpoint import CheckpointError
from encode_server.models.towers.grid_vision import GridVisionAdapter, check_grid, run_qwen_tower
from processors.base import PreparedBatch
from processors.families.dots3_note import MODALITIES, Dots3NoteProcessor
from processors.video_patches import load_video_processor


class Dots3NoteAdapter(GridVisionAdapter):
    """The vision tower through `GridVisionAdapter`, and the audio encoder with its adapter on waveforms."""

    processor: Dots3NoteProcessor

    def __init__(self, name: str, vision_tower: torch.nn.Module, audio_tower: torch.nn.Module, config: Any,
                 processor: Dots3NoteProcessor, device: torch.device, dtype: torch.dtype) -> None:
        hidden = int(config.text_config.hidden_size)
        info = ModelInfo(name=name, family="dots3_note", modalities=MODALITIES, hidden_size=hidden)
        super().__init__(info, vision_tower, processor, run_qwen_tower, device, dtype)
        self.encoder["audio"] = audio_tower.to(device=device, dtype=dtype).eval()

    @torch.inference_mode()
    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        if batch.modality != "audio":
            return super().forward(batch)
        features = batch.inputs["input_features"].to(device=self.device, dtype=self.dtype)
        output = self.encoder["audio"](input_features=features,
                                       chunk_sample_lengths=batch.inputs["chunk_sample_lengths"].to(self.device))
        return output.pooler_output.to("cpu").contiguous()


def check_audio(name: str, audio: Any, feature_extractor: Any) -> None:
    """A `CheckpointError` unless the feature extractor makes the frames the audio encoder takes."""
    mismatched = [(what, ours, theirs) for what, ours, theirs in (
        ("sampling rate", audio.sampling_rate, feature_extractor.sampling_rate),
        ("mel bins", audio.feature_size, feature_extractor.feature_size),
        ("hop length", audio.hop_length, feature_extractor.hop_length)) if int(ours) != int(theirs)]
    if mismatched:
        raise CheckpointError(f"{name}: the feature extractor does not match the audio encoder: " + ", ".join(
            f"{what} {theirs} != {ours}" for what, ours, theirs in mismatched) + "; make the folder's "
            "feature extractor settings match config.json's audio_config")


def dots3_note_from_folder(folder: Path, device: torch.device, dtype: torch.dtype) -> Dots3NoteAdapter:
    """The vision and audio towers of a Dots3-Note checkpoint (published or `save_pretrained` layout), and its
    processors as `transformers` resolves them."""
    from transformers import AutoFeatureExtractor, AutoImageProcessor, Dots3NoteConfig
    from transformers.models.dots3_note.modeling_dots3_note import Dots3NoteModel

    from encode_server.models.towers.vision_parts import load_vision_part, require_torchvision

    require_torchvision("dots3_note")
    config = Dots3NoteConfig.from_pretrained(folder)
    for part in (config.vision_config, config.audio_config):
        part._attn_implementation = "sdpa"
    model = load_vision_part(folder, Dots3NoteModel, config, torch.device("cpu"), dtype)
    try:
        extractor = AutoFeatureExtractor.from_pretrained(folder)
        processor = Dots3NoteProcessor(AutoImageProcessor.from_pretrained(folder),
                                       load_video_processor(folder, default="Qwen3VLVideoProcessor"), extractor,
                                       int(config.audio_config.samples_per_token))
        check_grid(processor, model.vision_tower.config)
        check_audio(folder.name, config.audio_config, extractor)
        return Dots3NoteAdapter(folder.name, model.vision_tower, model.audio_tower, config, processor, device, dtype)
    except (OSError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{folder}: {exc}") from None


FAMILY = Family(
    name="dots3_note",
    model_types=("dots3_note",),
    modalities=MODALITIES,
    row_formula="image and video `t*h*w / merge^2` (`t` = 1 for an image, frames for a video); audio "
                "`sum(ceil(chunk_samples / 1280))` over its chunks",
    grid_thw="`[t, h, w]` in patches before merging; audio `[1, 1, rows]` (SGLang gets the rows)",
    load=dots3_note_from_folder,
)
