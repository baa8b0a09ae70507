"""The generic family: any other `transformers` multimodal model, served through its own forward.

`adapter.py` is the family; `probes.py` measures at start-up which tokens the model fills with an item's
features and whether items can share a forward; `language_model_trap.py` builds the model stopped where its
language model would start. The processor half (the full processor on one item at a time, joined inputs, items
in a chat request) is in `processors/` (`families/generic.py`, `joined_inputs.py`, `chat_request.py`).
"""
