"""Compatibility harnesses: vLLM's and SGLang's own code, in side virtualenvs that `vllm_compat.sh` and
`sglang_compat.sh` build, consuming what this server produces."""
