"""The log format in-process (`encode_server/ops/logs.py`): signed URLs and tokens blanked at every level, one
JSON object per line with the extra fields, colour only on a terminal, the HTTP clients quiet, the
libraries' own handlers replaced by ours. The real server's output is checked in tests/ops/test_log_output.py."""

from __future__ import annotations

import io
import json
import logging

import pytest

from encode_server.ops.batch_log import BatchLog
from encode_server.ops.logs import (
    CHATTY_LOGGERS,
    QUIET_LOGGERS,
    REDACTED,
    JsonFormatter,
    TextFormatter,
    configure_logging,
    redact,
    redact_url,
    route_library_logs,
    use_colour,
)

pytestmark = pytest.mark.quick

SIGNED = ("https://cas-bridge.xethub.hf.co/xet-bridge-us/abc/def?X-Amz-Algorithm=AWS4-HMAC-SHA256"
          "&X-Amz-Credential=AKIAEXAMPLE%2F20260101&X-Amz-Signature=0123456789abcdef&X-Amz-Expires=3600")


@pytest.fixture
def root_logging():
    """Restore the root logger and the quieted loggers after a test reconfigures them."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    levels = {name: logging.getLogger(name).level for name in (*QUIET_LOGGERS, *CHATTY_LOGGERS, "transformers")}
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    for name, old in levels.items():
        logging.getLogger(name).setLevel(old)
    logging.captureWarnings(False)


def test_signed_url_query_values_passwords_and_tokens_are_blanked():
    clean = redact_url(SIGNED)
    assert "0123456789abcdef" not in clean and "AKIAEXAMPLE" not in clean
    assert clean.startswith("https://cas-bridge.xethub.hf.co/xet-bridge-us/abc/def?X-Amz-Algorithm=" + REDACTED)
    assert f"&X-Amz-Signature={REDACTED}" in clean
    assert redact_url("https://cdn.example/f.png?Signature=s3cr3t&Key-Pair-Id=k#frag") == \
        f"https://cdn.example/f.png?Signature={REDACTED}&Key-Pair-Id={REDACTED}#frag"
    assert redact_url("https://user:hunter2@example.com/a") == f"https://user:{REDACTED}@example.com/a"
    assert redact_url("http://127.0.0.1:30000/encode") == "http://127.0.0.1:30000/encode"  # nothing to hide
    line = redact(f"fetching {SIGNED}: HTTP 403; header Authorization: Bearer abc.def-ghi token hf_"
                  + "a1B2c3D4e5F6g7H8i9J0k1L2m3")
    assert "0123456789abcdef" not in line and "abc.def-ghi" not in line and "a1B2c3D4e5F6" not in line
    assert line.startswith("fetching https://cas-bridge.xethub.hf.co/") and f"Bearer {REDACTED}" in line


def test_our_own_lines_with_a_signed_url_are_redacted_in_both_formats(root_logging):
    for fmt in ("text", "json"):
        stream = io.StringIO()
        configure_logging("debug", fmt, stream=stream)
        logging.getLogger("encode_server.media").warning("mm_items[0]: fetching %s failed: HTTP 403", SIGNED)
        logging.getLogger("encode_server.media").debug("retrying %s", SIGNED, extra={"url": SIGNED})
        written = stream.getvalue()
        assert "X-Amz-Signature" in written and "0123456789abcdef" not in written, written
        assert "AKIAEXAMPLE" not in written
        assert len(written.splitlines()) == 2


def test_json_lines_carry_time_level_logger_message_extras_and_exceptions(root_logging):
    stream = io.StringIO()
    configure_logging("info", "json", stream=stream)
    log = logging.getLogger("encode_server.engine")
    log.info("batch modality=%s size=%d", "image", 3, extra={"modality": "image", "batch_size": 3})
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("forward failed")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert len(lines) == 2
    first, second = lines
    assert first["level"] == "INFO" and first["logger"] == "encode_server.engine"
    assert first["message"] == "batch modality=image size=3"
    assert first["modality"] == "image" and first["batch_size"] == 3
    assert first["time"].endswith("Z") and first["time"][10] == "T"
    assert second["level"] == "ERROR" and "RuntimeError: boom" in second["exception"]


def test_colour_only_on_a_terminal_and_never_with_no_color():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert use_colour(Terminal(), {"TERM": "xterm"})
    assert not use_colour(Terminal(), {"TERM": "xterm", "NO_COLOR": "1"})
    assert not use_colour(Terminal(), {"NO_COLOR": ""})  # set, even empty
    assert not use_colour(Terminal(), {"TERM": "dumb"})
    assert not use_colour(io.StringIO(), {"TERM": "xterm"})  # a file or a pipe
    record = logging.LogRecord("encode_server", logging.WARNING, __file__, 1, "careful", None, None)
    assert "\033[" in TextFormatter(colour=True).format(record)
    plain = TextFormatter(colour=False).format(record)
    assert "\033[" not in plain and plain.endswith(" WARNING encode_server: careful")
    assert "\033[" not in JsonFormatter().format(record)


def test_the_hub_clients_http_lines_stay_out_even_at_debug(root_logging):
    stream = io.StringIO()
    configure_logging("debug", "text", stream=stream)
    logging.getLogger("httpx").info('HTTP Request: GET %s "HTTP/1.1 302 Found"', SIGNED)
    logging.getLogger("httpx2").info('HTTP Request: GET %s "HTTP/1.1 302 Found"', SIGNED)  # huggingface_hub 2's
    logging.getLogger("httpx3.client").info("HTTP Request: a later fork's logger, by its prefix")
    logging.getLogger("huggingface_hub.file_download").info("Downloading %s", SIGNED)
    logging.getLogger("urllib3.connectionpool").debug("Starting new HTTPS connection (1): %s", SIGNED)
    logging.getLogger("encode_server.startup").debug("ours, kept")
    logging.getLogger("httpx").warning("a warning still shows")
    written = stream.getvalue()
    assert "HTTP Request" not in written and "Downloading" not in written and "Starting new" not in written
    assert "ours, kept" in written and "a warning still shows" in written


def test_pils_chunk_lines_stay_out_at_debug(root_logging):
    """Decoding a PNG at `--log-level debug` wrote a line per chunk (`STREAM b'IHDR' 16 13`)."""
    from PIL import Image

    stream = io.StringIO()
    configure_logging("debug", "text", stream=stream)
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, "PNG")
    Image.open(io.BytesIO(buffer.getvalue())).load()
    logging.getLogger("encode_server.startup").debug("ours, kept")
    written = stream.getvalue()
    assert "STREAM" not in written and "PIL" not in written and "ours, kept" in written, written


def test_batches_are_debug_lines_and_an_info_summary_at_most_once_an_interval(root_logging, caplog):
    """One info line per batch was most of a busy log: now each batch is a debug line (a health probe's marked as
    such), and info gets the first batch of traffic, then a summary at most once an interval (probes left out)."""
    clock = [0.0]
    batches = BatchLog(interval_s=60.0, clock=lambda: clock[0])
    caplog.set_level(logging.DEBUG, logger="encode_server.engine")
    batches.batch("image", 1, 1, 1, 4, 0.001, 0.002, "replica=0", probe=True)
    for second in range(100):  # 100 batches in 100 s: the first, then one summary after 60 s
        clock[0] = 1.0 + second
        batches.batch("image", 2 + second, 3, 4, 16, 0.001, 0.010 + second / 1000, "replica=0")
    info = [record.getMessage() for record in caplog.records if record.levelno == logging.INFO]
    debug = [record.getMessage() for record in caplog.records if record.levelno == logging.DEBUG]
    assert len(debug) == 101 and debug[0].endswith("batch=1 health-probe")
    assert debug[1].startswith("batch modality=image size=3 items=4 tokens=16 preprocess_ms=1.0 forward_ms=10.0")
    assert info == ["encoded 1 batches (image 1) in the last 0 s: 3 requests, 4 items, 16 tokens, forward 10.0 ms "
                    "mean, 10.0 ms max",
                    "encoded 60 batches (image 60) in the last 60 s: 180 requests, 240 items, 960 tokens, forward "
                    "40.5 ms mean, 70.0 ms max"], info


def test_transformers_lines_take_our_format(root_logging):
    from transformers.utils import logging as transformers_logging

    library = logging.getLogger("transformers")
    handlers, propagate, level = list(library.handlers), library.propagate, library.level
    stream = io.StringIO()
    try:
        configure_logging("info", "json", stream=stream)
        route_library_logs()
        assert not library.handlers and library.propagate, (library.handlers, handlers)  # its own handler is gone
        # Where the line goes, whatever levels earlier tests in this worker left: handed to the logger as
        # transformers' `logger.warning` would, past the level checks.
        logger = transformers_logging.get_logger("transformers.modeling_utils")
        logger.handle(logger.makeRecord(logger.name, logging.WARNING, __file__, 1, "a transformers warning", (), None))
    finally:
        library.handlers[:] = handlers
        library.propagate, library.level = propagate, level
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    want = {"logger": "transformers.modeling_utils", "message": "a transformers warning", "level": "WARNING"}
    assert any(want.items() <= line.items() for line in lines), (lines, logger.disabled, logger.filters)
