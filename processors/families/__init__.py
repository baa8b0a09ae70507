"""The processors of families with rules of their own (sizing, tiling, cropping, audio chunking): one module per
family. Families that share a rule use the shared processors one level up (`grid.py`, `omni_audio.py`, ...)."""
