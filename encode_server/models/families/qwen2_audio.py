"""The qwen2_audio family: Qwen2-Audio audio tower and projector on mono waveforms.

A clip (mono, at the feature extractor's sampling rate) becomes a log-mel spectrogram padded to the
extractor's window (30 s in published checkpoints); its real length is `L = ceil(samples / hop)`
frames. The tower's convolution halves it and its pooler halves it again, so the clip yields
`((L - 1) // 2 + 1 - 2) // 2 + 1` rows, the formula of `_get_feat_extract_output_lengths`. The
padding is masked out of attention exactly as `Qwen2AudioModel.forward` does, and every clip is
padded to the same window, so a clip's rows do not depend on its batch neighbours.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from encode_server.models.base import EncoderAdapter, ItemError, ItemLayout, ModelInfo, PreparedBatch
from encode_server.models.builtin import seeded
from encode_server.models.family import Family


def audio_output_rows(frames: int) -> int:
    """Rows the audio tower yields for `frames` mel frames (conv stride 2, then avg-pool 2)."""
    after_conv = (frames - 1) // 2 + 1
    return max(0, (after_conv - 2) // 2 + 1)


class QwenAudioAdapter(EncoderAdapter):
    """Runs a `Qwen2AudioEncoder` plus `Qwen2AudioMultiModalProjector` on waveforms."""

    def __init__(self, name: str, audio_tower: torch.nn.Module, projector: torch.nn.Module, config: Any,
                 feature_extractor: Any, device: torch.device, dtype: torch.dtype) -> None:
        self.encoder = torch.nn.ModuleDict({"audio_tower": audio_tower, "multi_modal_projector": projector})
        self.encoder.to(device=device, dtype=dtype).eval()
        self.feature_extractor = feature_extractor
        self.device = device
        self.dtype = dtype
        self.sampling_rate = int(feature_extractor.sampling_rate)
        self.hop_length = int(feature_extractor.hop_length)
        self.window_samples = int(feature_extractor.n_samples)
        self.max_seconds = self.window_samples / self.sampling_rate
        expected = int(config.audio_config.max_source_positions) * 2
        if int(feature_extractor.nb_max_frames) != expected:
            raise ValueError(f"feature extractor window of {feature_extractor.nb_max_frames} frames does not match "
                             f"the audio tower's {expected}")
        self.info = ModelInfo(name=name, family="qwen2_audio", modalities=("audio",),
                              hidden_size=int(config.text_config.hidden_size))

    def sample_item(self) -> tuple[str, Any]:
        return "audio", np.zeros(self.sampling_rate // 10, dtype=np.float32)

    def item_layout(self, modality: str, item: Any) -> ItemLayout:
        if not isinstance(item, np.ndarray) or item.ndim != 1:
            raise ItemError("expected a mono waveform")
        if item.shape[0] > self.window_samples:
            raise ItemError(f"audio of {item.shape[0] / self.sampling_rate:.2f} s is longer than the model's "
                            f"window of {self.max_seconds:g} s: send it as several clips of at most that "
                            "(one item each)")
        frames = -(-item.shape[0] // self.hop_length)
        rows = audio_output_rows(frames)
        if rows < 1:
            raise ItemError(f"audio of {item.shape[0]} samples is too short to yield an embedding")
        return ItemLayout(tokens=rows, grid_thw=(1, 1, rows), mel_frames=frames)

    def preprocess(self, modality: str, items: Sequence[Any]) -> PreparedBatch:
        features = self.feature_extractor(
            list(items), sampling_rate=self.sampling_rate, return_attention_mask=True, padding="max_length",
            return_tensors="pt")
        frames = features["attention_mask"].sum(-1)
        rows = [audio_output_rows(int(n)) for n in frames]
        return PreparedBatch(modality=modality, layouts=[ItemLayout(tokens=r, grid_thw=(1, 1, r), mel_frames=int(n))
                                                         for r, n in zip(rows, frames)],
                             inputs={"input_features": features["input_features"], "frames": frames})

    @torch.inference_mode()
    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        from transformers.masking_utils import create_bidirectional_mask

        tower, projector = self.encoder["audio_tower"], self.encoder["multi_modal_projector"]
        features = batch.inputs["input_features"].to(device=self.device, dtype=self.dtype)
        frames = batch.inputs["frames"].to(self.device)
        conv_lengths = (frames - 1) // 2 + 1
        clips, _, mel_frames = features.shape
        positions = (mel_frames - 2) // 2 + 1
        keep = torch.arange(positions, device=self.device)[None, :] < conv_lengths[:, None]
        mask = create_bidirectional_mask(
            config=tower.config,
            inputs_embeds=torch.zeros((clips, positions, 1), dtype=self.dtype, device=self.device),
            attention_mask=keep.to(torch.long),
        )
        hidden = projector(tower(features, attention_mask=mask).last_hidden_state)
        rows = [hidden[index, :layout.tokens] for index, layout in enumerate(batch.layouts)]
        return torch.cat(rows).to("cpu").contiguous()


def build_qwen2_audio_encoder(config: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The audio tower and projector of a `Qwen2AudioConfig` (no language model)."""
    from transformers.models.qwen2_audio.modeling_qwen2_audio import (
        Qwen2AudioEncoder,
        Qwen2AudioMultiModalProjector,
    )

    config.audio_config._attn_implementation = "sdpa"
    return Qwen2AudioEncoder._from_config(config.audio_config), Qwen2AudioMultiModalProjector(config)


