"""The server's log: one format for every line on stderr (ours, uvicorn's, the libraries'), text or JSON,
colour only on a terminal, and no credentials.

- `configure_logging(level, fmt)` puts one handler on the root logger; uvicorn gets `UVICORN_LOG_CONFIG`,
  which sends its loggers there too, and `route_library_logs()` takes the handlers transformers and the Hub
  client put on their own loggers, so every line has the same shape.
- `--log-format text`: `2026-01-02 03:04:05,678 INFO encode_server.startup: message`, the level coloured
  only when stderr is a terminal and `NO_COLOR` is unset (never in files or pipes).
- `--log-format json`: one JSON object per line, `time` (UTC, ISO 8601), `level`, `logger`, `message`,
  the record's extra fields (`log.info(..., extra={"req_id": ...})`) and `exception` when there is one.
- Signed URLs never reach the log: the Hub client's HTTP loggers stay at WARNING whatever the level (at INFO
  they print every request's signed CDN URL), and every line is passed through `redact`, which blanks the
  values of URL query strings (`Signature=`, `X-Amz-*`, `token=` ...), URL passwords, bearer tokens and
  Hugging Face tokens.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from typing import Any, TextIO

#: `--log-format` values.
LOG_FORMATS = ("text", "json")

#: Loggers that print request URLs (signed CDN links among them) at INFO or DEBUG: WARNING at every level.
#: huggingface_hub 2 sends its requests through `httpx2` (with `httpcore2`), a fork that logs under its own names.
QUIET_LOGGERS = ("huggingface_hub", "httpx", "httpx2", "httpcore", "httpcore2", "urllib3", "filelock", "hpack",
                 "hf_xet", "aiohttp.access")
#: And whatever logger a later HTTP client version names like them: below WARNING, dropped at the handler.
_QUIET_PREFIXES = ("httpx", "httpcore", "urllib3", "huggingface_hub", "hf_xet")

#: Libraries whose debug lines say nothing an operator of this server needs (PIL: a line per PNG chunk it reads,
#: `STREAM b'IHDR'`): INFO at every level.
CHATTY_LOGGERS = ("PIL",)

#: Libraries that put a stderr handler of their own on their root logger.
_LIBRARY_LOGGERS = ("transformers", "huggingface_hub")

REDACTED = "REDACTED"
_URL = re.compile(r"""\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'"<>`]+""")
_QUERY_VALUE = re.compile(r"([?&;][^=&;#\s]+=)[^&;#\s]*")
_USERINFO = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://[^/@:\s]*:)[^/@\s]*@")
_BEARER = re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]+")
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")


def redact_url(url: str) -> str:
    """`url` with every query value and any password blanked: the parameter names stay, for debugging."""
    url = _USERINFO.sub(rf"\g<1>{REDACTED}@", url)
    head, mark, rest = url.partition("?")
    if not mark:
        return url
    query, hash_mark, fragment = rest.partition("#")
    return head + _QUERY_VALUE.sub(rf"\g<1>{REDACTED}", "?" + query) + hash_mark + fragment


def redact(text: str) -> str:
    """`text` with the credentials a log line can carry blanked: URL query values and passwords, bearer
    tokens, Hugging Face tokens."""
    if "://" in text:
        text = _URL.sub(lambda match: redact_url(match.group(0)), text)
    if "earer" in text or "EARER" in text:
        text = _BEARER.sub(rf"\g<1>{REDACTED}", text)
    if "hf_" in text:
        text = _HF_TOKEN.sub(REDACTED, text)
    return text


def use_colour(stream: TextIO, environ: dict[str, str] | None = None) -> bool:
    """Colour only on a terminal, and never with `NO_COLOR` set (https://no-color.org) or `TERM=dumb`."""
    environ = os.environ if environ is None else environ
    if "NO_COLOR" in environ or environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


_COLOURS = {"DEBUG": "\033[36m", "INFO": "\033[32m", "WARNING": "\033[33m", "ERROR": "\033[31m",
            "CRITICAL": "\033[1;31m"}
