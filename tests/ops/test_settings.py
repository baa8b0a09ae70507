"""Settings: flags over ENCODER_ variables over SGLANG_ aliases over defaults; --help and the README."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from encode_server.ops.settings import OPTIONS, Settings, load_settings, parse_bool, settings_table_markdown
from tests.support.helpers import ROOT

pytestmark = pytest.mark.quick


def test_defaults_match_the_contract():
    settings = load_settings([], environ={})
    assert settings == Settings()
    assert (settings.model, settings.host, settings.port) == ("tiny-qwen2.5-vl", "127.0.0.1", 30000)
    assert (settings.max_batch_size, settings.max_wait_ms, settings.min_batch_size) == (32, 0.0, 1)
    assert (settings.hard_timeout_additional_s, settings.max_batch_tokens) == (1.0, 0)
    assert settings.enable_dynamic_batching is True
    assert (settings.max_pending, settings.req_timeout_s) == (1024, 180.0)
    assert (settings.max_request_bytes, settings.max_image_pixels) == (67108864, 50_000_000)


def test_env_var_sets_a_value_and_the_flag_wins():
    env = {"ENCODER_MAX_BATCH_SIZE": "8", "ENCODER_MAX_WAIT_MS": "12.5"}
    assert load_settings([], environ=env).max_batch_size == 8
    assert load_settings([], environ=env).max_wait_ms == 12.5
    assert load_settings(["--max-batch-size", "4"], environ=env).max_batch_size == 4


def test_sglang_aliases_apply_only_when_the_encoder_variable_is_unset():
    alias = {"SGLANG_ENCODER_MAX_BATCH_SIZE": "6", "SGLANG_ENCODER_REQ_TIMEOUT": "30"}
    settings = load_settings([], environ=alias)
    assert (settings.max_batch_size, settings.req_timeout_s) == (6, 30.0)
    assert load_settings([], environ={**alias, "ENCODER_MAX_BATCH_SIZE": "9"}).max_batch_size == 9


@pytest.mark.parametrize("text,value", [("false", False), ("0", False), ("no", False), ("True", True),
                                         ("1", True), ("on", True)])
def test_booleans_read_like_an_operator_writes_them(text, value):
    assert parse_bool(text) is value
    assert load_settings(["--enable-dynamic-batching", text], environ={}).enable_dynamic_batching is value
    assert load_settings([], environ={"ENCODER_ENABLE_DYNAMIC_BATCHING": text}).enable_dynamic_batching is value


def test_bare_boolean_flag_means_true():
    env = {"ENCODER_ENABLE_DYNAMIC_BATCHING": "false"}
    assert load_settings(["--enable-dynamic-batching"], environ=env).enable_dynamic_batching is True


@pytest.mark.parametrize("argv", [["--max-batch-size", "0"], ["--max-wait-ms", "-1"], ["--port", "70000"],
                                  ["--req-timeout-s", "0"], ["--dtype", "int8"], ["--max-batch-size", "x"],
                                  ["--device", "gpu"], ["--device", "cuda:x"], ["--device", "cuda:"]])
def test_bad_values_are_refused_at_start(argv):
    with pytest.raises(SystemExit):
        load_settings(argv, environ={})


def test_a_bad_value_is_one_line_on_stderr_not_the_usage(capsys):
    with pytest.raises(SystemExit) as exited:
        load_settings(["--max-batch-size", "0"], environ={})
    assert exited.value.code == 2
    assert capsys.readouterr().err == "encode-server: error: --max-batch-size must be at least 1, got 0\n"


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:7"])
def test_accepted_devices(device):
    assert load_settings(["--device", device], environ={}).device == device


def test_bad_env_value_is_refused_with_its_name():
    with pytest.raises(SystemExit, match="ENCODER_MAX_PENDING"):
        load_settings([], environ={"ENCODER_MAX_PENDING": "lots"})


def test_help_documents_every_flag_its_variable_and_default():
    out = subprocess.run([sys.executable, "-m", "encode_server", "--help"], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    flat = " ".join(out.split())
    for option in OPTIONS:
        assert option.flag in flat and option.env_var in flat
    assert "(default: 32)" in flat and "SGLANG_ENCODER_MAX_BATCH_SIZE" in flat


def test_readme_lists_every_setting():
    readme = (ROOT / "docs" / "CONFIGURATION.md").read_text()
    assert settings_table_markdown() in readme, \
        "regenerate the table in docs/CONFIGURATION.md: python -m encode_server.ops.settings"


def test_the_default_cpu_threads_are_half_the_cores_this_process_may_use(monkeypatch):
    """Half of what `ops/cores.usable_cores` says (affinity within a container's quota), not of the host's cores:
    in a 2-CPU container on a 64-core host, 32 OpenMP threads would starve everything else."""
    from encode_server.ops import settings as settings_module

    monkeypatch.setattr(settings_module, "usable_cores", lambda: 8)
    assert Settings().cpu_threads_per_rank(1) == 4 and Settings().cpu_threads_per_rank(2) == 2
    monkeypatch.setattr(settings_module, "usable_cores", lambda: 1)
    assert Settings().cpu_threads_per_rank(1) == 1
    assert Settings(cpu_threads=6).cpu_threads_per_rank(2) == 3  # --cpu-threads wins


def test_settings_are_made_from_the_one_table():
    """One field per row, in the rows' order, with the row's default: nothing declared twice."""
    import dataclasses

    from encode_server.ops.settings import GROUPS

    fields = dataclasses.fields(Settings)
    assert [field.name for field in fields] == [option.dest for option in OPTIONS]
    assert all(field.default == option.default for field, option in zip(fields, OPTIONS))
    assert len({option.flag for option in OPTIONS}) == len(OPTIONS) == sum(len(group.options) for group in GROUPS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().port = 1


@pytest.mark.parametrize("values,message", [
    ({"dtype": "int8"}, "--dtype must be auto, float32, bfloat16 or float16, got 'int8'"),
    ({"wire_format": "grpc"}, "--wire-format must be native or sglang, got 'grpc'"),
    ({"preprocess_workers": -2}, "--preprocess-workers must be -1 (auto), 0 or more, got -2"),
    ({"ec_side_channel_port": 0}, "--ec-side-channel-port must be in 1..65535, got 0"),
    ({"max_wait_ms": -1.0}, "--max-wait-ms must not be negative, got -1.0"),
    ({"cache_store_timeout_ms": 0.0}, "--cache-store-timeout-ms must be positive, got 0.0"),
    ({"tp_size": 2, "dp_size": 2}, "--tp-size and --dp-size cannot both be above 1"),
])
def test_each_value_is_checked_by_its_row_once_however_it_is_given(values, message):
    """The same check and message whether the value comes from code, the command line or the environment."""
    with pytest.raises(ValueError, match=re.escape(message)):
        Settings(**values)
    if len(values) == 1:
        (name, value), = values.items()
        with pytest.raises(SystemExit, match=re.escape(f"bad value for ENCODER_{name.upper()}: {message}")):
            load_settings([], environ={f"ENCODER_{name.upper()}": str(value)})


def test_the_settings_check_values_only(monkeypatch):
    """Making settings probes no installed library (the component that needs one asks at start-up:
    `runtime.check_libraries`, tested with the store tier and the SGLang front)."""
    from encode_server.ops import libraries

    def probed(library):
        raise AssertionError(f"the settings probed {library}")

    monkeypatch.setattr(libraries, "installed", probed)
    monkeypatch.setattr(libraries, "load_problem", probed)
    settings = load_settings(["--cache-store", "mooncake://127.0.0.1:50051", "--encoder-transfer-backend",
                              "mooncake"], environ={})
    assert (settings.cache_store, settings.encoder_transfer_backend) == ("mooncake://127.0.0.1:50051", "mooncake")
