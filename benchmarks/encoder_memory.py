"""How much memory loading only the encoder of a checkpoint costs, against the encoder's weights.

Saves a Qwen2.5-VL checkpoint whose language model is far larger than its vision tower, then, in a
fresh process, loads the encoder with `encode_server.models.registry.load_checkpoint` and reports the growth
of resident memory (VmRSS and peak VmHWM from /proc/self/status).

    python benchmarks/encoder_memory.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def save_checkpoint(folder: Path) -> None:
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
                         num_attention_heads=16, num_key_value_heads=4,
                         rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24],
                                          "rope_theta": 10000.0}),
        vision_config=dict(depth=4, hidden_size=256, intermediate_size=512, num_heads=4, out_hidden_size=1024,
                           fullatt_block_indexes=[3]),
    )
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(folder, max_shard_size="200MB")
    Qwen2VLImageProcessorPil().save_pretrained(folder)


def rss_mib() -> tuple[float, float]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def measure(folder: Path) -> dict:
    import torch

    # Import the family's code first, so the growth measured is the weights, not Python modules.
    from transformers import AutoImageProcessor, Qwen2_5_VLConfig  # noqa: F401
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl  # noqa: F401
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl  # noqa: F401

    from encode_server.models.registry import load_checkpoint

    before, _ = rss_mib()
    adapter = load_checkpoint(folder, torch.device("cpu"), torch.float32)
    after, peak = rss_mib()
    encoder_bytes = sum(t.numel() * t.element_size() for t in adapter.encoder.state_dict().values())
    checkpoint_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return {"checkpoint_mib": checkpoint_bytes / 2**20, "encoder_weights_mib": encoder_bytes / 2**20,
            "rss_growth_mib": after - before, "peak_growth_mib": peak - before}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--measure":
        print(json.dumps(measure(Path(sys.argv[2]))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "big-lm-small-tower"
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
                        f"from benchmarks.encoder_memory import save_checkpoint; "
                        f"from pathlib import Path; save_checkpoint(Path({str(folder)!r}))"], check=True, cwd=ROOT)
        out = subprocess.run([sys.executable, __file__, "--measure", str(folder)], check=True, cwd=ROOT,
                             capture_output=True, text=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        print(f"checkpoint on disk:      {result['checkpoint_mib']:8.1f} MiB (language model included)")
        print(f"encoder weights:         {result['encoder_weights_mib']:8.1f} MiB")
        print(f"resident growth on load: {result['rss_growth_mib']:8.1f} MiB (peak {result['peak_growth_mib']:.1f})")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
