"""Operations: the settings (one table), Prometheus metrics, the health probe, housekeeping (memory,
pauses) and memory sizes. The bottom layer: imports nothing else of the server.
"""
