"""Every setting of the server, declared once.

`GROUPS` is the one table. Each `Option` row is a command-line flag with its `ENCODER_` environment
variable (plus any drop-in aliases), its type, default, help, allowed values and the check its value
must pass; each `Group` gathers the rows of one part of the server and names the package that reads
them. From the table come the argparse parser (`--help` in those groups), the `Settings` record (one
field per row, built by `dataclasses.make_dataclass`: no second list of fields) and the tables of
docs/CONFIGURATION.md (`python -m encode_server.ops.settings`). `load_settings` takes defaults from the
environment, lets the command line win and returns a frozen `Settings` whose values were checked: each
by its own row, then the few combinations that cannot go together (`check_together`). Nothing here
probes installed libraries: the component that needs one says so at start-up (`runtime.check_libraries`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import encode_server
from encode_server.ops.cores import usable_cores
from encode_server.ops.logs import LOG_FORMATS
from encode_server.ops.memory import parse_byte_size, parse_cache_bytes
from encode_server.ops.setting_values import (
    advertised_url,
    check_class_path,
    exempt_networks,
    parse_store_url,
    registry_urls,
)
from encode_server.ops.tracing import parse_traces_endpoint


def parse_bool(text: str | bool) -> bool:
    """Read a boolean the way operators write one: true/false, 1/0, yes/no, on/off."""
    if isinstance(text, bool):
        return text
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on", "y", "t"):
        return True
    if value in ("0", "false", "no", "off", "n", "f"):
        return False
    raise ValueError(f"expected true or false (or 1/0, yes/no, on/off), got {text!r}")


#: `--dtype` values besides auto: the names of `encode_server.models.dtypes.DTYPES`, written out so that reading the
#: settings (and `--help`, `--version`) never imports torch.
DTYPE_CHOICES = ("float32", "bfloat16", "float16")

#: `--device` values, as the error for any other names them.
DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:[0-9]+)$")


def check_device(text: str) -> str:
    """A `--device` value: auto, cpu, cuda or cuda:N (whether CUDA is there is checked at start-up)."""
    if not _DEVICE.match(text):
        raise ValueError(f"--device {text!r} is not a device: expected {DEVICE_CHOICES} "
                         f"(N: the GPU's index, as nvidia-smi lists them)")
    return text


#: `--max-wait-ms auto`: the wait is chosen per decision from the learned cost curve.
AUTO_WAIT = "auto"


def parse_wait_ms(text: str | float) -> float | str:
    """`--max-wait-ms`: milliseconds, or `auto`."""
    if isinstance(text, (int, float)):
        return float(text)
    if text.strip().lower() == AUTO_WAIT:
        return AUTO_WAIT
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected milliseconds or 'auto', got {text!r}") from None


# --- the checks a row's value must pass -------------------------------------------------------------
#: A value check: given the flag and a value (never None: an unset optional setting is not checked), raise
#: ValueError with a one-line message that names the flag.
Check = Callable[[str, Any], None]


def at_least(low: int, words: str | None = None) -> Check:
    def check(flag: str, value: Any) -> None:
        if value < low:
            raise ValueError(f"{flag} must be {words or f'at least {low}'}, got {value}")
    return check


def between(low: int, high: int) -> Check:
    def check(flag: str, value: Any) -> None:
        if not low <= value <= high:
            raise ValueError(f"{flag} must be in {low}..{high}, got {value}")
    return check


def not_negative(flag: str, value: Any) -> None:
    if value < 0:
        raise ValueError(f"{flag} must not be negative, got {value}")


def positive(flag: str, value: Any) -> None:
    if value <= 0:
        raise ValueError(f"{flag} must be positive, got {value}")


def wait_ms(flag: str, value: Any) -> None:
    if isinstance(value, str) and value != AUTO_WAIT:
        raise ValueError(f"{flag} must be milliseconds or '{AUTO_WAIT}', got {value!r}")
    if not isinstance(value, str) and value < 0:
        raise ValueError(f"{flag} must not be negative, got {value}")


def a_folder(flag: str, value: Any) -> None:
    if not value.strip():
        raise ValueError(f"{flag} must name a folder")


def parsed(parse: Callable[[Any], Any]) -> Check:
    """The value must be read by `parse`, whose own message names the flag."""
    def check(flag: str, value: Any) -> None:
        parse(value)
    return check


def a_json_object(flag: str, value: Any) -> None:
    """JSON text of an object (what it means is read by the part it configures, when the server starts)."""
    try:
        data = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"{flag} is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{flag} must be a JSON object, got {type(data).__name__}")


def named(parse: Callable[[Any], Any]) -> Check:
    """The value must be read by `parse`; its message is given after the flag."""
    def check(flag: str, value: Any) -> None:
        try:
            parse(value)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
    return check


def _words(choices: Sequence[str]) -> str:
    return ", ".join(choices[:-1]) + f" or {choices[-1]}" if len(choices) > 1 else choices[0]


@dataclass(frozen=True)
class Option:
    """One setting: its flag, type (what reads its text), default, meaning, allowed values and check; the env
    var and the `Settings` field are derived from the flag."""

    flag: str
    type: Callable[[str], Any]
    default: Any
    help: str
    aliases: tuple[str, ...] = ()  # extra env vars read when the ENCODER_ one is unset
    choices: tuple[str, ...] | None = None
    check: Check | None = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def env_var(self) -> str:
        return "ENCODER_" + self.dest.upper()

    def validate(self, value: Any) -> None:
        """ValueError naming the flag unless `value` is one this setting takes (None: unset, always taken)."""
        if value is None:
            return
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{self.flag} must be {_words(self.choices)}, got {value!r}")
        if self.check is not None:
            self.check(self.flag, value)


@dataclass(frozen=True)
class Group:
    """The settings of one part of the server: its title, the package that reads them, and what they set."""

    title: str
    owner: str
    about: str
    options: tuple[Option, ...]


GROUPS: tuple[Group, ...] = (
    Group("Model and device", "runtime.py, parallel/", "what is encoded, where, and over how many processes", (
        Option("--model", str, "tiny-qwen2.5-vl",
               "a built-in model name (such as tiny-qwen2.5-vl), the path of a local Hugging Face checkpoint "
               "folder whose model_type a family serves (`python -m encode_server.models.registry` lists both), or a "
               "Hub id org/name[@revision], of which only the encoder's tensors are downloaded (HF_HOME, HF_TOKEN, "
               "HF_HUB_OFFLINE apply)"),
        Option("--device", str, "auto", f"{DEVICE_CHOICES} (auto: cuda if available, else cpu)",
               check=parsed(check_device)),
        Option("--dtype", str, "auto", "auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16 or float16",
               choices=("auto", *DTYPE_CHOICES)),
        Option("--tp-size", int, 1,
               "tensor-parallel ranks: the encoder is split over this many processes (one per GPU), started by rank 0",
               check=at_least(1)),
        Option("--dp-size", int, 1,
               "data-parallel replicas: whole copies of the encoder in this many processes (one per GPU), "
               "each batch to the least loaded",
               check=at_least(1)),
        Option("--cpu-threads", int, 0,
               "torch intra-op threads on CPU (0: half the cores, leaving the rest to HTTP, decoding and the "
               "processor)",
               check=not_negative),
    )),
    Group("Listening and access", "http/, __main__.py", "the HTTP listener, the API key and the drain", (
        Option("--host", str, "127.0.0.1", "address HTTP listens on"),
        Option("--port", int, 30000, "port HTTP listens on",
               check=between(0, 65535)),
        Option("--grpc-port", int, None,
               "port SGLang's gRPC encoder service (sglang.grpc.encoder.SglangEncoder, with gRPC health and "
               "reflection) listens on, on --host; off when unset. Needs the grpc extra: "
               "pip install 'encode-server[grpc]'",
               check=between(0, 65535)),
        Option("--api-key", str, None,
               "when set, every endpoint but /health and /metrics needs 'Authorization: Bearer <key>' (else 401)"),
        Option("--api-key-exempt-cidrs", str, None,
               "with --api-key: comma-separated networks (CIDR, e.g. 10.244.0.0/16) whose requests need no key; for "
               "callers that cannot send one (SGLang's prefill ranks and vLLM's proxy send no Authorization header): "
               "keep that network reachable only by them (docs/DEPLOYMENT.md, Security)",
               check=parsed(exempt_networks)),
        Option("--metrics-require-key", parse_bool, False,
               "with --api-key: /metrics needs the key too (Prometheus then sends it: authorization in its scrape "
               "config); by default a scraper reads /metrics without it"),
        Option("--max-request-bytes", int, 64 * 1024 * 1024, "larger request bodies get 413",
               check=at_least(1)),
        Option("--keep-alive-timeout-s", float, 75.0,
               "how long an idle HTTP connection stays open; keep it above every client's pool idle timeout, "
               "or a pooled request can meet the server's close and fail",
               check=positive),
        Option("--drain-timeout-s", float, 30.0,
               "on SIGTERM or SIGINT, how long requests in flight may take to finish before the server exits",
               check=not_negative),
    )),
    Group("Batching and admission", "scheduling/, admission/", "which requests share a forward, and which get in", (
        Option("--max-batch-size", int, 32, "most requests fused into one encoder forward",
               aliases=("SGLANG_ENCODER_MAX_BATCH_SIZE",),
               check=at_least(1)),
        Option("--max-wait-ms", parse_wait_ms, 0.0,
               "how long the oldest queued request may wait for company before its batch is dispatched; 'auto': "
               "chosen per decision from the learned cost of a forward and the arrival rate (min-batch-size unused, "
               "hard-timeout-additional-s still caps the wait)",
               check=wait_ms),
        Option("--min-batch-size", int, 1,
               "below this many queued requests, keep waiting after max-wait until the hard timeout",
               check=at_least(1)),
        Option("--hard-timeout-additional-s", float, 1.0,
               "after max-wait plus this, dispatch whatever is queued, however few",
               check=not_negative),
        Option("--max-batch-tokens", int, 0,
               "most encoder output tokens in one batch (0: no cap); a single larger request runs alone",
               check=not_negative),
        Option("--enable-dynamic-batching", parse_bool, True,
               "false: one request per forward, first in first out (the baseline)"),
        Option("--max-pending", int, 1024,
               "admitted but unfinished requests; beyond it new requests get 503 with Retry-After",
               check=at_least(1)),
        Option("--req-timeout-s", float, 180.0, "a request not answered by then gets 504",
               aliases=("SGLANG_ENCODER_REQ_TIMEOUT",),
               check=positive),
        Option("--max-priority", int, 9,
               "highest /encode 'priority' accepted (0 is the default and lowest; outside 0..this: 400)",
               check=not_negative),
    )),
    Group("Media and preprocessing", "media/, preprocessing/",
          "fetching, decoding and preprocessing items within their limits", (
        Option("--allow-private-urls", parse_bool, False,
               "allow fetching media from loopback, private and link-local addresses"),
        Option("--allowed-local-media-dir", str, None,
               "local file paths (file:// or absolute) are accepted only inside this folder"),
        Option("--max-image-pixels", int, 50_000_000,
               "larger images are refused (400) from their header, before they are decoded in full",
               check=at_least(1)),
        Option("--max-audio-seconds", float, 30.0,
               "longer audio clips are refused (400); the model's own window caps it too",
               check=positive),
        Option("--video-fps", float, 2.0, "frames per second sampled from a video file",
               check=positive),
        Option("--max-video-frames", int, 32,
               "most frames taken from one video: a file is sampled down to it, a longer frame list is refused",
               check=at_least(1)),
        Option("--media-workers", int, 4, "threads that fetch and decode media items",
               check=at_least(1)),
        Option("--preprocess-workers", int, 0,
               "processes that decode and preprocess images (each item on its own, results in shared memory); "
               "0: in the server process; -1: every core but one, at least 2 (0 on one core); not with --tp-size > 1",
               check=at_least(-1, "-1 (auto), 0 or more")),
        Option("--preprocess-device", str, "cpu",
               "where image preprocessing runs: cpu (PIL) or cuda (transformers' fast image processors on the "
               "model's GPU; needs a CUDA device and torchvision)", choices=("cpu", "cuda")),
    )),
    Group("Operations", "ops/", "health, logs, traces and memory", (
        Option("--health-probe-interval-s", float, 5.0,
               "/health pushes a tiny input through the encoder at most this often (the verdict is cached)",
               check=not_negative),
        Option("--health-probe-timeout-s", float, 60.0, "a health probe still running after this makes /health 503",
               check=positive),
        Option("--log-level", str, "info", "log level: debug, info, warning or error",
               choices=("debug", "info", "warning", "error")),
        Option("--log-format", str, "text",
               "text (one line per record, the level coloured only on a terminal and never with NO_COLOR set) or json "
               "(one JSON object per line: time, level, logger, message and the record's extra fields)",
               choices=LOG_FORMATS),
        Option("--otlp-traces-endpoint", parse_traces_endpoint, None,
               "send OpenTelemetry traces to this OTLP/HTTP collector (http://HOST:4318; /v1/traces is added when no "
               "path is given), as vLLM's and SGLang's flag of the same name: a caller's W3C traceparent on /encode "
               "and /v1/chat/completions is continued, with a span per stage (docs/OPERATIONS.md, Traces); needs the "
               "otel extra; unset: off, and nothing of OpenTelemetry is loaded"),
        Option("--otlp-traces-sample-ratio", float, 1.0,
               "with --otlp-traces-endpoint: the share of the requests without a traceparent that are traced (0 to "
               "1); a caller's traceparent decides for its own requests",
               check=between(0, 1)),
        Option("--malloc-arena-max", int, 2,
               "glibc malloc arenas at most (0: glibc's default, 8 per core); fewer arenas keep less freed memory",
               check=not_negative),
        Option("--housekeeping-interval-s", float, 5.0,
               "how often to check whether the server went idle; then Python's full garbage collection runs and freed "
               "heap memory goes back to the system (malloc_trim); under unbroken load every 300 s "
               "(0: never, and Python collects on its own schedule)",
               check=not_negative),
    )),
    Group("Embedding cache", "cache/", "the per-item cache and its shared tier in Mooncake Store", (
        Option("--cache-bytes", parse_cache_bytes, "auto",
               "bound of the per-item embedding cache in bytes (e.g. 536870912 or 512MiB); auto: 5 percent of the "
               "memory, at most 1 GiB; 0 turns the cache and in-flight deduplication off"),
        Option("--cache-store", str, None,
               "the embedding cache's shared second tier: mooncake://HOST:PORT, a Mooncake Store master (its "
               "--rpc_port); a local miss is read from the Store before encoding, and what is encoded is published "
               "there for the pool; needs the mooncake extra (docs/DEPLOYMENT.md, A pool-wide cache)",
               check=parsed(parse_store_url)),
        Option("--cache-store-metadata-server", str, "P2PHANDSHAKE",
               "Mooncake metadata_server: P2PHANDSHAKE (none), or an etcd/HTTP metadata server address"),
        Option("--cache-store-protocol", str, "tcp", "Mooncake transfer protocol", choices=("tcp", "rdma")),
        Option("--cache-store-device-name", str, "",
               "Mooncake device_name: the RDMA devices (e.g. mlx5_0,mlx5_1) with --cache-store-protocol rdma"),
        Option("--cache-store-local-hostname", str, "",
               "Mooncake local_hostname: the address other Store clients reach this one at "
               "(default: this host's address on the route to the master)"),
        Option("--cache-store-global-segment-size", parse_byte_size, 512 << 20,
               "Mooncake global_segment_size: memory this server lends the Store (512 MiB; e.g. 4GiB); 0: none, "
               "a pure client (entries in a server's segment go when it stops)"),
        Option("--cache-store-local-buffer-size", parse_byte_size, 128 << 20,
               "Mooncake local_buffer_size: the client's transfer buffer (128 MiB); one read must fit in it "
               "(an item's rows)"),
        Option("--cache-store-timeout-ms", float, 100.0,
               "longest wait for a Store read; a later answer is a miss (the item is encoded)",
               check=positive),
        Option("--cache-store-publish-items", int, 1024,
               "items waiting to be published to the Store at most; beyond, an item is not published (counted)",
               check=not_negative),
        Option("--cache-store-publish-bytes", parse_byte_size, 256 << 20,
               "bytes waiting to be published to the Store at most; beyond, an item is not published (counted)",
               check=not_negative),
        Option("--cache-store-prefix", str, "",
               "vLLM's embedding_cache_prefix: the first part of every Store key (empty: none)"),
        Option("--cache-store-model", str, None,
               "vLLM's embedding_model_identity: the model part of the Store keys (default: --ec-model-id, else "
               "--model)"),
        Option("--cache-store-revision", str, "default",
               "the revision part of the Store keys (vLLM: the consumer's --revision, else default)"),
        Option("--cache-store-encoder-hash", str, "auto",
               "the encoder part of vLLM's Store keys, vLLM's MultiModalConfig.compute_hash(); auto: vLLM 0.33's "
               "value with its default encoder settings"),
    )),
    Group("ZMQ delivery", "delivery/", "rows pushed to prefill receivers", (
        Option("--send-timeout-s", float, 30.0,
               "longest wait for an embedding's destination to take it (and for receivers to register)",
               check=positive),
        Option("--wire-format", str, "native",
               "ZMQ frames for prefill receivers: native (a JSON header and the raw bytes, docs/CONTRACT.md section 3) "
               "or sglang (SGLang's pickled EmbeddingData and the raw bytes, for an unchanged SGLang prefill server)",
               choices=("native", "sglang")),
        Option("--sglang-embedding-class", str, "sglang.srt.disaggregation.encoder.receiver.EmbeddingData",
               "with --wire-format sglang: the class path frame 0 names (SGLang 0.5.21+; 0.5.12 to 0.5.18: "
               "sglang.srt.disaggregation.encode_receiver.EmbeddingData)",
               check=named(check_class_path)),
    )),
    Group("SGLang front", "fronts/sglang/", "SGLang's encoder registry and its mooncake transfer backend", (
        Option("--register-with", str, None,
               "comma-separated URLs of SGLang encoder registries: on start POST {url}/register_encoder_url with "
               "this encoder's URL, on drain DELETE {url}/unregister_encoder_url",
               check=parsed(registry_urls)),
        Option("--advertise-url", str, None,
               "the URL others reach this encoder at, for --register-with (default: http://HOST:PORT)"),
        Option("--encoder-transfer-backend", str, "zmq_to_scheduler",
               "SGLang's --encoder-transfer-backend, as its language side runs: zmq_to_scheduler or zmq_to_tokenizer "
               "(rows pushed over ZMQ, as --wire-format says), or mooncake (rows staged here; each receiver rank "
               "pulls their sizes from /scheduler_receive_meta_data and has them written into its buffer with "
               "Mooncake's TransferEngine through /send, then gets SGLang's EmbeddingData frame)",
               choices=("zmq_to_scheduler", "zmq_to_tokenizer", "mooncake")),
        Option("--mooncake-protocol", str, "rdma",
               "with --encoder-transfer-backend mooncake: the TransferEngine's transport, rdma (SGLang's default) or "
               "tcp (no RDMA NIC needed)", aliases=("MOONCAKE_PROTOCOL",), choices=("rdma", "tcp", "efa")),
        Option("--disaggregation-ib-device", str, None,
               "with --encoder-transfer-backend mooncake: the RDMA device(s) the TransferEngine uses, as SGLang's flag "
               "(default: its own discovery)"),
        Option("--mooncake-host", str, None,
               "with --encoder-transfer-backend mooncake: the address this encoder's TransferEngine is known by "
               "(default: the host of --advertise-url, else --host when it is not a wildcard)"),
        Option("--mooncake-registered-bytes", parse_byte_size, 4 << 30,
               "with --encoder-transfer-backend mooncake: most bytes of rows registered with the TransferEngine at "
               "once (e.g. 4GiB); a /send beyond it gets 503 with Retry-After",
               check=positive),
    )),
    Group("vLLM front", "fronts/vllm/", "vLLM's encoder instance and its EC connectors", (
        Option("--ec-storage", str, None,
               "vLLM producer: the folder vLLM's ECExampleConnector reads (its shared_storage_path); turns on "
               "POST /v1/chat/completions, which writes each item's rows to "
               "PATH/<identifier>/encoder_cache.safetensors (docs/DEPLOYMENT.md, Using it with vLLM)",
               check=a_folder),
        Option("--ec-model-id", str, None,
               "vLLM producer: the consumer's --model string, which goes into every item's identifier "
               "(default: this server's --model)"),
        Option("--ec-hash-algorithm", str, "blake3",
               "vLLM producer: the consumer's --mm-hasher-algorithm", choices=("blake3", "sha256", "sha512")),
        Option("--ec-storage-bytes", parse_byte_size, 0,
               "vLLM producer: bound of the storage in bytes (e.g. 20GiB); the items least recently written or hit "
               "are deleted beyond it; 0: no bound",
               check=not_negative),
        Option("--ec-storage-min-age-s", float, 600.0,
               "vLLM producer: an item written or hit less than this long ago is never deleted, whatever the bound "
               "(a consumer may be about to load it)",
               check=not_negative),
        Option("--ec-transfer-config", str, None,
               "vLLM producer: vLLM's --ec-transfer-config JSON, as the consumers are started with: ec_connector "
               "ECMooncakeConnector (rows pushed with Mooncake's TransferEngine into the consumer's reserved buffer; "
               "ec_buffer_size bounds the registered memory, ec_connector_extra_config.mooncake_protocol rdma or tcp), "
               "ECCPUConnector with ec_connector_extra_config.ec_enable_nixl true (rows kept in CPU memory registered "
               "with NIXL, ec_cpu_bytes of it, which consumers read; its side channel at "
               "--ec-side-channel-host/-port) or ECExampleConnector (its shared_storage_path: the files of "
               "--ec-storage); ec_role ec_producer (docs/DEPLOYMENT.md, Using it with vLLM); read and checked by the "
               "vLLM front before the model loads",
               check=a_json_object),
        Option("--ec-side-channel-host", str, "localhost",
               "with ECCPUConnector: the address its side channel (the ZMQ socket consumers ask for items on) listens "
               "on and is announced as, vLLM's VLLM_EC_SIDE_CHANNEL_HOST", aliases=("VLLM_EC_SIDE_CHANNEL_HOST",)),
        Option("--ec-side-channel-port", int, 5601,
               "with ECCPUConnector: the side channel's port, vLLM's VLLM_EC_SIDE_CHANNEL_PORT",
               aliases=("VLLM_EC_SIDE_CHANNEL_PORT",),
               check=between(1, 65535)),
        Option("--ec-vllm-version", str, "0.33.0",
               "vLLM producer: the consumers' vLLM version as their vllm.__version__ reads (a 0.32 or 0.33 release): "
               "it chooses how items are decoded and identified (0.32 keeps an RGB PNG with a tRNS chunk as it is, "
               "0.33 puts it on white), what the answer's ec_transfer_params hold, and with ECCPUConnector it is one "
               "of the four parts of the compatibility hash a consumer sends with each read (with the model, "
               "--ec-model-id else --model; the dtype, --dtype; and the block size, the language model's hidden size "
               "in bytes); a consumer whose hash differs is refused"),
    )),
)

#: Every row, group by group: the order of `--help`, of CONFIGURATION.md and of the `Settings` fields.
OPTIONS: tuple[Option, ...] = tuple(option for group in GROUPS for option in group.options)

#: Setting name -> default, from the one table.
DEFAULTS: dict[str, Any] = {option.dest: option.default for option in OPTIONS}


def check_together(settings: Settings) -> None:
    """The combinations of values that cannot go together, each refused in one line that says why."""
    if settings.grpc_port is not None and settings.grpc_port == settings.port and settings.port != 0:
        raise ValueError(f"--grpc-port and --port are both {settings.port}: give gRPC a port of its own")
    if settings.preprocess_device != "cpu" and (settings.tp_size > 1 or settings.dp_size > 1):
        raise ValueError("--preprocess-device cuda is for single-process servers: with --tp-size or --dp-size "
                         "above 1 every rank must preprocess alike")
    if settings.tp_size > 1 and settings.dp_size > 1:
        raise ValueError("--tp-size and --dp-size cannot both be above 1 in one server: run one server per "
                         "tensor-parallel group and balance across them")
    if settings.cache_store is not None and settings.cache_bytes == 0:
        raise ValueError("--cache-store is the second tier of the embedding cache: it needs the first "
                         "(--cache-bytes above 0, or auto)")
    if settings.encoder_transfer_backend == "mooncake":
        settings.transfer_host  # noqa: B018 - refuses a wildcard --host without --mooncake-host
    if settings.register_with:
        advertised_url(settings.host, settings.port, settings.advertise_url)


class SettingsViews:
    """What `Settings` adds to its fields: the check on construction and the values derived from several
    fields. (`Settings` itself is made from `OPTIONS` below.)"""

    def __post_init__(self) -> None:
        for option in OPTIONS:
            option.validate(getattr(self, option.dest))
        check_together(self)

    @property
    def ec_identifier_model(self) -> str:
        """The model string in vLLM identifiers: `--ec-model-id`, else `--model`."""
        return self.ec_model_id or self.model

    @property
    def transfer_host(self) -> str:
        """The address the SGLang mooncake backend's TransferEngine is known by."""
        if self.mooncake_host:
            return self.mooncake_host
        if self.advertise_url:
            from urllib.parse import urlsplit

            host = urlsplit(self.advertise_url).hostname
            if host:
                return host
        if self.host in ("0.0.0.0", "::", ""):
            raise ValueError(f"--encoder-transfer-backend mooncake: --host {self.host!r} is a wildcard; give the "
                             f"address receivers know this encoder by with --mooncake-host (or --advertise-url)")
        return self.host

    @property
    def adaptive_wait(self) -> bool:
        """`--max-wait-ms auto`."""
        return self.max_wait_ms == AUTO_WAIT

    def cpu_threads_per_rank(self, ranks: int) -> int:
        """torch intra-op threads for each of `ranks` processes sharing the CPU: `--cpu-threads`, or by default
        half the cores this process may use (its affinity, within a container's quota: `ops/cores.py`): the rest
        is for the event loop, decoding and the processor, which OpenMP threads spinning between ops would
        starve."""
        threads = self.cpu_threads or max(1, usable_cores() // 2)
        return max(1, threads // ranks)

    def public_dict(self) -> dict[str, Any]:
        """The settings as `/server_info` shows them (never the API key itself)."""
        data = dataclasses.asdict(self)
        data["api_key"] = "***" if self.api_key else None
        return data


#: What a row's type reads to, as the field's annotation (a parser function: whatever it returns).
_ANNOTATIONS: dict[Any, Any] = {parse_bool: bool, parse_byte_size: int, parse_cache_bytes: "int | str",
                                parse_wait_ms: "float | str"}


def _field(option: Option) -> tuple[str, Any, Any]:
    annotation = _ANNOTATIONS.get(option.type, option.type)
    if option.default is None:
        annotation = f"{getattr(annotation, '__name__', annotation)} | None"
    return option.dest, annotation, dataclasses.field(default=option.default)


#: The effective settings of one server process: a frozen record with one field per row of `OPTIONS` (its
#: default the row's), checked when it is made.
Settings = dataclasses.make_dataclass(
    "Settings", [_field(option) for option in OPTIONS], bases=(SettingsViews,), frozen=True,
    namespace={"__module__": __name__,
               "__doc__": "The effective settings of one server process: one field per row of `OPTIONS`."})


#: What a plain int or float setting accepts, for the errors that name the flag or variable.
_PLAIN_TYPES = {int: "a whole number (such as 8)", float: "a number (such as 2.5)"}


def parse_value(option: Option, text: str) -> Any:
    """`text` read as `option`'s type; a ValueError that says what the option accepts and what it got."""
    try:
        return option.type(text)
    except (ValueError, TypeError) as exc:
        if option.type in _PLAIN_TYPES:
            raise ValueError(f"expected {_PLAIN_TYPES[option.type]}, got {text!r}") from None
        raise ValueError(str(exc)) from None


def _argparse_type(option: Option) -> Callable[[str], Any]:
    """`option.type` for argparse: its error becomes argparse's `argument --flag: <what is accepted>, got 'x'`
    (a plain ValueError gives `invalid parse_bool value: 'x'`, naming a function and no accepted value)."""
    def parse(text: str) -> Any:
        try:
            return parse_value(option, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = option.dest
    return parse


def _env_default(option: Option, environ: Mapping[str, str]) -> Any:
    for name in (option.env_var, *option.aliases):
        raw = environ.get(name)
        if raw is not None and raw != "":
            try:
                value = parse_value(option, raw)
            except ValueError as exc:
                raise SystemExit(f"encode-server: bad value for {name} ({option.flag}): {exc}") from None
            try:
                option.validate(value)
            except ValueError as exc:  # its message names the flag
                raise SystemExit(f"encode-server: bad value for {name}: {exc}") from None
            return value
    return option.default


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The CLI parser, one argument group per `Group`, with defaults taken from the environment. Values are
    checked once, when `Settings` is made from them (argparse only reads them)."""
    environ = os.environ if environ is None else environ
    parser = _OneLineErrorParser(
        prog="encode-server", usage="encode-server [options]  (encode-server --help lists them)",
        description="Multimodal encoder service: batches images, audio and video across requests into "
        "one encoder forward. Every flag also reads ENCODER_<FLAG>; the command line wins.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for group in GROUPS:
        arguments = parser.add_argument_group(f"{group.title} ({group.owner})", f"{group.about[0].upper()}"
                                              f"{group.about[1:]}.")
        for option in group.options:
            env_names = " or ".join((option.env_var, *option.aliases))
            kwargs: dict[str, Any] = dict(
                dest=option.dest,
                type=_argparse_type(option),
                default=_env_default(option, environ),
                help=f"{option.help} [env: {env_names}]",
            )
            if option.type is parse_bool:
                kwargs.update(nargs="?", const=True, metavar="BOOL")
            if option.choices:
                kwargs["metavar"] = "{" + ",".join(option.choices) + "}"
            arguments.add_argument(option.flag, **kwargs)
    parser.add_argument("--version", action="version", version=f"encode-server {encode_server.__version__}",
                        help="print the version and exit")
    return parser


class _OneLineErrorParser(argparse.ArgumentParser):
    """A bad flag or value is one line on stderr (exit status 2), not the whole usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


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
    """CONFIGURATION.md's tables of settings, one per group, generated from `GROUPS`."""
    sections = []
    for group in GROUPS:
        rows = [f"## {group.title}", "", f"{group.about[0].upper()}{group.about[1:]}; read by "
                f"{', '.join(f'`{owner.strip()}`' for owner in group.owner.split(','))}.", "",
                "| flag | env var | default | meaning |", "| --- | --- | --- | --- |"]
        for option in group.options:
            env = ", ".join(f"`{name}`" for name in (option.env_var, *option.aliases))
            default = str(option.default).lower() if isinstance(option.default, bool) else option.default
            default = "none" if default is None else default
            rows.append(f"| `{option.flag}` | {env} | `{default}` | {option.help} |")
        sections.append("\n".join(rows))
    return "\n\n".join(sections)


if __name__ == "__main__":  # python -m encode_server.ops.settings prints CONFIGURATION.md's tables
    print(settings_table_markdown())
