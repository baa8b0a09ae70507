"""The connector a transfer config names, built lazily (as vLLM's `ec_connector/factory.py`): a connector's
module, and the library it needs (Mooncake's TransferEngine, NIXL), is imported only when it is asked for."""

from __future__ import annotations

import importlib
from typing import Any

from encode_server.fronts.vllm.connectors.base import Connector
from encode_server.fronts.vllm.transfer_config import ECTransferConfig
from encode_server.fronts.vllm.versions import VllmVersion

#: vLLM's connector name -> (module, class) of its producer side here.
CONNECTORS: dict[str, tuple[str, str]] = {
    "ECExampleConnector": ("encode_server.fronts.vllm.connectors.example", "ECExampleConnector"),
    "ECMooncakeConnector": ("encode_server.fronts.vllm.connectors.mooncake", "ECMooncakeConnector"),
    "ECCPUConnector": ("encode_server.fronts.vllm.connectors.cpu", "ECCPUConnector"),
}


def connector_class(name: str) -> type[Connector]:
    """The producer class of vLLM's connector `name` (its module imported now)."""
    try:
        module, attribute = CONNECTORS[name]
    except KeyError:
        raise ValueError(f"no producer for vLLM connector {name!r}: this server speaks {', '.join(CONNECTORS)}") \
            from None
    return getattr(importlib.import_module(module), attribute)


def create_connector(config: ECTransferConfig, service: Any, settings: Any, version: VllmVersion) -> Connector:
    """The producer side of the connector `config` names, built for the served model (blocking: run it in a
    thread). `service` is the running `EncoderService`; `settings` the server's."""
    return connector_class(config.connector).from_config(config, service, settings, version)
