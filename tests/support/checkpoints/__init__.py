"""Tiny full checkpoints (language model, processor and tokenizer included), saved with `save_pretrained`: one
module per family (or per model line where one builder serves several families), the shared parts in
`tests.support.tiny_parts`.

Importable without the rest of the test support (numpy, PIL, tokenizers, torch and transformers only), so the
compatibility tools can build the same folders in their own venvs."""
