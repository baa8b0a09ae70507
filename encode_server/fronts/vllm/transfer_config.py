"""vLLM's `--ec-transfer-config` JSON, as the encoder of this server reads it, and the one connector the settings ask
for (`connector_config`: the transfer config, or `--ec-storage`'s files).

The same object a vLLM encoder instance is started with (vLLM 0.32 and 0.33, `config/ec_transfer.py` and each
connector's config): `ec_connector` and `ec_role`, the top-level `ec_buffer_device`, `ec_buffer_size`,
`ec_ip`, `ec_port`, and the connector's own keys in `ec_connector_extra_config`. What this server can
honour is taken; anything else is refused in one line at start-up that says why and what to write
instead:

- `ECMooncakeConnector`, `ec_role` `ec_producer`: each item's rows pushed with Mooncake's TransferEngine
  into the buffer the consumer reserved (`connectors/mooncake.py`). `ec_buffer_size` bounds the memory
  registered with the engine at once; `mooncake_protocol` is `rdma` unless set (say `tcp` where there is
  no RDMA NIC); `control_timeout_s` bounds each control request to a consumer. Rows are registered from
  host memory, so `ec_buffer_device` must be `cpu` (the default here, where vLLM's is `cuda`).
- `ECCPUConnector` in its P2P mode (`ec_connector_extra_config.ec_enable_nixl` true), `ec_role`
  `ec_producer`: each item's rows kept in a pool of CPU memory registered with NIXL, in blocks of the
  consumer's block size, which the consumer reads (`connectors/cpu.py`). `ec_cpu_bytes` (required, as
  vLLM requires it) is the pool, the bound on registered memory; `engine_id` names the NIXL agent;
  `producer_pin_lease_s` bounds how long a consumer's read may pin an item (vLLM's 30 s) and
  `unread_hold_s` how long an item nobody has read yet is kept from eviction; `nixl_progress_thread` true
  runs NIXL's own progress thread (it spins: a core's worth, for lower read latency). The side channel's address
  is vLLM's `VLLM_EC_SIDE_CHANNEL_HOST`/`_PORT` (`--ec-side-channel-host`/`-port`). Without
  `ec_enable_nixl` the connector only offloads within one vLLM instance, which an encoder outside it
  cannot serve: refused.
- `ECExampleConnector`: the files of `--ec-storage`, in `ec_connector_extra_config.shared_storage_path`.

Whatever is refused is refused before the model loads (`runtime.check_fronts` builds every front first).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from encode_server.ops.libraries import installed, missing_message

MOONCAKE = "ECMooncakeConnector"
CPU = "ECCPUConnector"
EXAMPLE = "ECExampleConnector"
SUPPORTED = (MOONCAKE, CPU, EXAMPLE)
_PROTOCOLS = ("rdma", "tcp")
WILDCARDS = ("0.0.0.0", "::", "*", "")


@dataclass(frozen=True)
class ECTransferConfig:
    """The parts of vLLM's transfer config this server acts on."""

    connector: str
    role: str
    buffer_device: str = "cpu"
    buffer_size: int = 1_000_000_000
    ip: str = "127.0.0.1"
    port: int = 14579
    protocol: str = "rdma"
    control_timeout_s: float = 30.0
    storage_path: str | None = None  # ECExampleConnector's shared_storage_path
    cpu_bytes: int = 0  # ECCPUConnector's ec_cpu_bytes: the registered pool
    engine_id: str | None = None  # ECCPUConnector: the NIXL agent's name (vLLM: a fresh uuid)
    pin_lease_s: float = 30.0  # ECCPUConnector: how long one read may pin an item (vLLM's PRODUCER_PIN_LEASE_S)
    hold_s: float = 60.0  # ECCPUConnector: how long an item not read yet is kept from eviction
    progress_thread: bool = False  # ECCPUConnector: NIXL's own (spinning) progress thread

    def public_dict(self) -> dict[str, Any]:
        if self.connector == CPU:
            return {"ec_connector": self.connector, "ec_role": self.role, "engine_id": self.engine_id,
                    "ec_cpu_bytes": self.cpu_bytes, "ec_enable_nixl": True, "producer_pin_lease_s": self.pin_lease_s,
                    "unread_hold_s": self.hold_s, "nixl_progress_thread": self.progress_thread}
        return {"ec_connector": self.connector, "ec_role": self.role, "ec_buffer_device": self.buffer_device,
                "ec_buffer_size": self.buffer_size, "ec_ip": self.ip, "ec_port": self.port,
                "mooncake_protocol": self.protocol, "control_timeout_s": self.control_timeout_s,
                **({"shared_storage_path": self.storage_path} if self.storage_path else {})}


def _positive(name: str, value: Any, kind=int) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"--ec-transfer-config: {name} must be a positive number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"--ec-transfer-config: {name} must be a positive number, got {value!r}") from None
    if not math.isfinite(number) or number <= 0 or (kind is int and not number.is_integer()):
        raise ValueError(f"--ec-transfer-config: {name} must be a positive {'integer' if kind is int else 'number'}, "
                         f"got {value!r}")
    return kind(number)


