"""Delivery: how an embedding leaves the server (`handover.Handover`, chosen once when the runtime is built:
pushed over ZMQ by `destinations.Delivery`, or staged by a front for receivers that pull), where it goes
(destinations, registrations) and in which frames (one module per wire format, `--wire-format` choosing one for
every request), and the ZMQ PUSH layer. May import: records, models, ops. `wire` imports nothing of the server:
the prefill-side `receiver` shares it.
"""
