"""Preprocessing inside the model layer: fast patches, Qwen video settings and parity, timestamps."""
