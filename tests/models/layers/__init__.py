"""The model layer's kernels: packed attention, patch embedding, aligned MLPs."""
