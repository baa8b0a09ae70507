"""The generic family: any other `transformers` multimodal model, served through its own forward.

`adapter.py` is the family; `probes.py` measures at start-up which tokens the model fills with an item's
features and whether items can share a forward; `joined_inputs.py` joins per-item processor outputs into one
batch; `language_model_trap.py` builds the model stopped where its language model would start;
`chat_request.py` hands items to processors that take media only inside a chat request.
"""
