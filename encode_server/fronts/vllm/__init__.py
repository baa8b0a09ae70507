"""The vLLM front: this server as the encoder instance of vLLM's EPD serving. `front.py` mounts the route and
starts what the settings ask for; `routes.py` is `POST /v1/chat/completions`, answered by `completions.py` (the
producer and the connector); `chat.py` reads a chat body's media parts as vLLM does; `images.py`, `video.py`
and `audio.py` decode them as vLLM's media loader does; `identifiers.py` names them as vLLM's hasher does;
`versions.py` says where vLLM 0.32 and 0.33 differ (`--ec-vllm-version`); `producer.py` runs those steps once per
item and encodes the misses through `EncoderService.encode_identified`; `connectors/` hands the rows over, one
module per EC connector behind one interface; `transfer_config.py` reads vLLM's `--ec-transfer-config`.
"""
