"""Tensor-parallel plans: the building blocks every family's `shard` uses (`blocks.py`) and the plan shared by
CLIP-style vision towers (`clip_towers.py`).
"""
