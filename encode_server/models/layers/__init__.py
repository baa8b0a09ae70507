"""Faster forms of tower layers that compute the same rows: patch embedding as one matrix multiply, packed
attention over every window of a batch, and MLP widths padded to an aligned size.
"""
