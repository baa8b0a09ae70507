"""The model zoo: a tiny checkpoint for every multimodal `model_type` transformers ships, and how encode-server
serves each (`python -m tools.zoo` is the command; `run.py` drives it)."""