def parse_ec_transfer_config(text: str | dict) -> ECTransferConfig:
    """Read and check the JSON; `ValueError` (one line) for what this server cannot honour."""
    if isinstance(text, dict):
        data = text
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--ec-transfer-config is not JSON ({exc.msg} at column {exc.colno}): pass vLLM's "
                             f"--ec-transfer-config object, e.g. '{{\"ec_connector\": \"{MOONCAKE}\", "
                             f"\"ec_role\": \"ec_producer\"}}'") from None
    if not isinstance(data, dict):
        raise ValueError("--ec-transfer-config must be a JSON object, as vLLM's is")
    connector = data.get("ec_connector")
    if connector not in SUPPORTED:
        raise ValueError(f"--ec-transfer-config: ec_connector must be {', '.join(SUPPORTED[:-1])} or {SUPPORTED[-1]}, "
                         f"got {connector!r}")
    if data.get("ec_connector_module_path"):
        raise ValueError("--ec-transfer-config: ec_connector_module_path names a connector class of vLLM's; this "
                         "server speaks the built-in connectors only: leave it out")
    role = data.get("ec_role")
    if role != "ec_producer":
        raise ValueError(f"--ec-transfer-config: ec_role must be 'ec_producer' (this server is the encoder), "
                         f"got {role!r}")
    extra = data.get("ec_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("--ec-transfer-config: ec_connector_extra_config must be a JSON object")
    if connector == EXAMPLE:
        path = extra.get("shared_storage_path")
        if not isinstance(path, str) or not path.strip():
            raise ValueError("--ec-transfer-config: ECExampleConnector needs ec_connector_extra_config."
                             "shared_storage_path, the folder its consumers read")
        return ECTransferConfig(connector, role, storage_path=path)
    if connector == CPU:
        return _cpu_connector(data, extra)
    device = str(data.get("ec_buffer_device") or "cpu").lower()
    if device != "cpu":
        raise ValueError(f"--ec-transfer-config: ec_buffer_device {device!r}: this server registers rows from host "
                         f"memory; set ec_buffer_device 'cpu' (the consumer's own buffer may be on cuda)")
    protocol = str(extra.get("mooncake_protocol", "rdma")).lower()
    if protocol not in _PROTOCOLS:
        raise ValueError(f"--ec-transfer-config: mooncake_protocol must be rdma or tcp, got {protocol!r}")
    if extra.get("cross_encoder_cache"):
        raise ValueError("--ec-transfer-config: cross_encoder_cache (vLLM's Mooncake Store reuse between encoders) "
                         "is not served by this server's producer: leave it out")
    port = data.get("ec_port", 14579)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"--ec-transfer-config: ec_port must be in 1..65535, got {port!r}")
    if not installed("mooncake"):
        raise ValueError(missing_message("mooncake", f"--ec-transfer-config {MOONCAKE}"))
    return ECTransferConfig(
        connector, role, buffer_device=device,
        buffer_size=_positive("ec_buffer_size", data.get("ec_buffer_size", 1e9)),
        ip=str(data.get("ec_ip") or "127.0.0.1"), port=port, protocol=protocol,
        control_timeout_s=_positive("control_timeout_s", extra.get("control_timeout_s", 30), float))


def _flag(value: Any) -> bool:
    """An extra-config switch as vLLM reads one (extra config is not coerced: "true" is true)."""
    return value if isinstance(value, bool) else str(value).strip().lower() in ("true", "1", "yes")


def _cpu_connector(data: dict, extra: dict) -> ECTransferConfig:
    """ECCPUConnector's producer role in P2P mode."""
    if not _flag(extra.get("ec_enable_nixl", False)):
        raise ValueError("--ec-transfer-config: ECCPUConnector without ec_connector_extra_config.ec_enable_nixl only "
                         "offloads within one vLLM instance, which an encoder outside it cannot serve; set "
                         "\"ec_enable_nixl\": true (its P2P mode, which consumers read over NIXL)")
    if extra.get("ec_cpu_bytes") in (None, "", 0):
        raise ValueError("--ec-transfer-config: ECCPUConnector needs ec_connector_extra_config.ec_cpu_bytes, the CPU "
                         "memory registered with NIXL for consumers to read (e.g. 4000000000)")
    engine_id = data.get("engine_id")
    if engine_id is not None and (not isinstance(engine_id, str) or not engine_id.strip()):
        raise ValueError(f"--ec-transfer-config: engine_id must be a non-empty string, got {engine_id!r}")
    if not installed("nixl"):
        raise ValueError(missing_message("nixl", f"--ec-transfer-config {CPU}"))
    return ECTransferConfig(
        CPU, "ec_producer", cpu_bytes=_positive("ec_cpu_bytes", extra.get("ec_cpu_bytes")), engine_id=engine_id,
        pin_lease_s=_positive("producer_pin_lease_s", extra.get("producer_pin_lease_s", 30), float),
        hold_s=_positive("unread_hold_s", extra.get("unread_hold_s", 60), float),
        progress_thread=_flag(extra.get("nixl_progress_thread", False)))


def connector_config(settings: Any) -> ECTransferConfig | None:
    """The connector the settings ask for: `--ec-transfer-config`'s, or `--ec-storage`'s files (an
    `ECExampleConnector`), or None (the vLLM front is off). `ValueError` (one line) for what cannot be honoured."""
    storage = settings.ec_storage
    if storage is not None and not storage.strip():
        raise ValueError("--ec-storage must name a folder")
    if settings.ec_transfer_config is None:
        return None if storage is None else ECTransferConfig(EXAMPLE, "ec_producer", storage_path=storage)
    transfer = parse_ec_transfer_config(settings.ec_transfer_config)
    if transfer.connector == CPU and settings.ec_side_channel_host in WILDCARDS:
        raise ValueError(f"--ec-side-channel-host {settings.ec_side_channel_host!r} is a wildcard, but ECCPUConnector "
                         f"consumers are told this address to reach the encoder at: give that address")
    if transfer.storage_path is not None:
        if storage is not None and storage != transfer.storage_path:
            raise ValueError(f"--ec-storage {storage!r} and the --ec-transfer-config's shared_storage_path "
                             f"{transfer.storage_path!r} differ: give one")
    elif storage is not None:
        raise ValueError(f"--ec-storage writes files for ECExampleConnector, --ec-transfer-config asks for "
                         f"{transfer.connector}: one vLLM connector per server")
    return transfer
