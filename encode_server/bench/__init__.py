"""`encode-bench`, shipped with the server: load generators, workloads, the server configurations it compares
(batching and the cache, on and off), the in-process ceiling and the launcher. The peer comparisons and one-off
measurements live in a checkout's `benchmarks/`."""
