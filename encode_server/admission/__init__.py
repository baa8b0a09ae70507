"""Admission: which `/encode` bodies get in (validation, 409, 413, 503 and eviction, deadlines, drain)
and the request schemas. May import: records, ops, delivery.sockets (endpoint checks).
"""
