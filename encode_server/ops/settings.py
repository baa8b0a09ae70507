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
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import encode_server
from encode_server.ops.cores import usable_cores
from encode_server.ops.libraries import installed, missing_message
from encode_server.ops.logs import LOG_FORMATS
from encode_server.ops.memory import parse_byte_size, parse_cache_bytes
from encode_server.ops.setting_values import (
    advertised_url,
    check_class_path,
    exempt_networks,
    parse_store_url,
    registry_urls,
)
from encode_server.ops.transfer_config import ECTransferConfig, parse_ec_transfer_config


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
           "a built-in model name (such as tiny-qwen2.5-vl), the path of a local Hugging Face checkpoint "
           "folder whose model_type a family serves (`python -m encode_server.models.registry` lists both), or a "
           "Hub id org/name[@revision], of which only the encoder's tensors are downloaded (HF_HOME, HF_TOKEN, "
           "HF_HUB_OFFLINE apply)"),
    Option("--host", str, "127.0.0.1", "address HTTP listens on"),
    Option("--port", int, 30000, "port HTTP listens on"),
    Option("--grpc-port", int, None,
           "port SGLang's gRPC encoder service (sglang.grpc.encoder.SglangEncoder, with gRPC health and reflection) "
           "listens on, on --host; off when unset. Needs the grpc extra: pip install 'encode-server[grpc]'"),
    Option("--device", str, "auto", f"{DEVICE_CHOICES} (auto: cuda if available, else cpu)"),
    Option("--dtype", str, "auto", "auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16 or float16",
           choices=("auto", *DTYPE_CHOICES)),
    Option("--max-batch-size", int, 32, "most requests fused into one encoder forward",
           aliases=("SGLANG_ENCODER_MAX_BATCH_SIZE",)),
    Option("--max-wait-ms", parse_wait_ms, 0.0,
           "how long the oldest queued request may wait for company before its batch is dispatched; 'auto': "
           "chosen per decision from the learned cost of a forward and the arrival rate (min-batch-size unused, "
           "hard-timeout-additional-s still caps the wait)"),
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
           "when set, every endpoint but /health and /metrics needs 'Authorization: Bearer <key>' (else 401)"),
    Option("--api-key-exempt-cidrs", str, None,
           "with --api-key: comma-separated networks (CIDR, e.g. 10.244.0.0/16) whose requests need no key; for "
           "callers that cannot send one (SGLang's prefill ranks and vLLM's proxy send no Authorization header): "
           "keep that network reachable only by them (docs/DEPLOYMENT.md, Security)"),
    Option("--metrics-require-key", parse_bool, False,
           "with --api-key: /metrics needs the key too (Prometheus then sends it: authorization in its scrape "
           "config); by default a scraper reads /metrics without it"),
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
    Option("--log-format", str, "text",
           "text (one line per record, the level coloured only on a terminal and never with NO_COLOR set) or json "
           "(one JSON object per line: time, level, logger, message and the record's extra fields)",
           choices=LOG_FORMATS),
    Option("--wire-format", str, "native",
           "ZMQ frames for prefill receivers: native (a JSON header and the raw bytes, docs/CONTRACT.md section 3) "
           "or sglang (SGLang's pickled EmbeddingData and the raw bytes, for an unchanged SGLang prefill server)",
           choices=("native", "sglang")),
    Option("--sglang-embedding-class", str, "sglang.srt.disaggregation.encoder.receiver.EmbeddingData",
           "with --wire-format sglang: the class path frame 0 names (SGLang 0.5.21+; 0.5.12 to 0.5.18: "
           "sglang.srt.disaggregation.encode_receiver.EmbeddingData)"),
    Option("--register-with", str, None,
           "comma-separated URLs of SGLang encoder registries: on start POST {url}/register_encoder_url with "
           "this encoder's URL, on drain DELETE {url}/unregister_encoder_url"),
    Option("--advertise-url", str, None,
           "the URL others reach this encoder at, for --register-with (default: http://HOST:PORT)"),
    Option("--max-priority", int, 9,
           "highest /encode 'priority' accepted (0 is the default and lowest; outside 0..this: 400)"),
    Option("--preprocess-workers", int, 0,
           "processes that decode and preprocess images (each item on its own, results in shared memory); "
           "0: in the server process; -1: every core but one, at least 2 (0 on one core); not with --tp-size > 1"),
    Option("--preprocess-device", str, "cpu",
           "where image preprocessing runs: cpu (PIL) or cuda (transformers' fast image processors on the "
           "model's GPU; needs a CUDA device and torchvision)", choices=("cpu", "cuda")),
    Option("--cache-bytes", parse_cache_bytes, "auto",
           "bound of the per-item embedding cache in bytes (e.g. 536870912 or 512MiB); auto: 5 percent of the memory, "
           "at most 1 GiB; 0 turns the cache and in-flight deduplication off"),
    Option("--keep-alive-timeout-s", float, 75.0,
           "how long an idle HTTP connection stays open; keep it above every client's pool idle timeout, "
           "or a pooled request can meet the server's close and fail"),
    Option("--malloc-arena-max", int, 2,
           "glibc malloc arenas at most (0: glibc's default, 8 per core); fewer arenas keep less freed memory"),
    Option("--housekeeping-interval-s", float, 5.0,
           "how often to check whether the server went idle; then Python's full garbage collection runs and freed "
           "heap memory goes back to the system (malloc_trim); under unbroken load every 300 s "
           "(0: never, and Python collects on its own schedule)"),
    Option("--ec-storage", str, None,
           "vLLM producer: the folder vLLM's ECExampleConnector reads (its shared_storage_path); turns on "
           "POST /v1/chat/completions, which writes each item's rows to PATH/<identifier>/encoder_cache.safetensors "
           "(docs/DEPLOYMENT.md, Using it with vLLM)"),
    Option("--ec-model-id", str, None,
           "vLLM producer: the consumer's --model string, which goes into every item's identifier "
           "(default: this server's --model)"),
    Option("--ec-hash-algorithm", str, "blake3",
           "vLLM producer: the consumer's --mm-hasher-algorithm", choices=("blake3", "sha256", "sha512")),
    Option("--ec-storage-bytes", parse_byte_size, 0,
           "vLLM producer: bound of the storage in bytes (e.g. 20GiB); the items least recently written or hit "
           "are deleted beyond it; 0: no bound"),
    Option("--ec-storage-min-age-s", float, 600.0,
           "vLLM producer: an item written or hit less than this long ago is never deleted, whatever the bound "
           "(a consumer may be about to load it)"),
    Option("--cache-store", str, None,
           "the embedding cache's shared second tier: mooncake://HOST:PORT, a Mooncake Store master (its "
           "--rpc_port); a local miss is read from the Store before encoding, and what is encoded is published "
           "there for the pool; needs the mooncake extra (docs/DEPLOYMENT.md, A pool-wide cache)"),
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
           "longest wait for a Store read; a later answer is a miss (the item is encoded)"),
    Option("--cache-store-publish-items", int, 1024,
           "items waiting to be published to the Store at most; beyond, an item is not published (counted)"),
    Option("--cache-store-publish-bytes", parse_byte_size, 256 << 20,
           "bytes waiting to be published to the Store at most; beyond, an item is not published (counted)"),
    Option("--cache-store-prefix", str, "",
           "vLLM's embedding_cache_prefix: the first part of every Store key (empty: none)"),
    Option("--cache-store-model", str, None,
           "vLLM's embedding_model_identity: the model part of the Store keys (default: --ec-model-id, else --model)"),
    Option("--cache-store-revision", str, "default",
           "the revision part of the Store keys (vLLM: the consumer's --revision, else default)"),
    Option("--cache-store-encoder-hash", str, "auto",
           "the encoder part of vLLM's Store keys, vLLM's MultiModalConfig.compute_hash(); auto: vLLM 0.33's "
           "value with its default encoder settings"),
    Option("--encoder-transfer-backend", str, "zmq_to_scheduler",
           "SGLang's --encoder-transfer-backend, as its language side runs: zmq_to_scheduler or zmq_to_tokenizer (rows "
           "pushed over ZMQ, as --wire-format says), or mooncake (rows staged here; each receiver rank pulls their "
           "sizes from /scheduler_receive_meta_data and has them written into its buffer with Mooncake's "
           "TransferEngine through /send, then gets SGLang's EmbeddingData frame)",
           choices=("zmq_to_scheduler", "zmq_to_tokenizer", "mooncake")),
    Option("--mooncake-protocol", str, "rdma",
           "with --encoder-transfer-backend mooncake: the TransferEngine's transport, rdma (SGLang's default) or tcp "
           "(no RDMA NIC needed)", aliases=("MOONCAKE_PROTOCOL",), choices=("rdma", "tcp", "efa")),
    Option("--disaggregation-ib-device", str, None,
           "with --encoder-transfer-backend mooncake: the RDMA device(s) the TransferEngine uses, as SGLang's flag "
           "(default: its own discovery)"),
    Option("--mooncake-host", str, None,
           "with --encoder-transfer-backend mooncake: the address this encoder's TransferEngine is known by "
           "(default: the host of --advertise-url, else --host when it is not a wildcard)"),
    Option("--mooncake-registered-bytes", parse_byte_size, 4 << 30,
           "with --encoder-transfer-backend mooncake: most bytes of rows registered with the TransferEngine at once "
           "(e.g. 4GiB); a /send beyond it gets 503 with Retry-After"),
    Option("--ec-transfer-config", str, None,
           "vLLM producer: vLLM's --ec-transfer-config JSON, as the consumers are started with: ec_connector "
           "ECMooncakeConnector (rows pushed with Mooncake's TransferEngine into the consumer's reserved buffer; "
           "ec_buffer_size bounds the registered memory, ec_connector_extra_config.mooncake_protocol rdma or tcp), "
           "ECCPUConnector with ec_connector_extra_config.ec_enable_nixl true (rows kept in CPU memory registered "
           "with NIXL, ec_cpu_bytes of it, which consumers read; its side channel at --ec-side-channel-host/-port) or "
           "ECExampleConnector (its shared_storage_path: the files of --ec-storage); ec_role ec_producer "
           "(docs/DEPLOYMENT.md, Using it with vLLM)"),
    Option("--ec-side-channel-host", str, "localhost",
           "with ECCPUConnector: the address its side channel (the ZMQ socket consumers ask for items on) listens on "
           "and is announced as, vLLM's VLLM_EC_SIDE_CHANNEL_HOST", aliases=("VLLM_EC_SIDE_CHANNEL_HOST",)),
    Option("--ec-side-channel-port", int, 5601,
           "with ECCPUConnector: the side channel's port, vLLM's VLLM_EC_SIDE_CHANNEL_PORT",
           aliases=("VLLM_EC_SIDE_CHANNEL_PORT",)),
    Option("--ec-vllm-version", str, "0.33.0",
           "with ECCPUConnector: the consumers' vLLM version, one of the four parts of the compatibility hash a "
           "consumer sends with each read (with the model, --ec-model-id else --model; the dtype, --dtype; and the "
           "block size, the language model's hidden size in bytes); a consumer whose hash differs is refused"),
)


