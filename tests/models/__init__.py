"""The model layer: each family against `transformers` itself (one module per family), the registry, the generic
path, tensor-parallel plans and the prefill side's counts."""
