"""Generators and checkers of the reference data under tests/ (golden identifiers and wire frames, placeholder
counts, processor outputs), each run where the peer's own code is installed."""
