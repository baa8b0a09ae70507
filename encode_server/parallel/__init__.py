"""Tensor-parallel ranks and data-parallel replicas: worker processes started by rank 0."""
