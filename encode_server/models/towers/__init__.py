"""Adapters and loaders shared by several families: the Qwen-style grid vision tower, the Omni thinkers'
vision and audio towers, and the vision half of a `transformers` vision-language model (`vision_parts.py`).
"""
