"""The native front: `POST /encode` (the body of docs/CONTRACT.md, answered by an ASGI handler in front of the
framework) and `/scheduler_receive_url` (a prefill rank registers for a request's rows). Every request goes to
`EncoderService`; SGLang's language side speaks this same protocol, in either `--wire-format`.
"""
