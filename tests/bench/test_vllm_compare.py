"""`benchmarks/vllm_compare.py`: its flags, the body it sends vLLM's encoder instance and how it finds the stored
files (no server is started; the comparison itself is a measurement, run by hand as its module docstring says)."""

from __future__ import annotations

import hashlib
import json

import pytest

from benchmarks.vllm_compare import (
    BATCH_FLAGS,
    parse_args,
    producer_config,
    request_body,
    server_for,
    stored_identifiers,
    with_chat_template,
)

pytestmark = pytest.mark.quick


def test_flags_defaults_and_errors(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_PYTHON", "/opt/vllm/bin/python")
    args = parse_args([])
    assert args.configs == ["ours", "vllm", "vllm-budget"] and (args.rounds, args.requests, args.concurrency) == (
        2, 400, 64)
    assert args.vllm_python == "/opt/vllm/bin/python" and (args.server_core, args.client_core) == (0, 1)
    with pytest.raises(SystemExit):
        parse_args(["--configs", "ours,sglang"])
    assert "unknown --configs sglang" in capsys.readouterr().err


def test_the_body_is_the_example_proxys_encoder_request_with_its_content_uuid():
    body, uuid = request_body("/models/tiny", "aGk=")
    url = "data:image/png;base64,aGk="
    assert uuid == hashlib.sha256(url.encode()).hexdigest()
    assert body == {"model": "/models/tiny", "stream": False, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}, "uuid": uuid}]}]}


def test_the_stored_identifiers_are_the_answers_else_the_uuid_sent():
    assert stored_identifiers({"ec_transfer_params": {"abc": {"item_indices": [0]}}}, "u") == ["abc"]
    assert stored_identifiers({"ec_transfer_params": None}, "u") == ["u"]
    assert stored_identifiers({}, "u") == ["u"]


def test_vllm_starts_as_an_encode_only_producer_on_a_fresh_folder_and_the_tuned_one_with_raised_budgets(
        tmp_path):
    args = parse_args(["--vllm-python", "py", "--storage-root", str(tmp_path)])
    defaults, tuned = (server_for(config, args, tmp_path / "ckpt", 1234) for config in ("vllm", "vllm-budget"))
    assert defaults.storage != tuned.storage and defaults.storage.parent == tmp_path
    assert defaults.argv[:4] == ["taskset", "-c", "0", "py"] and "--mm-encoder-only" in defaults.argv
    config = json.loads(defaults.argv[defaults.argv.index("--ec-transfer-config") + 1])
    assert config == json.loads(producer_config(defaults.storage))
    assert config["ec_role"] == "ec_producer" and config["ec_connector"] == "ECExampleConnector"
    assert "--max-num-seqs" not in defaults.argv and tuned.argv[-len(BATCH_FLAGS):] == list(BATCH_FLAGS)
    ours = server_for("ours", args, tmp_path / "ckpt", 1235)
    assert ours.argv[ours.argv.index("--ec-storage") + 1] == str(ours.storage)
    assert ours.argv[ours.argv.index("--ec-vllm-version") + 1] == "0.32.0"


def test_the_checkpoint_gets_a_chat_template_once(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "x"}))
    with_chat_template(with_chat_template(tmp_path))
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert settings["eos_token"] == "x" and settings["chat_template"] == (tmp_path / "chat_template.jinja").read_text()
