"""The SGLang front: what SGLang's encoder server has beyond `/encode` (which it shares with the native front,
in `--wire-format sglang` frames from `delivery`): its `mooncake` transfer backend (`mooncake.py`, rows staged
and written into each receiver rank's buffer on its `/send`; the routes in `front.py`) and its encoder
registry (`registry.py`, `--register-with`); its gRPC encoder service (`--grpc-port`: `grpc_front.py` runs the
server, `grpc_service.py` the RPCs and health, `item_modality.py` tells an item's modality, which SGLang's gRPC
request does not name). The gRPC modules are imported only with `--grpc-port` (the optional `grpc` extra).
"""
