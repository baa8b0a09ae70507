"""Encoder-only loading: a checkpoint folder's config and encoder tensors, Hub ids downloaded as encoder-only
folders, and safetensors files read by byte range.
"""
