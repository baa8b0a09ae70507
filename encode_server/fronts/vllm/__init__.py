"""The vLLM front: this server as the encoder instance of vLLM's EPD serving. `routes.py` is
`POST /v1/chat/completions`; `chat.py` reads a chat body's media parts as vLLM does; `images.py`, `video.py`
and `audio.py` decode them as vLLM's media loader does; `identifiers.py` names them as vLLM's hasher does;
`producer.py` runs those steps and encodes the misses through `EncoderService.encode_rows`; one module per EC
connector hands the rows over (`example_connector.py`: files for `ECExampleConnector`; `mooncake_connector.py`
over `mooncake_control.py`: `ECMooncakeConnector`); `front.py` starts what the settings ask for.
"""
