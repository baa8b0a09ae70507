"""A server started on a Kimi K2.5, GLM-5-Next or MiniMax-M3 VL checkpoint folder answers image and video requests,
batched together, with the rows its family's adapter computes in-process (themselves checked against
`transformers` in `tests/models/test_<family>.py`); Kimi K2.5's through a preprocessing worker (the adapter's
pickled copy) and the fused forward of the items it prepares."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import numpy as np
import pytest
import torch

from encode_server.models.registry import load_checkpoint
from tests.support.checkpoints.media import CHECKPOINTS, sample_clips, sample_images
from tests.support.helpers import InProcessServer, ServerProcess, rel_diff

pytest.importorskip("torchvision", reason="these families' transformers processors need torchvision")

FLAGS = {"kimi_k25": ("--preprocess-workers", "1"), "glm5_next": (), "minimax_m3_vl": ()}


def png_b64(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("model_type", list(CHECKPOINTS))
def test_images_and_videos_batched_by_the_server_give_the_adapters_rows(model_type, tmp_path):
    _, folder = CHECKPOINTS[model_type](tmp_path / f"tiny-{model_type}")
    adapter = load_checkpoint(folder, torch.device("cpu"), torch.float32)
    images, clips = sample_images()[1:4], sample_clips()[1:3]
    requests = [("image", images[:2]), ("image", images[2:]), ("video", clips)]
    want = [adapter.forward(adapter.processor.preprocess(modality, items)) for modality, items in requests]

    async def send(url: str):
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(url + "/encode", json={
                "req_id": f"{modality}{index}", "modality": modality, "return_embedding": True,
                "mm_items": [png_b64(item) if modality == "image" else {"frames": [png_b64(f) for f in item]}
                             for item in items]}) for index, (modality, items) in enumerate(requests)))

    server_class = ServerProcess if FLAGS[model_type] else InProcessServer  # preprocessing workers are processes
    with server_class("--model", str(folder), "--max-wait-ms", "300", "--min-batch-size", "2",
                      *FLAGS[model_type]) as server:
        info = httpx.get(server.url + "/server_info").json()
        responses = asyncio.run(send(server.url))
    assert info["model"]["family"] == model_type and info["model"]["modalities"] == ["image", "video"]
    for (modality, items), response, rows in zip(requests, responses, want, strict=True):
        assert response.status_code == 200, response.text
        body = response.json()
        got = np.frombuffer(base64.b64decode(body["embedding"]), "<f4").reshape(body["embedding_shape"])
        assert got.shape == tuple(rows.shape) and rel_diff(got, rows) <= 1e-5
        assert [item["grid_thw"] for item in body["items"]] == \
            [list(adapter.processor.item_layout(modality, item).grid_thw) for item in items]
    assert responses[0].json()["batch_size"] == 2  # the two image requests were encoded together


def test_from_the_hub_only_the_encoders_bytes_are_read_and_the_rows_equal_the_local_folders(tmp_path, shared_hub):
    """By Hub id (the stand-in on loopback), each family downloads its encoder's tensors alone, Kimi K2.5's fused
    `wqkv` rows from a sharded checkpoint included, and gives the local folder's rows."""
    import json
    from pathlib import Path

    from tests.support.helpers import run_python_module
    from tests.support.hub_stand_in import expected_bytes, header_of, hub_env, weight_files

    folders = {f"org/{model_type}": build(tmp_path / model_type, **({"max_shard_size": "40KB"}
                                                                    if model_type == "kimi_k25" else {}))[1]
               for model_type, build in CHECKPOINTS.items()}
    hub, home = shared_hub
    hub.add(folders).reset_counts()
    result = run_python_module("tests.support.hub_family_check",
                               json.dumps({repo: str(folder) for repo, folder in folders.items()}),
                               env=hub_env(hub, home), timeout=500)
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = json.loads(result.stdout.splitlines()[-1])
    for repo, folder in folders.items():
        outcome = outcomes[repo]
        assert outcome["equal"] and outcome["family"] == repo.removeprefix("org/"), (repo, outcome)
        encoder_keys = set(header_of(Path(outcome["folder"]) / "model.safetensors")[1])
        all_keys = {key for keys in weight_files(folder).values() for key in keys}
        assert encoder_keys < all_keys, repo
        for name, size in expected_bytes(folder, encoder_keys).items():
            assert hub.served[(repo, name)] == size, (repo, name)
    assert any(key.endswith(".wqkv.weight") for key in header_of(
        Path(outcomes["org/kimi_k25"]["folder"]) / "model.safetensors")[1])
