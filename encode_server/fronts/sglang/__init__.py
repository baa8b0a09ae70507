"""The SGLang front: what SGLang's encoder server has beyond `/encode` (which it shares with the native front,
in `--wire-format sglang` frames from `delivery`): its `mooncake` transfer backend (`mooncake.py`, rows staged
and written into each receiver rank's buffer on its `/send`; the routes in `front.py`) and its encoder
registry (`registry.py`, `--register-with`).
"""
