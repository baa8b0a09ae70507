"""Decoding media as `transformers` does, and the decode pool's priority order."""
