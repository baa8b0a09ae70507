"""The processes the server starts: tensor-parallel ranks, data-parallel replicas, preprocessing workers."""
