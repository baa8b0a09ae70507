"""The model zoo: a tiny checkpoint for every multimodal `model_type` transformers ships, and how encode-server
serves each (`tools/zoo/run.py` is the command)."""
