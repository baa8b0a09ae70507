"""`--model org/name[@revision]`: a model by Hub id, of which only the encoder's bytes are downloaded.

No internet: `tests/support/hub_stand_in.py` serves tiny checkpoints (full models saved with `save_pretrained`,
language model included, with their processor and tokenizer) on loopback in the Hub's file API, and
`HF_ENDPOINT` points at it. The tests share one stand-in and one `HF_HOME` (`shared_hub`: the processes of one
environment fork from one zygote), and each test downloads its own repo ids, so that no test finds another's
download in the cache. The stand-in counts the bytes it serves per file, so the tests check that the weights
were read only in the encoder's byte ranges.
"""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.support.checkpoints.internvl import internvl_checkpoint
from tests.support.checkpoints.qwen2_audio import qwen2_audio_checkpoint
from tests.support.checkpoints.qwen_vl import QWEN_VL_TOKENS, qwen25_vl_checkpoint
from tests.support.helpers import ServerProcess, run_python_module
from tests.support.hub_stand_in import commit_of, expected_bytes, header_of, hub_env, weight_files
from tests.support.tiny_parts import random_image, tiny_tokenizer

OFFLINE_MESSAGE = ("is not in the local Hugging Face cache and HF_HUB_OFFLINE=1 is set: run once with network access, "
                   "or pass a local folder")


# --- fixtures ------------------------------------------------------------------------------------

def with_tokenizer(folder: Path) -> Path:
    """A Qwen-VL folder as published: its tokenizer (knowing the vision tokens) and a chat template too."""
    tokenizer = tiny_tokenizer(plain=QWEN_VL_TOKENS)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> dict[str, Path]:
    """Hub id -> the full local folder it serves."""
    root = tmp_path_factory.mktemp("hub-repos")
    return {
        "org/tiny": with_tokenizer(qwen25_vl_checkpoint(root / "tiny")[2]),
        "org/tiny-sharded": with_tokenizer(qwen25_vl_checkpoint(root / "sharded", max_shard_size="200KB")[2]),
    }


@pytest.fixture(scope="module")
def stand_in(repos, shared_hub, tmp_path_factory):
    """The test worker's stand-in (`shared_hub`), so that every test's processes have the same `HF_ENDPOINT` and
    fork from the same zygote (a new environment costs a new one: seconds of imports). Each test asks for its own
    repo ids, so that what one test downloads is never another's cache hit."""
    no_weights = tmp_path_factory.mktemp("no-weights")  # a repository with a config but no safetensors (say, .bin)
    (no_weights / "config.json").write_text((repos["org/tiny"] / "config.json").read_text())
    tiny = repos["org/tiny"]
    return shared_hub[0].add({**repos, "org/tiny-dp": tiny, "org/tiny-offline": tiny, "org/gated": tiny,
                              "org/bin-only": no_weights}, gated={"org/gated": "hf_secret"})


@pytest.fixture(scope="module")
def home(shared_hub) -> Path:
    """The `HF_HOME` (the Hub cache and the encoders' folders), shared like the stand-in."""
    return shared_hub[1]


@pytest.fixture
def hub(stand_in):
    """The module's stand-in, its counts zeroed for this test."""
    stand_in.reset_counts()
    return stand_in


def start_fails(model: str, env: dict[str, str]) -> str:
    """Start the server with `--model model`; it must exit non-zero. Its stderr."""
    result = run_python_module("encode_server", "--model", model, "--port", "0", env=env, timeout=180)
    assert result.returncode != 0, result.stderr
    return result.stderr


# --- what the encoder needs, from the checkpoint itself ------------------------------------------


def png_b64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


IMAGES = [[random_image(56, 56, 1)], [random_image(90, 40, 2), random_image(130, 200, 3)], [random_image(28, 300, 4)]]


def served_rows(url: str) -> list[np.ndarray]:
    """The rows of each request of `IMAGES`, sent one after the other (so every server forms the same batches)."""
    rows = []
    for i, images in enumerate(IMAGES):
        response = httpx.post(url + "/encode", timeout=120, json={
            "req_id": f"r{i}", "modality": "image", "mm_items": [png_b64(image) for image in images],
            "return_embedding": True})
        assert response.status_code == 200, response.text
        body = response.json()
        rows.append(np.frombuffer(base64.b64decode(body["embedding"]), "<f4").reshape(body["embedding_shape"]))
    return rows


# --- the server on a Hub id ----------------------------------------------------------------------

