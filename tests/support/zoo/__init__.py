"""The model zoo's machinery: a tiny checkpoint for every multimodal `model_type` transformers ships (`build`,
`shrink`, `catalog`), encode-server's rows against the full model's for each (`compare`, one type per process)
and the report (`run`). `python -m tools.zoo` is its command; it lives here because the tests build and
compare models with the same code."""
