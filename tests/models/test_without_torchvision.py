"""Where torchvision is missing (hidden here in a subprocess), transformers falls back to its PIL
processors: the server's families still serve them exactly, and say which backend they run."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.helpers import ROOT, WITHOUT_TORCHVISION

PARITY_ON_PIL = """
import sys
from pathlib import Path

import torch
from transformers.utils import is_torchvision_available

from encode_server.models.registry import load_checkpoint
from tests.support.checkpoints.internvl import internvl_checkpoint
from tests.support.checkpoints.qwen_vl import qwen25_vl_checkpoint
from tests.support.helpers import rel_diff
from tests.support.checkpoints.internvl import internvl_reference
from tests.support.checkpoints.qwen_vl import qwen_reference
from tests.support.tiny_parts import random_image

assert not is_torchvision_available()
work = Path(sys.argv[1])
for build, reference, sizes in (
        (qwen25_vl_checkpoint, qwen_reference, [(56, 56), (90, 40), (130, 200)]),
        (internvl_checkpoint, internvl_reference, [(40, 40), (160, 50), (30, 120)])):
    model, processor, folder = build(work / build.__name__)
    assert type(processor).__name__.endswith("Pil"), type(processor).__name__
    adapter = load_checkpoint(folder, torch.device("cpu"), torch.float32)
    images = [random_image(w, h, seed) for seed, (w, h) in enumerate(sizes)]
    got = adapter.forward(adapter.processor.preprocess("image", images))
    difference = rel_diff(got, reference(model, processor, images))
    assert difference <= 1e-5, (build.__name__, difference)
    print(build.__name__, type(processor).__name__, "rows", got.shape[0], "exact")
"""


def test_families_serve_transformers_pil_processors_exactly_without_torchvision(tmp_path):
    result = subprocess.run([sys.executable, "-c", PARITY_ON_PIL, str(tmp_path)], cwd=ROOT,
                            env={**os.environ, **WITHOUT_TORCHVISION}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("exact") == 2, result.stdout
