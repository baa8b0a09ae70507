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

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from encode_server.models.base import ItemError, ItemLayout, ModelInfo, PreparedBatch
from encode_server.models.family import Family
from encode_server.models.loading.checkpoint import CheckpointError
from encode_server.models.towers.vision_parts import VisionPartAdapter, load_vision_part, require_torchvision

MODALITIES = ("image", "video", "audio")


class MuseSparkAdapter(VisionPartAdapter):
    """Runs `MuseSparkModel`'s vision and audio parts (no language model) on images, videos and waveforms."""

    def __init__(self, name: str, model: torch.nn.Module, config: Any, image_processor: Any, video_processor: Any,
                 feature_extractor: Any, device: torch.device, dtype: torch.dtype) -> None:
        from transformers.models.muse_spark.modeling_muse_spark import MuseSparkRMSNorm

        super().__init__(name, "muse_spark", model, config.text_config.hidden_size, device, dtype)
        self.info = ModelInfo(name=name, family="muse_spark", modalities=MODALITIES,
                              hidden_size=int(config.text_config.hidden_size))
        vision = config.vision_config
        self.patch_size, self.merge_size = int(vision.patch_size), int(vision.merge_size)
        self.temporal_patch_size = int(vision.patch_temporal)
        tower = (self.patch_size, self.merge_size, self.temporal_patch_size)
        for kind, processor in (("image", image_processor), ("video", video_processor)):
            theirs = (int(processor.patch_size), int(processor.merge_size), int(processor.temporal_patch_size))
            if theirs != tower:
                raise CheckpointError(f"{name}: the {kind} processor's (patch, merge, temporal patch) {theirs} does "
                                      f"not match the vision tower's {tower}: make the folder's processor settings "
                                      "(processor_config.json) match config.json's vision_config")
            if not processor.do_resize:
                raise CheckpointError(f"{name}: a {kind} processor with do_resize false is not supported: its row "
                                      "counts would not be known before preprocessing")
        self.image_processor, self.video_processor = image_processor, video_processor
        self.max_image_tokens = int(image_processor.max_image_tokens)
        self.max_frame_tokens = int(video_processor.max_video_frame_tokens)
        self.samples_per_token = int(config.audio_config.samples_per_token)
        if int(feature_extractor.samples_per_token) != self.samples_per_token:
            raise CheckpointError(f"{name}: the feature extractor pads to {feature_extractor.samples_per_token} "
                                  f"samples but the audio tower collapses {self.samples_per_token} into a row: set "
                                  "the feature extractor's samples_per_token to the product of "
                                  "audio_config.patch_sizes")
        self.feature_extractor = feature_extractor
        self.sampling_rate = int(feature_extractor.sampling_rate)
        # `MuseSparkTextModel.embed_tokens.embed_norm`: weightless, so it needs nothing from the checkpoint.
        self.embed_norm = MuseSparkRMSNorm(eps=config.text_config.rms_norm_eps, with_scale=False)

    def sample_item(self) -> tuple[str, Any]:
        return "image", Image.new("RGB", (64, 48), (128, 128, 128))

    # --- layouts ---------------------------------------------------------------------------------

    def _patches(self, width: int, height: int, max_tokens: int) -> tuple[int, int]:
        """The merged-token grid `(ph, pw)` the processors resize an image or frame of this size to."""
        from transformers.models.muse_glimmer.image_processing_muse_glimmer import smart_resize

        block = self.patch_size * self.merge_size
        resized_h, resized_w = smart_resize(height=height, width=width, patch_size=block, max_tokens=max_tokens)
        return resized_h // block, resized_w // block

    def _vision_layout(self, clips: int | None, ph: int, pw: int) -> ItemLayout:
        """An image (`clips` None) or a video of `clips` temporal clips, `ph x pw` merged tokens each."""
        m, t = self.merge_size, clips or 1
        frames = None if clips is None else tuple(float(k * self.temporal_patch_size) for k in range(clips))
        return ItemLayout(tokens=t * ph * pw, grid_thw=(t, ph * m, pw * m), receiver_grid=(t, ph, pw),
                          clip_frames=frames)

    def _audio_layout(self, samples: int) -> ItemLayout:
        rows = -(-samples // self.samples_per_token)
        return ItemLayout(tokens=rows, grid_thw=(1, 1, rows), receiver_grid=rows)

    def item_layout(self, modality: str, item: Any) -> ItemLayout:
        if modality == "audio":
            if not isinstance(item, np.ndarray) or item.ndim != 1:
                raise ItemError("expected a mono waveform")
            if item.shape[0] == 0:
                raise ItemError("audio of 0 samples yields no embedding: send a clip that holds samples")
            return self._audio_layout(int(item.shape[0]))
        if modality == "video":
            frames = check_frames(item)
            ph, pw = self._patches(*frames[0].size, self.max_frame_tokens)
            return self._vision_layout(-(-len(frames) // self.temporal_patch_size), ph, pw)
        if not isinstance(item, Image.Image):
            raise ItemError(f"expected an image, got {type(item).__name__}")
        return self._vision_layout(None, *self._patches(*item.size, self.max_image_tokens))

    # --- preprocessing ---------------------------------------------------------------------------

    def preprocess(self, modality: str, items: Sequence[Any]) -> PreparedBatch:
        if modality == "audio":
            features = self.feature_extractor(list(items), sampling_rate=self.sampling_rate, padding="longest",
                                              return_attention_mask=True, return_tensors="pt")
            samples = features["input_values_mask"].sum(-1)
            return PreparedBatch(modality=modality, layouts=[self._audio_layout(int(n)) for n in samples],
                                 inputs={"input_values": features["input_values"], "samples": samples})
        if modality == "video":
            videos = [check_frames(frames) for frames in items]
            processed = self.video_processor(videos=videos, do_sample_frames=False, return_tensors="pt")
            pixels, grid = processed["pixel_values_videos"], processed["video_grid_thw"]
        else:
            processed = self.image_processor(images=list(items), return_tensors="pt")
            pixels, grid = processed["pixel_values"], processed["image_grid_thw"]
        m = self.merge_size
        layouts = [self._vision_layout(t if modality == "video" else None, h // m, w // m)
                   for t, h, w in grid.tolist()]
        return PreparedBatch(modality=modality, layouts=layouts, inputs={"pixel_values": pixels, "grid_thw": grid})

    def collate(self, batches: Sequence[PreparedBatch]) -> PreparedBatch:
        """Audio clips are padded with zeros to the longest, as the feature extractor pads a batch."""
        if len(batches) < 2 or batches[0].modality != "audio":
            return super().collate(batches)
        length = max(batch.inputs["input_values"].shape[1] for batch in batches)
        values = torch.cat([torch.nn.functional.pad(batch.inputs["input_values"],
                                                    (0, length - batch.inputs["input_values"].shape[1]))
                            for batch in batches])
        return PreparedBatch(modality="audio", layouts=[layout for batch in batches for layout in batch.layouts],
                             inputs={"input_values": values,
                                     "samples": torch.cat([batch.inputs["samples"] for batch in batches])})

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



def check_frames(item: Any) -> list[Image.Image]:
    """A video as a non-empty list of frames of one size (the video processor stacks them), or an ItemError."""
    if not isinstance(item, list) or not item or not all(isinstance(frame, Image.Image) for frame in item):
        raise ItemError("expected a video as a non-empty list of frames")
    sizes = {frame.size for frame in item}
    if len(sizes) > 1:
        raise ItemError(f"video frames must all have one size, got {sorted(sizes)}: send the frames of one video "
                        "at one size")
    return item


def muse_spark_from_folder(folder: Path, device: torch.device, dtype: torch.dtype) -> MuseSparkAdapter:
    """The vision and audio parts of a Muse Spark checkpoint, and its processors as `transformers` resolves them."""
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoVideoProcessor, MuseSparkConfig
    from transformers.models.muse_spark.modeling_muse_spark import MuseSparkModel

    require_torchvision("muse_spark")
    config = MuseSparkConfig.from_pretrained(folder)
    config.vision_config._attn_implementation = "sdpa"
    model = load_vision_part(folder, MuseSparkModel, config, device, dtype)
    return MuseSparkAdapter(folder.name, model, config, AutoImageProcessor.from_pretrained(folder),
                            AutoVideoProcessor.from_pretrained(folder), AutoFeatureExtractor.from_pretrained(folder),
                            device, dtype)


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
