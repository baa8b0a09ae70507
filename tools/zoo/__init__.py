"""The model zoo's command, `python -m tools.zoo`: how encode-server serves a tiny checkpoint of every
multimodal `model_type` transformers ships. Its machinery is in `tests/support/zoo/`, which the tests share."""
