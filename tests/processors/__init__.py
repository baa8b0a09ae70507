"""The `processors` package: the faster patchify, Qwen video settings and video parity, clip timestamps."""
