"""The SGLang and vLLM fronts: their wire formats, transports, registries, identifiers and storage."""
