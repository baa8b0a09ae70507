"""The qwen2_5_omni family: Qwen2.5-Omni's thinker towers, images, videos and audio in one server.

Vision: the Qwen2.5-VL tower (windowed attention, full attention in `fullatt_block_indexes`) with
separate `q`, `k`, `v` projections and its merger: `t*h*w / merge^2` rows per image or video, as
`get_image_features` / `get_video_features` give them. Frames are sized with the 128 to 768
merged-patch `size` that `Qwen2_5OmniProcessor` passes on every call (`towers/omni_thinker.py`).

Audio: the thinker's Whisper-style audio tower. The full processor pads every clip to the feature
extractor's window (`padding="max_length"`, 300 s in the published checkpoint) and cuts longer ones
(refused here); a clip has `L = ceil(samples / hop)` mel frames and yields
`((L - 1)//2 + 1 - 2)//2 + 1` rows (`_get_feat_extract_output_lengths`, also SGLang's `get_mm_data`
formula for `qwen2_5_omni`). The tower masks each chunk's padding after its first convolution, so a
clip's rows never depend on the clips fused beside it: one forward per batch.

Tensor parallel: the vision blocks as Qwen2.5-VL's (heads split over `q`, `k`, `v` column-wise,
`proj` row-wise; the gated MLP split) and the audio layers as Qwen2-Audio's; the mergers stay
whole. An audio tower whose heads do not split over the ranks stays whole on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from encode_server.models.family import Family
from encode_server.models.towers.omni_thinker import (
    OmniSpec,
    OmniThinkerAdapter,
    build_tiny_thinker,
    load_omni_thinker,
    shard_audio_tower,
)
from processors.families.qwen_omni import Qwen25OmniAudioRule


def run_tower(tower: torch.nn.Module, pixels: Any, grid: torch.Tensor, modality: str) -> torch.Tensor:
    return tower(pixels, grid_thw=grid).pooler_output


SPEC = OmniSpec(
    family="qwen2_5_omni",
    config_class="qwen2_5_omni.configuration_qwen2_5_omni.Qwen2_5OmniConfig",
    vision_tower_class="qwen2_5_omni.modeling_qwen2_5_omni.Qwen2_5OmniVisionEncoder",
    audio_tower_class="qwen2_5_omni.modeling_qwen2_5_omni.Qwen2_5OmniAudioEncoder",
    processor_class="qwen2_5_omni.processing_qwen2_5_omni.Qwen2_5OmniProcessor",
    audio_rule=Qwen25OmniAudioRule(),
    run_tower=run_tower,
)


def load(folder: Path, device: torch.device, dtype: torch.dtype) -> OmniThinkerAdapter:
    """The thinker's vision tower (with its merger) and audio tower of a Qwen2.5-Omni checkpoint."""
    return load_omni_thinker(folder, device, dtype, SPEC)


def shard(adapter: OmniThinkerAdapter, mesh: Any) -> None:
    """Vision heads and MLP columns split over the ranks, then the audio layers (when their heads split)."""
    from encode_server.models.sharding.blocks import check_heads, split_linears

    world = mesh.size()
    blocks = adapter.encoder["visual"].blocks
    local = [check_heads(block.attn.num_heads, world, adapter.info.family) for block in blocks]
    for block, heads in zip(blocks, local):
        block.attn.num_heads = heads
        split_linears(block.attn, mesh, colwise=["q", "k", "v"], rowwise=["proj"])
        split_linears(block.mlp, mesh, colwise=["gate_proj", "up_proj"], rowwise=["down_proj"])
    shard_audio_tower(adapter, mesh)


def tiny_qwen25_omni(device: torch.device, dtype: torch.dtype) -> OmniThinkerAdapter:
    """`tiny-qwen2.5-omni`: a 4-block vision tower of width 128 (patch 14, merge 2, windows of 112 pixels) and a
    2-layer audio tower of width 64 on 128-bin Whisper features at 16 kHz (30 s window); rows 128 wide."""
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from processors.video_patches import VideoPatcher, qwen2_vl_video_settings_class

    vision = dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4,
                  out_hidden_size=128, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1, 3])
    audio = dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=4,
                 encoder_ffn_dim=128, d_model=64, n_window=100, output_dim=128)
    # Up to 448x448 pixels per image or frame: at most 256 rows each, which keeps CPU forwards short.
    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=448 * 448)
    video = VideoPatcher(qwen2_vl_video_settings_class()(size={"shortest_edge": 56 * 56,
                                                               "longest_edge": 448 * 448}))
    extractor = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=30)
    return build_tiny_thinker("tiny-qwen2.5-omni", SPEC, vision, audio, image_processor, video, extractor, device,
                              dtype)


FAMILY = Family(
    name="qwen2_5_omni",
    model_types=("qwen2_5_omni",),
    modalities=("image", "video", "audio"),
    row_formula="image/video: `t*h*w / merge^2`; audio: `((L-1)//2 + 1 - 2)//2 + 1`, `L` = mel frames",
    grid_thw="image/video: the tower's patch grid (`t` = 1 for an image, frames / 2 for a video); audio: "
             "`[1, 1, rows]`",
    load=load,
    builtins={"tiny-qwen2.5-omni": tiny_qwen25_omni},
    shard=shard,
)
