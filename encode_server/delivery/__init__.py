"""Delivery: where an embedding goes (destinations, registrations) and in which frames (one module per
wire format, `--wire-format` choosing one for every request), and the ZMQ PUSH layer. May import: records, ops.
`wire` imports nothing of the server: the prefill-side `receiver` shares it.
"""
