"""Messages that name the problem and the fix: bad setting values (the flag or variable and what it accepts), a
file path sent as an item, a missing PyAV, weights only in .bin files, /docs without a CDN, and `--help` and
`--version` without importing torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from encode_server.media.decoding import MediaError
from encode_server.media.loader import parse_item
from encode_server.media.url_guard import resolve_local_path
from encode_server.ops.settings import DTYPE_CHOICES, load_settings
from tests.support.helpers import ROOT

pytestmark = pytest.mark.quick


def settings_error(capsys, argv: list[str], environ: dict[str, str] | None = None) -> str:
    with pytest.raises(SystemExit) as exit_info:
        load_settings(argv, environ or {})
    return f"{exit_info.value.code if isinstance(exit_info.value.code, str) else ''}{capsys.readouterr().err}"


@pytest.mark.parametrize(("argv", "names"), [
    (["--enable-dynamic-batching", "maybe"], ["--enable-dynamic-batching", "true or false", "yes/no", "'maybe'"]),
    (["--cache-bytes", "lots"], ["--cache-bytes", "'auto'", "512MiB", "GiB", "'lots'"]),
    (["--ec-storage-bytes", "5X"], ["--ec-storage-bytes", "512MiB", "'5X'"]),
    (["--max-batch-size", "many"], ["--max-batch-size", "whole number", "'many'"]),
    (["--drain-timeout-s", "soon"], ["--drain-timeout-s", "a number", "'soon'"]),
    (["--max-wait-ms", "never"], ["--max-wait-ms", "'auto'", "'never'"]),
    (["--sglang-embedding-class", "foo"], ["--sglang-embedding-class", "module.Class", "EmbeddingData"]),
])
def test_a_bad_flag_value_names_the_flag_and_what_it_accepts(capsys, argv, names):
    message = settings_error(capsys, argv)
    assert len(message.strip().splitlines()) == 1, message
    for name in names:
        assert name in message, message
    assert "invalid" not in message and "parse_" not in message, message  # not argparse's "invalid parse_bool value"


def test_a_bad_variable_names_the_variable_its_flag_and_what_it_accepts(capsys):
    message = settings_error(capsys, [], {"ENCODER_METRICS_REQUIRE_KEY": "maybe"})
    for name in ("ENCODER_METRICS_REQUIRE_KEY", "--metrics-require-key", "true or false", "on/off", "'maybe'"):
        assert name in message, message
    message = settings_error(capsys, [], {"ENCODER_CACHE_BYTES": "big"})
    assert "ENCODER_CACHE_BYTES" in message and "'auto'" in message and "MiB" in message, message
    message = settings_error(capsys, [], {"ENCODER_MAX_PENDING": "x"})
    assert "ENCODER_MAX_PENDING" in message and "whole number" in message, message


@pytest.mark.parametrize("path", ["cat.jpg", "./images/a.png", "images/clip.mp4", "C:\\media\\a.wav", "~/x.flac"])
def test_a_relative_path_as_an_item_says_it_looks_like_a_path_and_how_to_send_files(path):
    with pytest.raises(MediaError) as error:
        parse_item(path, 0, "image")
    message = str(error.value)
    assert message.startswith("mm_items[0]: ") and "looks like a file path" in message, message
    for fix in ("base64", "data:", "http(s)://", "--allowed-local-media-dir"):
        assert fix in message, message
    assert "not valid base64" not in message


@pytest.mark.parametrize("path", ["/tmp/a.png", "/etc/passwd", "/data/images/cat", "/srv/media/clip-01.mp4"])
def test_an_absolute_path_without_a_media_folder_says_how_to_send_files(path):
    # The last three are all in base64's alphabet ("/data/images/cat" even decodes): each is still a path.
    assert parse_item(path, 0, "image").kind == "file"
    with pytest.raises(PermissionError) as error:
        resolve_local_path(path, None)
    message = str(error.value)
    assert f"{path!r} is a local file path" in message
    for fix in ("base64", "data:", "http(s)://", "--allowed-local-media-dir DIR"):
        assert fix in message, message


@pytest.mark.parametrize("item", ["/9j/4AAQSkZJRg==", "abc/", "iVBORw0KGgo=", "aGVsbG8-d29ybGQ_",
                                  "/9j/4AAQSkZJRgABAQAAAQABAAD", "//uQxAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"])
def test_base64_is_never_taken_for_a_path(item):
    assert parse_item(item, 0, "image").kind == "base64"


def test_the_pyav_hint_names_an_install_that_exists(monkeypatch):
    from encode_server.media.decoding import decode_video

    monkeypatch.setitem(sys.modules, "av", None)  # as if PyAV were not installed: `import av` fails
    with pytest.raises(MediaError) as error:
        decode_video(b"\x00" * 64, 2.0, 8, 10**8, "mm_items[0]")
    message = str(error.value)
    assert "pip install av" in message and "{\"frames\": [...]}" in message, message
    assert "encode-server[" not in message  # no index has a package of that name


def test_weights_only_in_bin_files_say_how_to_convert(tmp_path):
    from encode_server.models.loading.checkpoint import CheckpointError, _shard_files

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError) as error:
        _shard_files(tmp_path)
    message = str(error.value)
    for part in ("model.safetensors", ".bin weights are not read", "save_pretrained", "--model"):
        assert part in message, message


def test_docs_are_served_without_a_cdn():
    from fastapi.testclient import TestClient

    from encode_server.http.app import DOCS_ASSETS, create_app
    from encode_server.ops.settings import Settings

    client = TestClient(create_app(Settings()))  # no lifespan: the model is not needed for the pages
    for page in ("/docs", "/redoc"):
        html = client.get(page)
        assert html.status_code == 200, page
        assert "cdn" not in html.text.lower() and "https://" not in html.text, html.text
        assert f"{DOCS_ASSETS}/" in html.text
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js"):
        answer = client.get(f"{DOCS_ASSETS}/{asset}")
        assert answer.status_code == 200 and len(answer.content) > 10_000, asset
    assert client.get("/openapi.json").json()["info"]["title"] == "encode-server"


@pytest.mark.parametrize("flag", ["--version", "--help"])
def test_help_and_version_import_neither_torch_nor_transformers(flag):
    code = "\n".join(["import sys", "from encode_server.__main__ import main", "try:", f"    main([{flag!r}])",
                      "except SystemExit:", "    pass",
                      "print(sorted({'torch', 'transformers', 'numpy', 'encode_server.models'} & set(sys.modules)))"])
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-500:]


def test_the_dtype_choices_are_the_dtype_table():
    from encode_server.models.dtypes import DTYPES

    assert DTYPE_CHOICES == tuple(DTYPES)