#: Setting name -> default, from the one table.
DEFAULTS: dict[str, Any] = {option.dest: option.default for option in OPTIONS}


@dataclass(frozen=True)
class Settings:
    """The effective settings of one server process (defaults: the `OPTIONS` table)."""

    model: str = DEFAULTS["model"]
    host: str = DEFAULTS["host"]
    port: int = DEFAULTS["port"]
    grpc_port: int | None = DEFAULTS["grpc_port"]
    device: str = DEFAULTS["device"]
    dtype: str = DEFAULTS["dtype"]
    max_batch_size: int = DEFAULTS["max_batch_size"]
    max_wait_ms: float | str = DEFAULTS["max_wait_ms"]  # or AUTO_WAIT
    min_batch_size: int = DEFAULTS["min_batch_size"]
    hard_timeout_additional_s: float = DEFAULTS["hard_timeout_additional_s"]
    max_batch_tokens: int = DEFAULTS["max_batch_tokens"]
    enable_dynamic_batching: bool = DEFAULTS["enable_dynamic_batching"]
    max_pending: int = DEFAULTS["max_pending"]
    req_timeout_s: float = DEFAULTS["req_timeout_s"]
    send_timeout_s: float = DEFAULTS["send_timeout_s"]
    tp_size: int = DEFAULTS["tp_size"]
    dp_size: int = DEFAULTS["dp_size"]
    api_key: str | None = DEFAULTS["api_key"]
    api_key_exempt_cidrs: str | None = DEFAULTS["api_key_exempt_cidrs"]
    metrics_require_key: bool = DEFAULTS["metrics_require_key"]
    allow_private_urls: bool = DEFAULTS["allow_private_urls"]
    allowed_local_media_dir: str | None = DEFAULTS["allowed_local_media_dir"]
    max_request_bytes: int = DEFAULTS["max_request_bytes"]
    max_image_pixels: int = DEFAULTS["max_image_pixels"]
    max_audio_seconds: float = DEFAULTS["max_audio_seconds"]
    video_fps: float = DEFAULTS["video_fps"]
    max_video_frames: int = DEFAULTS["max_video_frames"]
    drain_timeout_s: float = DEFAULTS["drain_timeout_s"]
    health_probe_interval_s: float = DEFAULTS["health_probe_interval_s"]
    health_probe_timeout_s: float = DEFAULTS["health_probe_timeout_s"]
    cpu_threads: int = DEFAULTS["cpu_threads"]
    media_workers: int = DEFAULTS["media_workers"]
    log_level: str = DEFAULTS["log_level"]
    log_format: str = DEFAULTS["log_format"]
    wire_format: str = DEFAULTS["wire_format"]
    sglang_embedding_class: str = DEFAULTS["sglang_embedding_class"]
    register_with: str | None = DEFAULTS["register_with"]
    advertise_url: str | None = DEFAULTS["advertise_url"]
    max_priority: int = DEFAULTS["max_priority"]
    preprocess_workers: int = DEFAULTS["preprocess_workers"]
    preprocess_device: str = DEFAULTS["preprocess_device"]
    cache_bytes: int | str = DEFAULTS["cache_bytes"]  # "auto" or bytes; memory.default_cache_bytes resolves "auto"
    keep_alive_timeout_s: float = DEFAULTS["keep_alive_timeout_s"]
    malloc_arena_max: int = DEFAULTS["malloc_arena_max"]
    housekeeping_interval_s: float = DEFAULTS["housekeeping_interval_s"]
    ec_storage: str | None = DEFAULTS["ec_storage"]
    ec_model_id: str | None = DEFAULTS["ec_model_id"]
    ec_hash_algorithm: str = DEFAULTS["ec_hash_algorithm"]
    ec_storage_bytes: int = DEFAULTS["ec_storage_bytes"]
    ec_storage_min_age_s: float = DEFAULTS["ec_storage_min_age_s"]
    cache_store: str | None = DEFAULTS["cache_store"]
    cache_store_metadata_server: str = DEFAULTS["cache_store_metadata_server"]
    cache_store_protocol: str = DEFAULTS["cache_store_protocol"]
    cache_store_device_name: str = DEFAULTS["cache_store_device_name"]
    cache_store_local_hostname: str = DEFAULTS["cache_store_local_hostname"]
    cache_store_global_segment_size: int = DEFAULTS["cache_store_global_segment_size"]
    cache_store_local_buffer_size: int = DEFAULTS["cache_store_local_buffer_size"]
    cache_store_timeout_ms: float = DEFAULTS["cache_store_timeout_ms"]
    cache_store_publish_items: int = DEFAULTS["cache_store_publish_items"]
    cache_store_publish_bytes: int = DEFAULTS["cache_store_publish_bytes"]
    cache_store_prefix: str = DEFAULTS["cache_store_prefix"]
    cache_store_model: str | None = DEFAULTS["cache_store_model"]
    cache_store_revision: str = DEFAULTS["cache_store_revision"]
    cache_store_encoder_hash: str = DEFAULTS["cache_store_encoder_hash"]
    ec_transfer_config: str | None = DEFAULTS["ec_transfer_config"]
    encoder_transfer_backend: str = DEFAULTS["encoder_transfer_backend"]
    mooncake_protocol: str = DEFAULTS["mooncake_protocol"]
    disaggregation_ib_device: str | None = DEFAULTS["disaggregation_ib_device"]
    mooncake_host: str | None = DEFAULTS["mooncake_host"]
    mooncake_registered_bytes: int = DEFAULTS["mooncake_registered_bytes"]
    ec_side_channel_host: str = DEFAULTS["ec_side_channel_host"]
    ec_side_channel_port: int = DEFAULTS["ec_side_channel_port"]
    ec_vllm_version: str = DEFAULTS["ec_vllm_version"]

    def __post_init__(self) -> None:
        positive = ("max_batch_size", "min_batch_size", "max_pending", "max_request_bytes",
                    "max_image_pixels", "media_workers", "max_video_frames", "tp_size", "dp_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if isinstance(self.max_wait_ms, str) and self.max_wait_ms != AUTO_WAIT:
            raise ValueError(f"--max-wait-ms must be milliseconds or '{AUTO_WAIT}', got {self.max_wait_ms!r}")
        if not self.adaptive_wait and self.max_wait_ms < 0:
            raise ValueError(f"--max-wait-ms must not be negative, got {self.max_wait_ms}")
        for name in ("hard_timeout_additional_s", "max_batch_tokens", "drain_timeout_s", "cpu_threads",
                     "health_probe_interval_s", "max_priority", "malloc_arena_max", "housekeeping_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must not be negative, got {getattr(self, name)}")
        for name in ("max_audio_seconds", "video_fps", "send_timeout_s", "health_probe_timeout_s",
                     "keep_alive_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.preprocess_workers < -1:
            raise ValueError(f"--preprocess-workers must be -1 (auto), 0 or more, got {self.preprocess_workers}")
        if self.preprocess_device != "cpu" and (self.tp_size > 1 or self.dp_size > 1):
            raise ValueError("--preprocess-device cuda is for single-process servers: with --tp-size or --dp-size "
                             "above 1 every rank must preprocess alike")
        if self.tp_size > 1 and self.dp_size > 1:
            raise ValueError("--tp-size and --dp-size cannot both be above 1 in one server: run one server per "
                             "tensor-parallel group and balance across them")
        if self.req_timeout_s <= 0:
            raise ValueError(f"--req-timeout-s must be positive, got {self.req_timeout_s}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.grpc_port is not None:
            if not 0 <= self.grpc_port <= 65535:
                raise ValueError(f"--grpc-port must be in 0..65535, got {self.grpc_port}")
            if self.grpc_port == self.port and self.port != 0:
                raise ValueError(f"--grpc-port and --port are both {self.port}: give gRPC a port of its own")
            if not installed("grpc"):
                raise ValueError(missing_message("grpc", "--grpc-port (SGLang's gRPC encoder service)"))
        check_device(self.device)
        if self.wire_format not in ("native", "sglang"):
            raise ValueError(f"--wire-format must be native or sglang, got {self.wire_format!r}")
        try:
            check_class_path(self.sglang_embedding_class)
        except ValueError as exc:
            raise ValueError(f"--sglang-embedding-class: {exc}") from None
        exempt_networks(self.api_key_exempt_cidrs)
        if self.ec_hash_algorithm not in ("blake3", "sha256", "sha512"):
            raise ValueError(f"--ec-hash-algorithm must be blake3, sha256 or sha512, got {self.ec_hash_algorithm!r}")
        if self.ec_storage_bytes < 0 or self.ec_storage_min_age_s < 0:
            raise ValueError("--ec-storage-bytes and --ec-storage-min-age-s must not be negative")
        if self.ec_storage is not None and not self.ec_storage.strip():
            raise ValueError("--ec-storage must name a folder")
        if self.cache_store is not None:
            parse_store_url(self.cache_store)
            if self.cache_bytes == 0:
                raise ValueError("--cache-store is the second tier of the embedding cache: it needs the first "
                                 "(--cache-bytes above 0, or auto)")
            if not installed("mooncake"):
                raise ValueError(missing_message("mooncake", "--cache-store (Mooncake Store's client)"))
        if self.cache_store_timeout_ms <= 0 or self.cache_store_publish_items < 0 or self.cache_store_publish_bytes < 0:
            raise ValueError("--cache-store-timeout-ms must be positive; --cache-store-publish-items and "
                             "--cache-store-publish-bytes must not be negative")
        if self.cache_store_protocol not in ("tcp", "rdma"):
            raise ValueError(f"--cache-store-protocol must be tcp or rdma, got {self.cache_store_protocol!r}")
        if self.ec_transfer_config is not None:
            transfer = parse_ec_transfer_config(self.ec_transfer_config)
            if transfer.connector == "ECCPUConnector" and self.ec_side_channel_host in ("0.0.0.0", "::", "*", ""):
                raise ValueError(f"--ec-side-channel-host {self.ec_side_channel_host!r} is a wildcard, but "
                                 f"ECCPUConnector consumers are told this address to reach the encoder at: give that "
                                 f"address")
            if transfer.storage_path is not None:
                if self.ec_storage is not None and self.ec_storage != transfer.storage_path:
                    raise ValueError(f"--ec-storage {self.ec_storage!r} and the --ec-transfer-config's "
                                     f"shared_storage_path {transfer.storage_path!r} differ: give one")
                object.__setattr__(self, "ec_storage", transfer.storage_path)
            elif self.ec_storage is not None:
                raise ValueError(f"--ec-storage writes files for ECExampleConnector, --ec-transfer-config asks for "
                                 f"{transfer.connector}: one vLLM connector per server")
        if not 1 <= self.ec_side_channel_port <= 65535:
            raise ValueError(f"--ec-side-channel-port must be in 1..65535, got {self.ec_side_channel_port}")
        if self.encoder_transfer_backend not in ("zmq_to_scheduler", "zmq_to_tokenizer", "mooncake"):
            raise ValueError(f"--encoder-transfer-backend must be zmq_to_scheduler, zmq_to_tokenizer or mooncake, "
                             f"got {self.encoder_transfer_backend!r}")
        if self.encoder_transfer_backend == "mooncake":
            if not installed("mooncake"):
                raise ValueError(missing_message("mooncake", "--encoder-transfer-backend mooncake"))
            if self.mooncake_registered_bytes <= 0:
                raise ValueError("--mooncake-registered-bytes must be positive")
            self.transfer_host  # noqa: B018 - refuses a wildcard --host without --mooncake-host
        if self.register_with:
            registry_urls(self.register_with)
            advertised_url(self.host, self.port, self.advertise_url)

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
    def ec_transfer(self) -> ECTransferConfig | None:
        """`--ec-transfer-config`, read (None: not given)."""
        return None if self.ec_transfer_config is None else parse_ec_transfer_config(self.ec_transfer_config)

    @property
    def vllm_push(self) -> ECTransferConfig | None:
        """The transfer config when it asks for a connector that pushes rows (not ECExampleConnector's files)."""
        transfer = self.ec_transfer
        return transfer if transfer is not None and transfer.storage_path is None else None

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
            if option.choices and value not in option.choices:
                raise SystemExit(f"encode-server: {name} must be one of {', '.join(option.choices)}, got {raw!r}")
            return value
    return option.default


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The CLI parser, with defaults taken from the environment."""
    environ = os.environ if environ is None else environ
    parser = _OneLineErrorParser(
        prog="encode-server", usage="encode-server [options]  (encode-server --help lists them)",
        description="Multimodal encoder service: batches images, audio and video across requests into "
        "one encoder forward. Every flag also reads ENCODER_<FLAG>; the command line wins.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for option in OPTIONS:
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
            kwargs["choices"] = option.choices
        parser.add_argument(option.flag, **kwargs)
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
    """The README's table of settings, generated from `OPTIONS`."""
    rows = ["| flag | env var | default | meaning |", "| --- | --- | --- | --- |"]
    for option in OPTIONS:
        env = ", ".join(f"`{name}`" for name in (option.env_var, *option.aliases))
        default = str(option.default).lower() if isinstance(option.default, bool) else option.default
        default = "none" if default is None else default
        rows.append(f"| `{option.flag}` | {env} | `{default}` | {option.help} |")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m encode_server.ops.settings prints the README's table
    print(settings_table_markdown())
