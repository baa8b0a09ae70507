"""What the real server writes: `--log-format json` is one JSON object per line from start to exit (uvicorn's
lines, the access log and the ready line included), text lines share one shape with no colour codes in a pipe,
and a `--register-with` registry that refuses connections is a warning within seconds."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time

import httpx

from tests.support.helpers import LineReader, ServerProcess, free_port, image_b64, python_module, run_python_module

TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")


def test_json_logs_are_one_object_per_line_from_start_to_exit():
    process = python_module("encode_server", "--port", str(free_port()), "--log-format", "json",
                            "--log-level", "debug", env={"ENCODER_CACHE_BYTES": "0"})
    reader = LineReader(process.stderr, "encode-server ready:")
    lines = reader.lines
    try:
        assert reader.seen.wait(120), reader.text()
        ready = next(line for line in lines if "encode-server ready:" in line)
        port = int(re.search(r"127\.0\.0\.1:(\d+)", ready).group(1))
        url = f"http://127.0.0.1:{port}"
        ok = httpx.post(url + "/encode", json={"req_id": "j1", "modality": "image", "mm_items": [image_b64(32, 32)]},
                        timeout=60)
        assert ok.status_code == 200, ok.text
        bad = httpx.post(url + "/encode", json={"req_id": "j2", "modality": "image", "mm_items": ["bm90IGFuIGltYWdl"]},
                         timeout=60)
        assert bad.status_code == 400
        time.sleep(0.3)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        reader.thread.join(10)
    assert process.returncode == 0, "".join(lines)
    assert process.stdout.read() == ""
    records = []
    for line in lines:
        record = json.loads(line)  # every line, or this raises and names it
        assert isinstance(record, dict) and {"time", "level", "logger", "message"} <= set(record), line
        assert "\033[" not in line
        records.append(record)
    by_logger = {record["logger"] for record in records}
    assert {"encode_server.startup", "uvicorn.error", "uvicorn.access", "encode_server.http.errors"} <= by_logger
    ready_line = next(record for record in records if record["message"].startswith("encode-server ready:"))
    assert ready_line["level"] == "INFO"
    batch = next(record for record in records if record["message"].startswith("batch modality=image"))
    assert batch["modality"] == "image" and batch["batch_size"] >= 1 and batch["tokens"] > 0
    answered = next(record for record in records if record["logger"] == "encode_server.http.errors")
    assert answered["status"] == 400 and answered["req_id"] == "j2" and answered["path"] == "/encode"
    assert any(record["logger"] == "uvicorn.access" and "POST /encode" in record["message"] for record in records)


def test_an_unreachable_registry_is_a_warning_within_seconds_then_backoff():
    """Nothing listens on the registry's loopback port (connections are refused): the first failure is a warning
    within a few seconds of the start, naming the registry and the flag; the retries that follow (every 0.5 s,
    doubling) do not repeat it, and the text lines share the one format with no colour in a pipe."""
    registry = f"http://127.0.0.1:{free_port()}"
    with ServerProcess("--register-with", registry, "--log-level", "info") as server:
        started = time.monotonic()
        warning = None
        while time.monotonic() - started < 5 and warning is None:
            warning = next((line for line in server.log().splitlines() if "cannot register" in line), None)
            time.sleep(0.1)
        assert warning is not None, server.log()
        assert registry in warning and "--register-with" in warning and " WARNING " in warning
        time.sleep(3)  # about three more attempts (0.5 + 1 + 2 s apart)
        log = server.log()
    assert log.count("cannot register") == 1, log
    assert "\033[" not in log
    lines = [line for line in log.splitlines() if line.strip() and not line.startswith("encode-server ready:")]
    assert lines and all(TEXT_LINE.match(line) for line in lines), "\n".join(lines)
    assert any(" uvicorn.error: " in line for line in lines)  # uvicorn's lines in our format


def test_a_start_up_error_is_a_json_line_too():
    done = run_python_module("encode_server", "--log-format", "json", "--port", "0", "--model", "/nonexistent-model")
    assert done.returncode == 1, done.stderr
    records = [json.loads(line) for line in done.stderr.splitlines()]  # every line, or this raises
    assert records[-1]["level"] == "CRITICAL" and "/nonexistent-model does not exist" in records[-1]["message"]