_RESET = "\033[0m"


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message` (`time LEVEL process logger: message` in a rank or worker), redacted;
    the level coloured when `colour`."""

    def __init__(self, colour: bool = False, process: str | None = None) -> None:
        super().__init__(f"%(asctime)s %(levelname)s {process + ' ' if process else ''}%(name)s: %(message)s")
        self.colour = colour

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        if not self.colour or record.levelname not in _COLOURS:
            return super().formatMessage(record)
        plain = record.levelname
        record.levelname = f"{_COLOURS[plain]}{plain}{_RESET}"
        try:
            return super().formatMessage(record)
        finally:
            record.levelname = plain

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


#: The attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}
#: uvicorn's own extras (its colour switch and the access log's pieces, already in the message).
_UVICORN_EXTRAS = frozenset({"color_message"})


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the record's extra fields, exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": redact(record.getMessage()),
        }
        for key, value in vars(record).items():
            if key in _STANDARD or key in _UVICORN_EXTRAS or key in entry:
                continue
            entry[key] = redact(value) if isinstance(value, str) else value
        if record.exc_info:
            entry["exception"] = redact(self.formatException(record.exc_info))
        if record.stack_info:
            entry["stack"] = redact(record.stack_info)
        return json.dumps(entry, default=lambda value: redact(str(value)), ensure_ascii=False)


class _QuietClients(logging.Filter):
    """Drops the HTTP clients' records below WARNING, whatever their loggers' levels say."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.name.startswith(_QUIET_PREFIXES)


class _ProcessField(logging.Filter):
    """Adds `process_name` (`rank1`, `preprocess-worker0`) to every record, for the JSON lines."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def filter(self, record: logging.LogRecord) -> bool:
        record.process_name = self.process
        return True


def make_formatter(fmt: str, stream: TextIO | None = None, process: str | None = None) -> logging.Formatter:
    """The formatter of `--log-format` `fmt` for lines written to `stream` (stderr by default)."""
    if fmt == "json":
        return JsonFormatter()
    if fmt == "text":
        return TextFormatter(colour=use_colour(sys.stderr if stream is None else stream), process=process)
    raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")


def configure_logging(level: str, fmt: str | None = None, stream: TextIO | None = None,
                      process: str | None = None) -> logging.Handler:
    """The root logger writes `fmt` lines at `level` to `stream` (stderr); the HTTP clients stay quiet.
    `fmt` None: `ENCODER_LOG_FORMAT` (which the server sets for the ranks and workers it starts), else text.
    `process` names a rank or worker in every line. Replaces the root logger's handlers; returns its one."""
    fmt = fmt or os.environ.get("ENCODER_LOG_FORMAT") or "text"
    if fmt not in LOG_FORMATS:
        fmt = "text"
    stream = sys.stderr if stream is None else stream
    handler = logging.StreamHandler(stream)
    handler.setFormatter(make_formatter(fmt, stream, process))
    handler.addFilter(_QuietClients())
    if process:
        handler.addFilter(_ProcessField(process))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
    logging.captureWarnings(True)  # Python warnings become log lines of the same format
    return handler


def route_library_logs() -> None:
    """The libraries that print through a handler of their own (transformers, the Hub client) log through
    the root logger's instead; the Hub client shows no progress bars (they interleave with the log)."""
    # Imported here (the server imports them anyway, later): their handlers are put on at first use.
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:
        pass
    else:
        transformers_logging.disable_default_handler()  # configures its logger first, then takes the handler
        transformers_logging.enable_propagation()
    try:
        from huggingface_hub.utils import disable_progress_bars
        from huggingface_hub.utils import logging as hub_logging
    except ImportError:
        pass
    else:
        hub_logging.get_logger()
        disable_progress_bars()
    for name in _LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        for handler in list(library.handlers):  # the server process owns its logging: one handler, the root's
            library.removeHandler(handler)
        library.propagate = True
    logging.getLogger("huggingface_hub").setLevel(logging.WARNING)


#: uvicorn's `log_config`: its loggers keep no handlers of their own and write through the root logger's,
#: so its lines have our format (uvicorn sets their levels from `log_level` after this).
UVICORN_LOG_CONFIG: dict[str, Any] = {
    "version": 1,
    "disable_existing_loggers": False,
    "loggers": {
        "uvicorn": {"handlers": [], "propagate": True},
        "uvicorn.error": {"handlers": [], "propagate": True},
        "uvicorn.access": {"handlers": [], "propagate": True},
    },
}


def logs_json() -> bool:
    """Whether the root logger writes JSON lines (`--log-format json`)."""
    return any(isinstance(handler.formatter, JsonFormatter) for handler in logging.getLogger().handlers)


#: How the line that says the server listens begins; `encode_server.bench.launcher` waits for it.
READY_LINE = "encode-server ready:"


def announce(logger: str, message: str) -> None:
    """Write `message` on stderr whatever the level (the ready line supervisors and the launcher wait for):
    as it is with text logs, as an INFO record with JSON logs (where every line is a JSON object)."""
    json_handlers = [handler for handler in logging.getLogger().handlers
                     if isinstance(handler.formatter, JsonFormatter)]
    if not json_handlers:
        print(message, file=sys.stderr, flush=True)
        return
    record = logging.LogRecord(logger, logging.INFO, __file__, 0, message, None, None)
    for handler in json_handlers:
        handler.handle(record)
        handler.flush()
