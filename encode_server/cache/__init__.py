"""The per-item embedding cache with in-flight deduplication, and the request path through it.
May import: media, scheduling.demand, records, ops.
"""
