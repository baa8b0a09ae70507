"""The muse_spark family: Muse Spark's vision tower (images, videos) and waveform audio tower.

Images. `MuseGlimmerImageProcessor` picks the patch grid closest to the image's aspect ratio under a
cap of `max_image_tokens` merged tokens: `(ph, pw)` blocks of `patch_size * merge_size` pixels
(`smart_resize`), so the tower sees a `1 x 2ph x 2pw` patch grid (merge 2) and the image yields
`ph * pw` rows, each followed by the full processor's `<|patch|>` count for it. A video is a list of
frames resized alike under `max_video_frame_tokens` per frame and grouped `patch_temporal` frames per
clip (the last frame repeated to fill the final clip): `t x 2ph x 2pw`, `t * ph * pw` rows. The rows
are the model's own `get_image_features` / `get_video_features`: the tower (attention within each
clip and its windows only, so items fused into one forward do not see each other), the
`vision_adapter` MLP, `vision_projection` and the weightless `perception_emb_norm`.

Audio. Mono waveforms at the feature extractor's rate (24 kHz). The tower is a fully causal
convolutional pyramid with no attention: `samples_per_token` (the product of `patch_sizes`, 1920)
samples make one row, `ceil(samples / samples_per_token)` rows per clip, the count
`MuseSparkProcessor.replace_audio_token` inserts. Clips of different lengths are padded with zeros
to the longest (a multiple of `samples_per_token`) and run in one forward; causality makes a clip's
rows independent of the padding after it. Its rows then go through the text embedding's weightless
`embed_norm`, as `MuseSparkModel.get_audio_features` does (the language model is never built; the
norm has no weights, so it is made here with the text config's epsilon).

What SGLang's language side reads (`MuseSpark1xOmniMultimodalProcessor.get_mm_data`): the merged
token grids (`[1, ph, pw]`, `[t, ph, pw]`, SGLang's own Muse encoder sends the same), one timestamp
per video clip (frame `k * patch_temporal` over the sampling fps, the time
`MuseSparkProcessor.replace_video_token` prints), and an audio clip's row count. Each layout
carries them (`receiver_grid`, `clip_frames`).

The processors need torchvision (transformers 5.23 has no PIL backend for them). Tensor parallel:
the vision tower's blocks are sharded (separate q, k, v column-wise, `proj` row-wise; `fc1`
column-wise, `fc2` row-wise); the projector and the audio tower stay replicated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from encode_server.models.base import ModelInfo
from encode_server.models.family import Family
from encode_server.models.loading.checkpoint import CheckpointError
from encode_server.models.towers.vision_parts import VisionPartAdapter, load_vision_part, require_torchvision
from processors.base import PreparedBatch
from processors.families.muse_spark import MODALITIES, MuseSparkProcessor


class MuseSparkAdapter(VisionPartAdapter):
    """Runs `MuseSparkModel`'s vision and audio parts (no language model) on images, videos and waveforms."""

    def __init__(self, name: str, model: torch.nn.Module, config: Any, processor: MuseSparkProcessor,
                 device: torch.device, dtype: torch.dtype) -> None:
        from transformers.models.muse_spark.modeling_muse_spark import MuseSparkRMSNorm

        super().__init__(name, "muse_spark", model, config.text_config.hidden_size, processor, device, dtype)
        self.info = ModelInfo(name=name, family="muse_spark", modalities=MODALITIES,
                              hidden_size=int(config.text_config.hidden_size))
        self.samples_per_token = int(config.audio_config.samples_per_token)
        # `MuseSparkTextModel.embed_tokens.embed_norm`: weightless, so it needs nothing from the checkpoint.
        self.embed_norm = MuseSparkRMSNorm(eps=config.text_config.rms_norm_eps, with_scale=False)

    # --- the forward -----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        if batch.modality == "audio":
            return self._audio_rows(batch).to("cpu").contiguous()
        pixels = self.to_device(batch.inputs["pixel_values"])
        grid = batch.inputs["grid_thw"].to(self.device)
        features = (self.model.get_video_features if batch.modality == "video" else self.model.get_image_features)
        return self.flat_rows(features(pixels, grid).pooler_output)

    def _audio_rows(self, batch: PreparedBatch) -> torch.Tensor:
        """`MuseSparkModel.get_audio_features` with the mask it derives from the feature extractor's."""
        values = self.to_device(batch.inputs["input_values"])
        hidden = self.model.audio_tower(input_values=values).last_hidden_state
        tokens = (batch.inputs["samples"].to(self.device) + self.samples_per_token - 1) // self.samples_per_token
        keep = torch.arange(hidden.shape[1], device=self.device)[None, :] < tokens[:, None]
        return self.embed_norm(hidden[keep])



