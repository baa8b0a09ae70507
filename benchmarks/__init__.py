"""Benchmarks beyond `encode-bench`: each script reproduces a figure of docs/BENCHMARKS.md (or OPERATIONS.md)
and says at its top the command and what it measures."""
