"""The qwen3_omni_moe family: Qwen3-Omni's thinker towers, images, videos and audio in one server.

Vision: the Qwen3-VL tower (learned position grid, patch 16, merge 2) with its merger and its
deepstack mergers: image and video rows are `[tokens, out_hidden * (1 + k)]`, the main features then
the `k = len(deepstack_visual_indexes)` deepstack blocks, as `get_image_features` /
`get_video_features` return them and the thinker adds them to its first layers. Frames are sized with
the 128 to 768 merged-patch `size` that `Qwen3OmniMoeProcessor` passes on every call.

Audio: three stride-2 convolutions over chunks of `2 * n_window` = 100 mel frames, then attention
within windows of `n_window_infer` frames of one clip. The full processor extracts features with
`padding=True, truncation=False` (no window: any length), so a clip alone has `L = samples // hop`
frames and yields `((f - 1)//2 + 1 - 1)//2 + 1 + (L // 100) * 13` rows, `f = (L % 100 - 1)//2 + 1`
(`_get_feat_extract_output_lengths`, also SGLang's `get_mm_data` formula for `qwen3_omni_moe`);
rows are `[tokens, out_hidden]`, no deepstack. Those counts hold for `n_window` 50 only (the
processor and SGLang hard-code it), so other values are refused at load.

The convolutions do not mask a chunk's padding: a clip shorter than one chunk, padded to the longer
chunks of its neighbours, would get other values in its last rows than alone. Such clips therefore go
through the tower on their own (with others of the same length); every clip of a chunk or more, whose
last chunk is padded to 100 frames alone too, goes in one forward. Each clip's features are extracted
on their own for the same reason (padded to the batch's longest, a clip's last frames would change).

Tensor parallel: the vision blocks as Qwen3-VL's (fused `qkv` split by heads, MLP split; mergers,
deepstack ones included, whole) and the audio layers as Qwen2-Audio's; an audio tower whose heads do
not split over the ranks stays whole on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from encode_server.models.family import Family
from encode_server.models.towers.grid_vision import run_qwen3_tower
from encode_server.models.towers.omni_thinker import (
    OmniSpec,
    OmniThinkerAdapter,
    build_tiny_thinker,
    load_omni_thinker,
    shard_audio_tower,
)
from processors.families.qwen_omni import CHUNK_FRAMES, Qwen3OmniAudioRule


def check(thinker: Any, processor_class: Any) -> str | None:
    n_window = int(thinker.audio_config.n_window)
    expected = int(getattr(processor_class, "n_window", 50))
    if n_window * 2 != CHUNK_FRAMES or expected * 2 != CHUNK_FRAMES:
        return (f"audio_config.n_window is {n_window}; Qwen3OmniMoeProcessor counts audio tokens with n_window "
                f"{expected} and SGLang's get_mm_data with 50, so only 50 gives rows that match the placeholders")
    return None


SPEC = OmniSpec(
    family="qwen3_omni_moe",
    config_class="qwen3_omni_moe.configuration_qwen3_omni_moe.Qwen3OmniMoeConfig",
    vision_tower_class="qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeVisionEncoder",
    audio_tower_class="qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeAudioEncoder",
    processor_class="qwen3_omni_moe.processing_qwen3_omni_moe.Qwen3OmniMoeProcessor",
    audio_rule=Qwen3OmniAudioRule(),
    run_tower=run_qwen3_tower,
    check=check,
)


def load(folder: Path, device: torch.device, dtype: torch.dtype) -> OmniThinkerAdapter:
    """The thinker's vision tower (mergers included) and audio tower of a Qwen3-Omni checkpoint."""
    return load_omni_thinker(folder, device, dtype, SPEC)


def shard(adapter: OmniThinkerAdapter, mesh: Any) -> None:
    """Vision heads and MLP columns split (mergers whole), then the audio layers (when their heads split)."""
    from encode_server.models.towers.grid_vision import shard_grid_blocks

    shard_grid_blocks(adapter, mesh, colwise_mlp=("linear_fc1",), rowwise_mlp=("linear_fc2",))
    shard_audio_tower(adapter, mesh)


def tiny_qwen3_omni(device: torch.device, dtype: torch.dtype) -> OmniThinkerAdapter:
    """`tiny-qwen3-omni`: a 4-block vision tower of width 128 (patch 16, merge 2, deepstack after blocks 1 and 2)
    and a 2-layer audio tower of width 64 on 128-bin Whisper features at 16 kHz; rows 128 wide (audio) and
    384 wide (image and video: main + 2 deepstack blocks)."""
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from processors.video_patches import VideoPatcher, qwen2_vl_video_settings_class

    vision = dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4,
                  out_hidden_size=128, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=256,
                  deepstack_visual_indexes=[1, 2])
    audio = dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=4,
                 encoder_ffn_dim=128, d_model=64, n_window=50, n_window_infer=400,
                 output_dim=128, downsample_hidden_size=16)
    # Up to 512x512 pixels per image or frame (256 rows each), keeping CPU forwards short.
    image_processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                               min_pixels=64 * 64, max_pixels=512 * 512,
                                               image_mean=[0.5] * 3, image_std=[0.5] * 3)
    video = VideoPatcher(qwen2_vl_video_settings_class()(
        patch_size=16, size={"shortest_edge": 64 * 64, "longest_edge": 512 * 512},
        image_mean=[0.5] * 3, image_std=[0.5] * 3))
    extractor = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160)
    return build_tiny_thinker("tiny-qwen3-omni", SPEC, vision, audio, image_processor, video, extractor, device,
                              dtype)


FAMILY = Family(
    name="qwen3_omni_moe",
    model_types=("qwen3_omni_moe",),
    modalities=("image", "video", "audio"),
    row_formula="image/video: `t*h*w / merge^2`, each row main + deepstack features "
                "(`out_hidden * (1 + len(deepstack_visual_indexes))` wide); audio: `L // 100 * 13` + the rows of the "
                "last `L % 100` frames (three stride-2 halvings), `L` = mel frames, `out_hidden` wide",
    grid_thw="image/video: the tower's patch grid (`t` = 1 for an image, frames / 2 for a video); audio: "
             "`[1, 1, rows]`",
    load=load,
    builtins={"tiny-qwen3-omni": tiny_qwen3_omni},
    shard=shard,
)
