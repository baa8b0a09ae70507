"""The qwen2_audio family: Qwen2-Audio audio tower and projector on mono waveforms.

A clip (mono, at the feature extractor's sampling rate) becomes a log-mel spectrogram padded to the
extractor's window (30 s in published checkpoints); its real length is `L = ceil(samples / hop)`
frames. The tower's convolution halves it and its pooler halves it again, so the clip yields
`((L - 1) // 2 + 1 - 2) // 2 + 1` rows, the formula of `_get_feat_extract_output_lengths`. The
padding is masked out of attention exactly as `Qwen2AudioModel.forward` does, and every clip is
padded to the same window, so a clip's rows do not depend on its batch neighbours.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from encode_server.models.base import EncoderAdapter, ModelInfo
from encode_server.models.builtin import seeded
from encode_server.models.family import Family
from processors.base import PreparedBatch
from processors.families.qwen2_audio import QwenAudioProcessor


class QwenAudioAdapter(EncoderAdapter):
    """Runs a `Qwen2AudioEncoder` plus `Qwen2AudioMultiModalProjector` on what `QwenAudioProcessor` prepares."""

    def __init__(self, name: str, audio_tower: torch.nn.Module, projector: torch.nn.Module, config: Any,
                 processor: QwenAudioProcessor, device: torch.device, dtype: torch.dtype) -> None:
        self.encoder = torch.nn.ModuleDict({"audio_tower": audio_tower, "multi_modal_projector": projector})
        self.encoder.to(device=device, dtype=dtype).eval()
        self.processor = processor
        self.device = device
        self.dtype = dtype
        self.info = ModelInfo(name=name, family="qwen2_audio", modalities=("audio",),
                              hidden_size=int(config.text_config.hidden_size))

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


def qwen2_audio_processor(config: Any, feature_extractor: Any) -> QwenAudioProcessor:
    """The processor of a Qwen2-Audio encoder, after checking that the extractor's window is the tower's."""
    expected = int(config.audio_config.max_source_positions) * 2
    if int(feature_extractor.nb_max_frames) != expected:
        raise ValueError(f"feature extractor window of {feature_extractor.nb_max_frames} frames does not match "
                         f"the audio tower's {expected}")
    return QwenAudioProcessor(feature_extractor)


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
                            qwen2_audio_processor(config, extractor), device, dtype)


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
    return QwenAudioAdapter("tiny-qwen2-audio", audio_tower.float(), projector.float(), config,
                            qwen2_audio_processor(config, extractor), device, dtype)


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
