"""The embedding cache: in-process, through a server, and its shared tier (format and Store)."""
