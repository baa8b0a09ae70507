"""The model zoo: a tiny checkpoint for every multimodal `model_type` transformers ships, and how encode-server
serves each (`scripts/model_zoo.py` is the command)."""