def qwen2_audio_from_folder(folder: Path, device: torch.device, dtype: torch.dtype) -> QwenAudioAdapter:
    """The audio tower and projector of a Qwen2-Audio checkpoint."""
    from transformers import AutoFeatureExtractor, Qwen2AudioConfig

    from encode_server.models.loading.checkpoint import load_encoder_modules

    config = Qwen2AudioConfig.from_pretrained(folder)
    modules = load_encoder_modules(folder, lambda: dict(zip(("audio_tower", "multi_modal_projector"),
                                                            build_qwen2_audio_encoder(config))))
    extractor = AutoFeatureExtractor.from_pretrained(folder)
    return QwenAudioAdapter(folder.name, modules["audio_tower"], modules["multi_modal_projector"], config,
                            extractor, device, dtype)


def tiny_qwen2_audio_config():
    from transformers import Qwen2AudioConfig

    return Qwen2AudioConfig(
        audio_config=dict(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
                          num_mel_bins=80, max_source_positions=500),
        text_config=dict(model_type="qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
    )


def tiny_qwen2_audio(device: torch.device, dtype: torch.dtype) -> QwenAudioAdapter:
    """`tiny-qwen2-audio`: 2 layers, width 64, 80 mel bins, a 10 s window; Whisper features at 16 kHz."""
    from transformers import WhisperFeatureExtractor

    config = tiny_qwen2_audio_config()
    audio_tower, projector = seeded(lambda: build_qwen2_audio_encoder(config))
    extractor = WhisperFeatureExtractor(feature_size=80, sampling_rate=16000, hop_length=160, chunk_length=10)
    return QwenAudioAdapter("tiny-qwen2-audio", audio_tower.float(), projector.float(), config, extractor,
                            device, dtype)


def shard_qwen2_audio(adapter: QwenAudioAdapter, mesh: Any) -> None:
    """Every layer: q, k, v column-wise and `out_proj` row-wise; fc1 column-wise and fc2 row-wise."""
    from encode_server.models.sharding.blocks import check_heads, split_linears

    for layer in adapter.encoder["audio_tower"].layers:
        attention = layer.self_attn
        attention.num_heads = check_heads(attention.num_heads, mesh.size(), "qwen2_audio")
        split_linears(attention, mesh, colwise=["q_proj", "k_proj", "v_proj"], rowwise=["out_proj"])
        split_linears(layer, mesh, colwise=["fc1"], rowwise=["fc2"])


FAMILY = Family(
    name="qwen2_audio",
    model_types=("qwen2_audio",),
    modalities=("audio",),
    row_formula="`((L-1)//2 + 1 - 2)//2 + 1`, `L` = mel frames",
    grid_thw="`[1, 1, rows]`",
    load=qwen2_audio_from_folder,
    builtins={"tiny-qwen2-audio": tiny_qwen2_audio},
    shard=shard_qwen2_audio,
)
