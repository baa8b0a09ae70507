"""Delivery: where an embedding goes (destinations, registrations) and in which frames (one module per
wire format), the ZMQ PUSH layer, and SGLang's encoder registry. May import: records, ops.
`wire` imports nothing of the server: the prefill-side `receiver` shares it.
"""
