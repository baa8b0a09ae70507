"""Fronts: one package per protocol the server speaks, each with its routes and what it runs beside the service.

`native/` is `POST /encode` and `/scheduler_receive_url` (docs/CONTRACT.md); `sglang/` SGLang's `mooncake`
transfer backend (`/scheduler_receive_meta_data`, `/send`), its encoder registry (`--register-with`) and its gRPC
encoder service (`--grpc-port`);
`vllm/` vLLM's encoder instance: the chat route, vLLM's decoding and identifiers, and one module per EC
connector. Each front is a `base.Front`: `http` mounts its routes, the runtime starts and closes it.
`bodies.py` reads request bodies for all of them.

May import: service and everything below it. No front imports another; nothing below imports a front.
"""
