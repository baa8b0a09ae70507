"""Every setting of the server, declared once.

`OPTIONS` is the one table: each row is a command-line flag, its `ENCODER_` environment variable
(plus any drop-in aliases), its type, default and help. `load_settings` builds the argparse parser
from the table, takes defaults from the environment, lets the command line win, and returns a
validated, frozen `Settings`. The README's settings table and `--help` come from the same rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def parse_bool(text: str | bool) -> bool:
    """Read a boolean the way operators write one: true/false, 1/0, yes/no, on/off."""
    if isinstance(text, bool):
        return text
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on", "y", "t"):
        return True
    if value in ("0", "false", "no", "off", "n", "f"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


@dataclass(frozen=True)
class Option:
    """One setting: its flag, type, default and meaning; the env var is derived from the flag."""

    flag: str
    type: Callable[[str], Any]
    default: Any
    help: str
    aliases: tuple[str, ...] = ()  # extra env vars read when the ENCODER_ one is unset
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def env_var(self) -> str:
        return "ENCODER_" + self.dest.upper()


OPTIONS: tuple[Option, ...] = (
    Option("--model", str, "tiny-qwen2.5-vl",
           "a built-in model name (tiny-qwen2.5-vl, tiny-internvl, tiny-qwen2-audio) or the path of a local "
           "Hugging Face checkpoint folder (qwen2_5_vl, internvl or qwen2_audio)"),
    Option("--host", str, "127.0.0.1", "address HTTP listens on"),
    Option("--port", int, 30000, "port HTTP listens on"),
    Option("--device", str, "auto", "auto (cuda if available, else cpu), cpu, cuda or cuda:N"),
    Option("--dtype", str, "auto", "auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16 or float16",
           choices=("auto", "float32", "bfloat16", "float16")),
    Option("--max-batch-size", int, 32, "most requests fused into one encoder forward",
           aliases=("SGLANG_ENCODER_MAX_BATCH_SIZE",)),
    Option("--max-wait-ms", float, 0.0,
           "how long the oldest queued request may wait for company before its batch is dispatched"),
    Option("--min-batch-size", int, 1,
           "below this many queued requests, keep waiting after max-wait until the hard timeout"),
    Option("--hard-timeout-additional-s", float, 1.0,
           "after max-wait plus this, dispatch whatever is queued, however few"),
    Option("--max-batch-tokens", int, 0,
           "most encoder output tokens in one batch (0: no cap); a single larger request runs alone"),
    Option("--enable-dynamic-batching", parse_bool, True,
           "false: one request per forward, first in first out (the baseline)"),
    Option("--max-pending", int, 1024,
           "admitted but unfinished requests; beyond it new requests get 503 with Retry-After"),
    Option("--req-timeout-s", float, 180.0, "a request not answered by then gets 504",
           aliases=("SGLANG_ENCODER_REQ_TIMEOUT",)),
    Option("--send-timeout-s", float, 30.0,
           "longest wait for an embedding's destination to take it (and for receivers to register)"),
    Option("--tp-size", int, 1,
           "tensor-parallel ranks: the encoder is split over this many processes (one per GPU), started by rank 0"),
    Option("--dp-size", int, 1,
           "data-parallel replicas: whole copies of the encoder in this many processes (one per GPU), "
           "each batch to the least loaded"),
    Option("--api-key", str, None,
           "when set, every endpoint but /health needs 'Authorization: Bearer <key>' (else 401)"),
    Option("--allow-private-urls", parse_bool, False,
           "allow fetching media from loopback, private and link-local addresses"),
    Option("--allowed-local-media-dir", str, None,
           "local file paths (file:// or absolute) are accepted only inside this folder"),
    Option("--max-request-bytes", int, 64 * 1024 * 1024, "larger request bodies get 413"),
    Option("--max-image-pixels", int, 50_000_000,
           "larger images are refused (400) from their header, before they are decoded in full"),
    Option("--max-audio-seconds", float, 30.0,
           "longer audio clips are refused (400); the model's own window caps it too"),
    Option("--video-fps", float, 2.0, "frames per second sampled from a video file"),
    Option("--max-video-frames", int, 32,
           "most frames taken from one video: a file is sampled down to it, a longer frame list is refused"),
    Option("--drain-timeout-s", float, 30.0,
           "on SIGTERM or SIGINT, how long requests in flight may take to finish before the server exits"),
    Option("--health-probe-interval-s", float, 5.0,
           "/health pushes a tiny input through the encoder at most this often (the verdict is cached)"),
    Option("--health-probe-timeout-s", float, 60.0, "a health probe still running after this makes /health 503"),
    Option("--cpu-threads", int, 0,
           "torch intra-op threads on CPU (0: half the cores, leaving the rest to HTTP, decoding and the processor)"),
    Option("--media-workers", int, 4, "threads that fetch and decode media items"),
    Option("--log-level", str, "info", "log level: debug, info, warning or error",
           choices=("debug", "info", "warning", "error")),
    Option("--keep-alive-timeout-s", float, 75.0,
           "how long an idle HTTP connection stays open; keep it above every client's pool idle timeout, "
           "or a pooled request can meet the server's close and fail"),
    Option("--malloc-arena-max", int, 2,
           "glibc malloc arenas at most (0: glibc's default, 8 per core); fewer arenas keep less freed memory"),
    Option("--housekeeping-interval-s", float, 5.0,
           "how often to check whether the server went idle; then Python's full garbage collection runs and freed "
           "heap memory goes back to the system (malloc_trim); under unbroken load every 300 s "
           "(0: never, and Python collects on its own schedule)"),
)


@dataclass(frozen=True)
class Settings:
    """The effective settings of one server process."""

    model: str = "tiny-qwen2.5-vl"
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "auto"
    dtype: str = "auto"
    max_batch_size: int = 32
    max_wait_ms: float = 0.0
    min_batch_size: int = 1
    hard_timeout_additional_s: float = 1.0
    max_batch_tokens: int = 0
    enable_dynamic_batching: bool = True
    max_pending: int = 1024
    req_timeout_s: float = 180.0
    send_timeout_s: float = 30.0
    tp_size: int = 1
    dp_size: int = 1
    api_key: str | None = None
    allow_private_urls: bool = False
    allowed_local_media_dir: str | None = None
    max_request_bytes: int = 64 * 1024 * 1024
    max_image_pixels: int = 50_000_000
    max_audio_seconds: float = 30.0
    video_fps: float = 2.0
    max_video_frames: int = 32
    drain_timeout_s: float = 30.0
    health_probe_interval_s: float = 5.0
    health_probe_timeout_s: float = 60.0
    cpu_threads: int = 0
    media_workers: int = 4
    log_level: str = "info"
    keep_alive_timeout_s: float = 75.0
    malloc_arena_max: int = 2
    housekeeping_interval_s: float = 5.0

    def __post_init__(self) -> None:
        positive = ("max_batch_size", "min_batch_size", "max_pending", "max_request_bytes",
                    "max_image_pixels", "media_workers", "max_video_frames", "tp_size", "dp_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("max_wait_ms", "hard_timeout_additional_s", "max_batch_tokens", "drain_timeout_s", "cpu_threads",
                     "health_probe_interval_s", "malloc_arena_max", "housekeeping_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must not be negative, got {getattr(self, name)}")
        for name in ("max_audio_seconds", "video_fps", "send_timeout_s", "health_probe_timeout_s",
                     "keep_alive_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.tp_size > 1 and self.dp_size > 1:
            raise ValueError("--tp-size and --dp-size cannot both be above 1 in one server: run one server per "
                             "tensor-parallel group and balance across them")
        if self.req_timeout_s <= 0:
            raise ValueError(f"--req-timeout-s must be positive, got {self.req_timeout_s}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")

    def public_dict(self) -> dict[str, Any]:
        """The settings as `/server_info` shows them (never the API key itself)."""
        data = dataclasses.asdict(self)
        data["api_key"] = "***" if self.api_key else None
        return data


def _env_default(option: Option, environ: Mapping[str, str]) -> Any:
    for name in (option.env_var, *option.aliases):
        raw = environ.get(name)
        if raw is not None and raw != "":
            try:
                value = option.type(raw)
            except ValueError as exc:
                raise SystemExit(f"encode-server: bad value for {name}: {exc}") from None
            if option.choices and value not in option.choices:
                raise SystemExit(f"encode-server: {name} must be one of {', '.join(option.choices)}, got {raw!r}")
            return value
    return option.default


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The CLI parser, with defaults taken from the environment."""
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="encode-server",
        description="Multimodal encoder service: batches images, audio and video across requests into "
        "one encoder forward. Every flag also reads ENCODER_<FLAG>; the command line wins.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for option in OPTIONS:
        env_names = " or ".join((option.env_var, *option.aliases))
        kwargs: dict[str, Any] = dict(
            dest=option.dest,
            type=option.type,
            default=_env_default(option, environ),
            help=f"{option.help} [env: {env_names}]",
        )
        if option.type is parse_bool:
            kwargs.update(nargs="?", const=True, metavar="BOOL")
        if option.choices:
            kwargs["choices"] = option.choices
        parser.add_argument(option.flag, **kwargs)
    return parser


def load_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from the command line over the environment over the defaults."""
    parser = build_parser(environ)
    namespace = parser.parse_args(argv)
    try:
        return Settings(**vars(namespace))
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def settings_table_markdown() -> str:
    """The README's table of settings, generated from `OPTIONS`."""
    rows = ["| flag | env var | default | meaning |", "| --- | --- | --- | --- |"]
    for option in OPTIONS:
        env = ", ".join(f"`{name}`" for name in (option.env_var, *option.aliases))
        default = str(option.default).lower() if isinstance(option.default, bool) else option.default
        default = "none" if default is None else default
        rows.append(f"| `{option.flag}` | {env} | `{default}` | {option.help} |")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m encode_server.settings prints the README's table
    print(settings_table_markdown())
