"""Operations: the settings (one table), Prometheus metrics, the health probe, housekeeping (memory,
pauses), memory sizes and the log format. The bottom layer: imports nothing else of the server.
"""
