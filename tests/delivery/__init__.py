"""Delivering embeddings: the native wire, the sender, registrations, receivers and addresses."""
