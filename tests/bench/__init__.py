"""`encode-bench` and the benchmarks (the soak is `slow`)."""
