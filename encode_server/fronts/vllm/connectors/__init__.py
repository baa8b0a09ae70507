"""vLLM's EC connectors, producer side, one module each behind one interface (`base.Connector`), built by a lazy
factory (`factory.create_connector`): `example` (`ECExampleConnector`: the shared files), `mooncake` over
`mooncake_control` (`ECMooncakeConnector`: rows pushed into the consumer's buffer), `cpu` (`ECCPUConnector` in its
P2P mode: rows kept in NIXL-registered memory the consumers read)."""
