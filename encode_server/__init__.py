"""encode-server: a multimodal encoder microservice that batches media across requests."""

__version__ = "0.1.0"
