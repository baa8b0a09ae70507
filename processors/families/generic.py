"""The generic path's processor: any `transformers` multimodal model's own full processor, one item at a time.

Each item goes through the full processor alone, in the prompt the start-up probes found
(`encode_server/models/generic/probes.py`), and its rows are the positions of the tokens the model fills with its
features (`filled`, measured at start-up): the layout counts them, cached by the item's size (and a video's frame
rate and indices). `preprocess` keeps each item's processed inputs (`extras["items"]`); the model's own forward
takes them, joined where the probes showed that gives each item's rows alone (`joined_inputs.py`). Items come
to the processor as the server decodes them: a video is a `VideoClip` with its source's frame rate and frame
indices, handed over unsampled with that metadata; an item that a processor takes only inside a chat request
goes in as one (`chat_request.py`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from processors.base import ItemError, ItemLayout, PreparedBatch, Processor
from processors.chat_request import ChatRequestPrompt, chat_request_inputs
from processors.torchvision_processors import clip_tensor
from processors.video_clip import VideoClip

LAYOUT_CACHE_SIZE = 4096

PROBE_IMAGES = ((72, 96), (200, 120), (130, 260))  # (height, width) of the start-up probes
PROBE_AUDIO_SECONDS = (1.3, 3.1)
PROBE_CLIPS = ((4, 72, 96), (8, 120, 80))  # (frames, height, width)
PROBE_CLIP_FPS = 2.0
MODALITY_PROCESSORS = {"image": ("image_processor",), "audio": ("feature_extractor", "audio_processor"),
                       "video": ("video_processor",)}


class GenericProcessor(Processor):
    """A model's full processor on one item at a time; rows counted at the tokens the model fills."""

    def __init__(self, name: str, full: Any, forward_inputs: set[str]) -> None:
        self.name = name
        self.full = full  # the folder's full processor (`AutoProcessor`)
        self.forward_inputs = forward_inputs  # the keyword arguments of the model's forward
        self.prompts: dict[str, str] = {}  # modality -> the prompt its probes passed with
        self.filled: dict[str, torch.Tensor] = {}  # modality -> the token ids the model fills
        self.layouts: OrderedDict[tuple, ItemLayout] = OrderedDict()
        self._last_processed: tuple[Any, dict[str, Any]] | None = None
        extractor = self._part("audio")
        self.sampling_rate = int(getattr(extractor, "sampling_rate", 16000) or 16000)

    @property
    def modalities(self) -> tuple[str, ...]:  # type: ignore[override]
        """The modalities the start-up probes found served."""
        return tuple(self.filled)

    def _part(self, modality: str) -> Any:
        for attribute in MODALITY_PROCESSORS[modality]:
            part = getattr(self.full, attribute, None)
            if part is not None:
                return part
        return None

    # --- items through the processor -------------------------------------------------------------------

    def _check_item(self, modality: str, item: Any, index: int = 0) -> None:
        if modality == "image" and not isinstance(item, Image.Image):
            raise ItemError(f"item {index}: expected an image, got {type(item).__name__}")
        if modality == "audio" and not (isinstance(item, np.ndarray) and item.ndim == 1):
            raise ItemError(f"item {index}: expected a mono waveform, got {type(item).__name__}")
        if modality == "video" and not (isinstance(item, list) and item
                                        and all(isinstance(frame, Image.Image) for frame in item)):
            raise ItemError(f"item {index}: expected a video's frames, got {type(item).__name__}")

    def _process(self, modality: str, item: Any, prompt: str) -> dict[str, Any]:
        if isinstance(prompt, ChatRequestPrompt):
            processed = chat_request_inputs(self.full, modality, item, self.sampling_rate)
            return {key: value for key, value in processed.items()
                    if key in self.forward_inputs or key.endswith("input_ids")}
        if modality == "image":
            media = {"images": [item]}
        elif modality == "video":  # the frames as the server sampled them, with where they come from
            from transformers.video_utils import VideoMetadata

            fps = getattr(item, "fps", PROBE_CLIP_FPS)
            indices = list(getattr(item, "frames_indices", range(len(item))))
            media = {"videos": [clip_tensor(item)], "do_sample_frames": False, "return_metadata": True,
                     "video_metadata": [VideoMetadata(
                total_num_frames=len(item), fps=fps, frames_indices=indices, duration=len(item) / fps)]}
        else:
            media = {"audio": [item], "sampling_rate": self.sampling_rate}
        if "mm_token_type_ids" in self.forward_inputs:  # the multimodal RoPE of some models reads it
            media["return_mm_token_type_ids"] = True
        processed = self.full(text=[prompt], **media, return_tensors="pt")
        return {key: value for key, value in processed.items()
                if key in self.forward_inputs or key.endswith("input_ids")}

    def positions(self, modality: str, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.isin(input_ids[0], self.filled[modality]).nonzero().flatten()

    def _layout_key(self, modality: str, item: Any) -> tuple:
        if modality == "video":
            return (modality, len(item), item[0].size, getattr(item, "fps", None),
                    tuple(getattr(item, "frames_indices", ())))
        return (modality, item.size) if modality == "image" else (modality, int(item.shape[0]))

    def item_layout(self, modality: str, item: Any) -> ItemLayout:
        if modality not in self.filled:
            raise ItemError(f"{self.name} does not encode {modality}")
        self._check_item(modality, item)
        key = self._layout_key(modality, item)
        layout = self.layouts.get(key)
        if layout is None:
            processed = self._process(modality, item, self.prompts[modality])
            self._last_processed = (item, processed)  # `preprocess` of this same item (next, as a rule) reuses it
            tokens = int(self.positions(modality, processed["input_ids"]).numel())
            layout = ItemLayout(tokens=tokens, grid_thw=(1, 1, tokens))
            self.layouts[key] = layout
            if len(self.layouts) > LAYOUT_CACHE_SIZE:
                self.layouts.popitem(last=False)
        return layout

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_last_processed": None}  # a worker's copy starts without another's item

    def _prepare_one(self, modality: str, item: Any) -> tuple[dict[str, Any], ItemLayout]:
        last = self._last_processed
        if last is not None and last[0] is item:
            processed = last[1]
        else:
            processed = self._process(modality, item, self.prompts[modality])
        tokens = int(self.positions(modality, processed["input_ids"]).numel())
        if tokens == 0:
            raise ItemError(f"the processor inserted no {modality} placeholder for this item")
        return processed, ItemLayout(tokens=tokens, grid_thw=(1, 1, tokens))

    def preprocess(self, modality: str, items: Sequence[Any]) -> PreparedBatch:
        if modality not in self.filled:
            raise ItemError(f"{self.name} does not encode {modality}")
        for index, item in enumerate(items):
            self._check_item(modality, item, index)
        prepared = [self._prepare_one(modality, item) for item in items]
        return PreparedBatch(modality=modality, inputs={}, layouts=[layout for _, layout in prepared],
                             extras={"items": [inputs for inputs, _ in prepared]})

    def collate(self, batches: Sequence[PreparedBatch]) -> PreparedBatch:
        """Per-item batches joined in order (generic items are never padded together)."""
        return PreparedBatch(modality=batches[0].modality, inputs={},
                             layouts=[layout for batch in batches for layout in batch.layouts],
                             extras={"items": [inputs for batch in batches for inputs in batch.extras["items"]]})

    def sample_item(self) -> tuple[str, Any]:
        modality = self.modalities[0]
        return modality, probe_items(modality, self.sampling_rate)[0][0]


def probe_items(modality: str, sampling_rate: int) -> list[tuple[Any, Any]]:
    """Start-up probes: pairs of images of several shapes (audio clips of several lengths, videos of several
    frame counts and sizes), the two of a pair of the same size and different content (fixed seeds)."""
    def image(seed: int, height: int, width: int) -> Image.Image:
        return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))

    def clip(seed: int, seconds: float) -> np.ndarray:
        return (np.random.default_rng(seed).standard_normal(int(seconds * sampling_rate)) * 0.1).astype(np.float32)

    if modality == "image":
        return [(image(seed, *size), image(seed + 100, *size)) for seed, size in enumerate(PROBE_IMAGES)]
    if modality == "video":
        return [(VideoClip([image(seed * 10 + f, h, w) for f in range(frames)], PROBE_CLIP_FPS, range(frames)),
                 VideoClip([image(seed * 10 + f + 100, h, w) for f in range(frames)], PROBE_CLIP_FPS, range(frames)))
                for seed, (frames, h, w) in enumerate(PROBE_CLIPS)]
    return [(clip(seed, seconds), clip(seed + 100, seconds)) for seed, seconds in enumerate(PROBE_AUDIO_SECONDS)]
