"""Kimi K2.5 (`kimi_k25`): the MoonViT-3D tower and its projector as one encoder family, images and videos.

`Kimi_K25Model.get_image_features` (and `get_video_features`, the same call) runs the tower on `14 x 14`
patches with a learned position grid resampled to each item, a temporal sinusoid for multi-frame clips and
2-D rope; every item attends within itself; then each `2 x 2` patch window is averaged over the item's
frames (temporal pooling) and the projector (`mm_projector`) maps it to one row of the text width. So an
image of `h x w` patches gives `h*w/4` rows, whatever `t`, and a video is cut by its processor into chunks
of `temporal_patch_size` (4) frames, each chunk giving one frame's worth of rows.

- Images: the folder's `Kimi_K25ImageProcessor` (torchvision), which shrinks an image into its patch budget
  (`navit_resize`) and pads it to whole merged patches; grid `[1, h, w]`, `h*w/4` rows. One processor call
  and one forward for a batch (the tower packs the items and attends within each).
- Videos: the folder's `Kimi_K25VideoProcessor` (torchvision) on each clip, frames as given; grid
  `[chunks, h, w]`, `chunks = ceil(frames / temporal_patch_size)`, `chunks*h*w/4` rows. The tower gets the
  processor's per-chunk grids (`[frames in the chunk, h, w]`), as `get_video_features` does.

Published checkpoints hold the tower as `vision_tower.encoder.blocks.N.wqkv` (q, k and v fused, rope-permuted)
and the projector as `mm_projector.proj.*`; `transformers`' own conversion mapping unfuses and renames them
while only the encoder's tensors are read (`towers/vision_parts.py`). SGLang's prefill side (its
`KimiK2_5VLImageProcessor.get_mm_data`) counts an image's rows from its grid as `h*w / (merge_h*merge_w)`,
ignoring `t`; it takes images only.

Tensor parallel: each block's attention heads (`q_proj`, `k_proj`, `v_proj` by columns, `proj` by rows) and
MLP (`fc1` by columns, `fc2` by rows) are split; patch embedding, norms and projector stay whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from encode_server.models.base import ModelInfo
from encode_server.models.family import Family
from encode_server.models.layers.packed_attention import use_packed_attention_in_layers
from encode_server.models.loading.checkpoint import CheckpointError
from encode_server.models.towers.vision_parts import VisionPartAdapter, load_vision_part
from processors.base import PreparedBatch
from processors.families.kimi_k25 import KimiK25Processor
from processors.torchvision_processors import load_processors


class KimiK25Adapter(VisionPartAdapter):
    """Runs `Kimi_K25Model.get_image_features` (vision tower + projector) on fused images or video chunks."""

    def __init__(self, name: str, model: torch.nn.Module, config: Any, processor: KimiK25Processor,
                 device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(name, "kimi_k25", model, config.text_config.hidden_size, processor, device, dtype)
        self.info = ModelInfo(name=name, family="kimi_k25", modalities=("image", "video"),
                              hidden_size=int(config.text_config.hidden_size))
        self.packed_attention = use_packed_attention_in_layers(self.model.vision_tower, "attn")
        merge = tuple(int(k) for k in config.vision_config.merge_kernel_size)
        self.merge_area = merge[0] * merge[1]


    def _rows(self, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """The tower and projector on packed items or chunks of one frame count: `get_image_features` before its
        split (whose sizes, `t*h*w/4` a chunk, miss the temporal pooling in transformers 5.23: only `t = 1` splits)."""
        pooled = self.model.vision_tower(pixels, grid_thw=grid).pooler_output
        return self.model.mm_projector(pooled).squeeze(1)

    @torch.inference_mode()
    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        pixels, grid = self.to_device(batch.inputs["pixel_values"]), batch.inputs["grid_thw"].to(self.device)
        frames = grid[:, 0].tolist()
        if len(set(frames)) == 1:
            return self.flat_rows(self._rows(pixels, grid))
        # The tower pools each chunk's frames with one gather that takes a single frame count per call
        # (`get_vision_temporal_merge_index`); chunks attend and are positioned alone, so one forward per count
        # gives each chunk the rows it has alone. A batch mixes counts where a clip's last chunk is short.
        sizes = grid.prod(-1).tolist()
        starts = [sum(sizes[:index]) for index in range(len(sizes))]
        merged = [t * h * w // (t * self.merge_area) for t, h, w in grid.tolist()]
        rows: list[torch.Tensor | None] = [None] * len(sizes)
        for count in dict.fromkeys(frames):
            chosen = [index for index, n in enumerate(frames) if n == count]
            group = self._rows(torch.cat([pixels[starts[i]:starts[i] + sizes[i]] for i in chosen]), grid[chosen])
            for index, part in zip(chosen, torch.split(group, [merged[i] for i in chosen])):
                rows[index] = part
        return self.flat_rows(rows)

def check_consistent(config: Any, image_processor: Any, video_processor: Any) -> None:
    """Refuse processors whose patches or merging are not the vision tower's."""
    vision = config.vision_config
    merge = tuple(int(k) for k in vision.merge_kernel_size)
    for what, processor in (("image", image_processor), ("video", video_processor)):
        if int(processor.patch_size) != int(vision.patch_size) or (int(processor.merge_size),) * 2 != merge:
            raise CheckpointError(f"kimi_k25: the {what} processor (patch {processor.patch_size}, merge "
                                  f"{processor.merge_size}) does not match the vision tower (patch "
                                  f"{vision.patch_size}, merge kernel {list(merge)})")


def kimi_k25_from_folder(folder: Path, device: torch.device, dtype: torch.dtype) -> KimiK25Adapter:
    """The vision tower and projector of a Kimi K2.5 checkpoint; the language model is never built."""
    from transformers import AutoConfig, Kimi_K25Model

    folder = Path(folder)
    image_processor, video_processor = load_processors(folder, "kimi_k25")
    config = AutoConfig.from_pretrained(folder)
    model = load_vision_part(folder, Kimi_K25Model, config, device, dtype)
    check_consistent(config, image_processor, video_processor)
    return KimiK25Adapter(folder.name, model, config, KimiK25Processor(image_processor, video_processor), device,
                          dtype)


def shard_kimi_k25(adapter: KimiK25Adapter, mesh: Any) -> None:
    """Split every block's heads and MLP over `mesh`; refuses before changing anything if the heads do not split."""
    from encode_server.models.sharding.blocks import check_heads, split_linears

    world = mesh.size()
    layers = list(adapter.model.vision_tower.layers)
    heads = [check_heads(layer.attn.num_heads, world, "kimi_k25") for layer in layers]  # all checked first
    for layer, local in zip(layers, heads):
        layer.attn.num_heads = local
        split_linears(layer.attn, mesh, colwise=("q_proj", "k_proj", "v_proj"), rowwise=("proj",))
        split_linears(layer.mlp, mesh, colwise=("fc1",), rowwise=("fc2",))


FAMILY = Family(
    name="kimi_k25",
    model_types=("kimi_k25",),
    modalities=("image", "video"),
    row_formula="`h*w / merge^2` per image; `chunks*h*w / merge^2` per video, a chunk = `temporal_patch_size` (4) "
                "frames pooled into one frame's rows",
    grid_thw="`[1, h, w]` for an image, `[chunks, h, w]` for a video, in patches of 14 before merging (the padded "
             "canvas)",
    load=kimi_k25_from_folder,
    shard=shard_kimi_k25,
)
