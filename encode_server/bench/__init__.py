"""Benchmarks: load generators, the forward-only ceiling, a Ray Serve peer, and `encode-bench`."""
