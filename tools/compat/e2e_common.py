"""What the whole-engine end-to-end tools (`tools/compat/e2e_sglang.py`, `tools/compat/e2e_vllm.py`) share.

Each tool runs in the project's venv and starts every process itself, on free loopback ports: this server
(`python -m encode_server`, from the project's venv), the engine (from its side venv, built by
`tools/compat/e2e_sglang.sh` or `tools/compat/e2e_vllm.sh`), and for vLLM its example proxy. Here: the
processes (their output in a log file each, stopped by signal to their own process group), the tiny
checkpoint both sides load (a Qwen2-VL of two layers, saved with `save_pretrained`, its full processor and an
offline byte-level tokenizer: tests/support/checkpoints/prompts.py), the control checkpoint (the same, its
vision tower's weights changed, so the rows it gives differ), the images, and the pass/fail lines.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: (check, passed, detail), in order.
RESULTS: list[tuple[str, bool, str]] = []
#: (what, seconds), in order: start times and per-request times.
FIGURES: list[tuple[str, float]] = []


def record(check: str, ok: bool, detail: str = "") -> bool:
    RESULTS.append((check, ok, detail))
    print(f"[{'PASS' if ok else 'FAIL'}] {check}{': ' + detail if detail else ''}", flush=True)
    return ok


def figure(what: str, seconds: float) -> None:
    FIGURES.append((what, seconds))
    print(f"[time] {what}: {seconds:.2f} s", flush=True)


def summary() -> int:
    """The figures and the checks again, and the exit status: 0 when every check passed."""
    print("\n| figure | seconds |\n| --- | --- |")
    for what, seconds in FIGURES:
        print(f"| {what} | {seconds:.2f} |")
    passed = sum(ok for _, ok, _ in RESULTS)
    print(f"\n{passed} passed, {len(RESULTS) - passed} failed")
    return 0 if RESULTS and passed == len(RESULTS) else 1


def stop_on_sigterm() -> None:
    """SIGTERM ends the tool as an exception would, so every process it started is stopped on the way out (a tool
    started in the background from a shell ignores SIGINT)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Process:
    """A command in its own process group, its output in `log`; `ready()` waits for an HTTP GET to answer 200."""

    def __init__(self, name: str, command: list[str], log: Path, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.name, self.command, self.log = name, command, log
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def __enter__(self) -> Process:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        sink = open(self.log, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.command, stdout=sink, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=self.cwd, start_new_session=True)
        sink.close()
        return self

    def ready(self, url: str, timeout: float) -> float:
        """Seconds from the start until `url` answered 200; raises with the log's tail if it exits, or if `timeout`
        seconds from now pass."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(url, timeout=5).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not answer {url} within {timeout:g} s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __exit__(self, *exc) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # children the engine left in its group (schedulers, detokenizers)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def encode_server(name: str, port: int, work: Path, *args: str, python: str | None = None,
                  root: Path | None = None) -> Process:
    """This server from the project's venv (`python`, default this interpreter), the checkout `root` (default this
    one) first on its path."""
    root = root or ROOT
    env = {"PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return Process(name, [python or sys.executable, "-m", "encode_server", "--host", "127.0.0.1", "--port",
                          str(port), *args], work / f"{name}.log", env=env, cwd=root)


# --- the checkpoints --------------------------------------------------------------------------------

#: vLLM's chat parsing puts each image's placeholder into the text itself when the template takes the
#: content as a string; a template of its own keeps the prompt free of words the byte-level tokenizer would
#: spell out differently on each side.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def build_checkpoint(folder: Path) -> Path:
    """The tiny Qwen2-VL (language model included, two layers each) with its full processor, the offline
    byte-level tokenizer of tests/support/checkpoints/prompts.py and a chat template. Its attention heads are 64
    wide (vLLM's CPU attention takes only some head sizes) and its M-RoPE sections add up to half of that (both
    engines assert it; `transformers` does not)."""
    if (folder / "config.json").exists() and (folder / "chat_template.jinja").exists():
        return folder
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.support.checkpoints.prompts import (
        ARCHITECTURES,
        VISION_TOKENS,
        _qwen2_video_processor,
        _vision_token_ids,
        byte_level_tokenizer,
    )

    config = Qwen2VLConfig(
        text_config=dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12],
                                          "rope_theta": 10000.0}),
        vision_config=dict(depth=2, embed_dim=64, hidden_size=128, num_heads=4, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
    )
    torch.manual_seed(11)
    model = Qwen2VLForConditionalGeneration(config).eval()
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 48)
    tokenizer = byte_level_tokenizer(VISION_TOKENS)
    processor = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                 video_processor=_qwen2_video_processor(image_processor))
    _vision_token_ids(model.config, tokenizer)
    model.config.architectures = [ARCHITECTURES["qwen2_vl"]]
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    # The vision config's keys as published Qwen2-VL checkpoints spell them, which SGLang 0.5.23 reads
    # (`vision_config.in_chans`); `transformers` 5.20 and later save only `in_channels`.
    saved = json.loads((folder / "config.json").read_text())
    saved["vision_config"].update(in_chans=saved["vision_config"]["in_channels"], spatial_patch_size=14)
    (folder / "config.json").write_text(json.dumps(saved, indent=2))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    return folder


def build_control(folder: Path, control: Path) -> Path:
    """A copy of `folder` whose vision tower weights are negated and scaled: the same language model, other rows."""
    import shutil

    from safetensors.torch import load_file, save_file

    if (control / "config.json").exists():
        return control
    shutil.copytree(folder, control)
    for file in control.glob("*.safetensors"):
        tensors = load_file(file)
        changed = {name: (-1.5 * tensor if "visual" in name else tensor).contiguous()
                   for name, tensor in tensors.items()}
        if not any("visual" in name for name in tensors):
            continue
        save_file(changed, file, metadata={"format": "pt"})
    return control


# --- the images -------------------------------------------------------------------------------------


def png(width: int, height: int, seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def transparent_png(width: int, height: int, seed: int) -> bytes:
    """An RGB PNG with a `tRNS` chunk (one colour transparent), the kind vLLM 0.32 and 0.33 identify differently."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    pixels[: height // 2, : width // 2] = (10, 20, 30)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG", transparency=(10, 20, 30))
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()
