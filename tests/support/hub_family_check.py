"""Run in a subprocess whose `HF_ENDPOINT` points at the Hub stand-in: for each (Hub id, local folder),
load the encoder both ways and print, as JSON, whether their rows for the adapter's sample item are
equal bit for bit, and where the Hub id's encoder-only folder is.

A subprocess, because `huggingface_hub` reads `HF_ENDPOINT`, `HF_HOME` and `HF_HUB_OFFLINE` once, at import
(the tests run it with `run_python_module`: forked from the zygote of that environment).
Usage: `python -m tests.support.hub_family_check '{"org/name": "/path/to/full/folder", ...}'`; with
`--resolve org/name` it only prints the folder `resolve_model` gives (nothing loaded).
"""

from __future__ import annotations

import json
import sys

import torch

from encode_server.models import load_adapter, resolve_model


def sample_rows(adapter) -> torch.Tensor:
    modality, item = adapter.processor.sample_item()
    return adapter.forward(adapter.processor.preprocess(modality, [item]))


def main() -> None:
    if sys.argv[1] == "--resolve":
        print(resolve_model(sys.argv[2]))
        return
    results = {}
    for hub_id, folder in json.loads(sys.argv[1]).items():
        from_hub = load_adapter(hub_id, "cpu", "float32")
        local = load_adapter(folder, "cpu", "float32")
        rows, want = sample_rows(from_hub), sample_rows(local)
        results[hub_id] = {"folder": resolve_model(hub_id), "name": from_hub.info.name,
                           "family": from_hub.info.family, "rows": list(rows.shape),
                           "equal": bool(rows.shape == want.shape and torch.equal(rows, want))}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