def check_consistent(name: str, config: Any, image_processor: Any, video_processor: Any,
                     feature_extractor: Any) -> None:
    """Refuse processors that patch or pad otherwise than the towers take their inputs."""
    vision = config.vision_config
    tower = (int(vision.patch_size), int(vision.merge_size), int(vision.patch_temporal))
    for kind, processor in (("image", image_processor), ("video", video_processor)):
        theirs = (int(processor.patch_size), int(processor.merge_size), int(processor.temporal_patch_size))
        if theirs != tower:
            raise CheckpointError(f"{name}: the {kind} processor's (patch, merge, temporal patch) {theirs} does "
                                  f"not match the vision tower's {tower}: make the folder's processor settings "
                                  "(processor_config.json) match config.json's vision_config")
        if not processor.do_resize:
            raise CheckpointError(f"{name}: a {kind} processor with do_resize false is not supported: its row "
                                  "counts would not be known before preprocessing")
    samples_per_token = int(config.audio_config.samples_per_token)
    if int(feature_extractor.samples_per_token) != samples_per_token:
        raise CheckpointError(f"{name}: the feature extractor pads to {feature_extractor.samples_per_token} "
                              f"samples but the audio tower collapses {samples_per_token} into a row: set "
                              "the feature extractor's samples_per_token to the product of "
                              "audio_config.patch_sizes")


def muse_spark_from_folder(folder: Path, device: torch.device, dtype: torch.dtype) -> MuseSparkAdapter:
    """The vision and audio parts of a Muse Spark checkpoint, and its processors as `transformers` resolves them."""
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoVideoProcessor, MuseSparkConfig
    from transformers.models.muse_spark.modeling_muse_spark import MuseSparkModel

    require_torchvision("muse_spark")
    config = MuseSparkConfig.from_pretrained(folder)
    config.vision_config._attn_implementation = "sdpa"
    model = load_vision_part(folder, MuseSparkModel, config, device, dtype)
    processors = (AutoImageProcessor.from_pretrained(folder), AutoVideoProcessor.from_pretrained(folder),
                  AutoFeatureExtractor.from_pretrained(folder))
    check_consistent(folder.name, config, *processors)
    return MuseSparkAdapter(folder.name, model, config, MuseSparkProcessor(*processors), device, dtype)


def shard_muse_spark(adapter: MuseSparkAdapter, mesh: Any) -> None:
    """Every vision block: q, k, v column-wise and `proj` row-wise (whole heads per rank); `fc1` column-wise and
    `fc2` row-wise. The attention reshapes with `-1` heads, so nothing else changes."""
    from encode_server.models.sharding.blocks import check_heads, split_linears

    for layer in adapter.model.vision_tower.layers:
        layer.attn.num_heads = check_heads(layer.attn.num_heads, mesh.size(), "muse_spark")
        split_linears(layer.attn, mesh, colwise=("q_proj", "k_proj", "v_proj"), rowwise=("proj",))
        split_linears(layer.mlp, mesh, colwise=("fc1",), rowwise=("fc2",))


FAMILY = Family(
    name="muse_spark",
    model_types=("muse_spark",),
    modalities=MODALITIES,
    row_formula="image `ph*pw` (aspect-preserving grid under `max_image_tokens`); video `t*ph*pw`; audio "
                "`ceil(samples / 1920)`",
    grid_thw="the tower's patch grid `[t, 2ph, 2pw]` (`t` = 1 for an image); audio `[1, 1, rows]`; SGLang gets the "
             "merged grid, clip timestamps and audio rows",
    load=muse_spark_from_folder,
    shard=shard_muse_spark,
)