def test_hub_id_serves_the_local_folders_rows_reading_only_the_encoders_bytes(hub, repos, home):
    folder = repos["org/tiny"]
    encoder_keys = {key for key in header_of(folder / "model.safetensors")[1] if key.startswith("visual.")}
    full_size = (folder / "model.safetensors").stat().st_size
    with ServerProcess("--model", str(folder)) as server:
        want = served_rows(server.url)

    env = hub_env(hub, home)
    with ServerProcess("--model", "org/tiny@main", "--log-level", "info", env=env) as server:
        assert httpx.get(server.url + "/server_info").json()["model"]["name"] == "org/tiny@main"
        got = served_rows(server.url)
        log = server.log()
    assert all(np.array_equal(a, b) for a, b in zip(got, want)) and len(got) == len(want)
    served = hub.served[("org/tiny", "model.safetensors")]
    assert served == expected_bytes(folder, encoder_keys)["model.safetensors"] < full_size // 2
    weight_reads = [r for r in hub.requests if r[1].endswith(".safetensors") and r[0] == "GET"]
    assert all(r[2] is not None for r in weight_reads), "every read of the weights is a range"
    assert re.search(r"org/tiny@main: model\.safetensors: read [\d.]+ kB of its [\d.]+ MB", log), log
    # No request of the Hub client in the log at info (on the real Hub each names a signed CDN URL), no progress bar.
    assert "HTTP Request" not in log and "/resolve/" not in log and hub.url not in log, log
    assert "it/s]" not in log and "%|" not in log, log

    cached = home / "encode-server" / "org--tiny" / commit_of("org/tiny")
    assert set(header_of(cached / "model.safetensors")[1]) == encoder_keys
    assert {"config.json", "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "generation_config.json"} <= {p.name for p in cached.iterdir()}
    assert not [p for p in cached.parent.iterdir() if p.name.endswith(".partial")]

    hub.reset_counts()  # a second start, offline: from the cache, without a single request
    with ServerProcess("--model", "org/tiny@main", env={**env, "HF_HUB_OFFLINE": "1"}) as server:
        again = served_rows(server.url)
    assert all(np.array_equal(a, b) for a, b in zip(again, want))
    assert hub.requests == []


def test_data_parallel_replicas_load_the_folder_downloaded_once(hub, repos, home):
    folder = repos["org/tiny"]  # served as org/tiny-dp too, which no other test downloads
    with ServerProcess("--model", str(folder)) as server:
        want = served_rows(server.url)
    encoder_keys = {key for key in header_of(folder / "model.safetensors")[1] if key.startswith("visual.")}
    with ServerProcess("--model", "org/tiny-dp", "--dp-size", "2", env=hub_env(hub, home)) as server:
        ranks = httpx.get(server.url + "/server_info").json()["ranks"]
        got = served_rows(server.url)
    assert len(ranks) == 2 and all(np.array_equal(a, b) for a, b in zip(got, want))
    assert hub.served[("org/tiny-dp", "model.safetensors")] == expected_bytes(folder, encoder_keys)["model.safetensors"]
    assert hub.requests.count(("GET", "/api/models/org/tiny-dp/revision/main", None)) == 1, \
        "only the first rank asks the Hub which commit main is"


def test_sharded_hub_model_reads_only_the_shards_and_ranges_of_the_encoder(hub, repos, home):
    folder = repos["org/tiny-sharded"]
    env = hub_env(hub, home)
    result = run_python_module("tests.support.hub_family_check", json.dumps({"org/tiny-sharded": str(folder)}),
                               env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.splitlines()[-1])["org/tiny-sharded"]
    assert outcome["equal"] and outcome["name"] == "org/tiny-sharded"
    encoder_keys = set(header_of(Path(outcome["folder"]) / "model.safetensors")[1])
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert encoder_keys == {key for key in index if key.startswith("visual.")}
    expected = expected_bytes(folder, encoder_keys)
    assert len(expected) > 3 and 0 in expected.values(), "some shards hold no encoder tensor"
    for name, size in expected.items():
        assert hub.served[("org/tiny-sharded", name)] == size, name

    hub.reset_counts()  # a later start online: one request, which commit `main` is, and the same folder
    again = run_python_module("tests.support.hub_family_check", "--resolve", "org/tiny-sharded", env=env, timeout=120)
    assert again.returncode == 0 and again.stdout.strip() == outcome["folder"], again.stderr
    assert hub.requests == [("GET", "/api/models/org/tiny-sharded/revision/main", None)]


# --- clear failures -------------------------------------------------------------------------------

def test_offline_and_not_cached_fails_with_the_message(hub, home):
    stderr = start_fails("org/tiny-offline", hub_env(hub, home, HF_HUB_OFFLINE="1"))  # served, never downloaded
    assert f"org/tiny-offline {OFFLINE_MESSAGE}" in stderr, stderr
    assert len(stderr.strip().splitlines()[-1]) < 300 and hub.requests == []


def test_unknown_repo_revision_no_safetensors_and_gated_repo_fail_with_the_fix(hub, home):
    env = hub_env(hub, home)
    stderr = start_fails("org/missing", env)
    assert f"no model repository org/missing on {hub.url}" in stderr.strip().splitlines()[-1], stderr
    stderr = start_fails("org/tiny@no-such-branch", env)
    assert "org/tiny has no revision 'no-such-branch'" in stderr.strip().splitlines()[-1], stderr
    stderr = start_fails("org/bin-only", env)
    assert "org/bin-only has no safetensors weights" in stderr.strip().splitlines()[-1], stderr
    for fix in ("--model org/bin-only@<revision>", "refs/pr/N", "save_pretrained", "pass that folder as --model"):
        assert fix in stderr.strip().splitlines()[-1], stderr  # what to do, in the same line
    stderr = start_fails("org/gated", env)
    assert "org/gated is a gated repository" in stderr and "set HF_TOKEN" in stderr.strip().splitlines()[-1], stderr


def test_unknown_name_still_lists_the_builtin_models(tmp_path):
    stderr = start_fails("no-such-model", {})  # neither a built-in, a path, nor org/name
    assert "unknown model" in stderr and "tiny-qwen2.5-vl" in stderr and "org/name" in stderr, stderr
    stderr = start_fails(str(tmp_path / "no" / "such" / "folder"), {})  # a path is never taken for a Hub id
    assert "does not exist" in stderr and "unknown model" not in stderr, stderr


# --- every way a family chooses its tensors ----------------------------------------------------------

def test_other_families_from_the_hub_equal_their_local_folders(hub, home, tmp_path):
    from tests.support.checkpoints.gemma3 import gemma3_checkpoint
    from tests.support.checkpoints.grid_vision import build_model, write_processor_files
    from tests.support.checkpoints.mistral3 import mistral3_checkpoint

    glm = tmp_path / "glm4v"
    build_model("glm4v", 3).save_pretrained(glm)
    folders = {
        "org/internvl": internvl_checkpoint(tmp_path / "internvl")[2],  # two modules through load_encoder_modules
        "org/qwen2-audio": qwen2_audio_checkpoint(tmp_path / "audio")[2],  # an audio tower
        "org/gemma3": gemma3_checkpoint(tmp_path / "gemma3")[1],  # vision_parts: transformers' renamings
        "org/mistral3": mistral3_checkpoint(tmp_path / "mistral3")[1],
        "org/glm4v": write_processor_files(glm, "glm4v", "nested"),  # the grid towers
    }
    hub.add(folders)
    result = run_python_module("tests.support.hub_family_check",
                               json.dumps({repo: str(folder) for repo, folder in folders.items()}),
                               env=hub_env(hub, home), timeout=500)
    assert result.returncode == 0, result.stderr
    outcomes = json.loads(result.stdout.splitlines()[-1])
    for repo, folder in folders.items():
        outcome = outcomes[repo]
        assert outcome["equal"], (repo, outcome)
        encoder_keys = set(header_of(Path(outcome["folder"]) / "model.safetensors")[1])
        all_keys = {key for keys in weight_files(folder).values() for key in keys}
        assert encoder_keys < all_keys, repo
        for name, size in expected_bytes(folder, encoder_keys).items():
            assert hub.served[(repo, name)] == size, (repo, name)


def test_gated_repo_with_its_token_and_a_commit_revision(hub, repos, home):
    # Last in the module: its token makes another environment (another zygote), after which the ones of the
    # tests above are needed no more.
    commit = commit_of("org/gated")
    env = hub_env(hub, home, HF_TOKEN="hf_secret")
    result = run_python_module("tests.support.hub_family_check",
                               json.dumps({f"org/gated@{commit}": str(repos["org/tiny"])}), env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.splitlines()[-1])[f"org/gated@{commit}"]
    assert outcome["equal"] and Path(outcome["folder"]).name == commit
