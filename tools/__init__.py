"""Developer tools, not part of the server: harnesses that run vLLM's and SGLang's own code against this server
(`compat/`), generators of the reference data the tests compare with (`reference/`), and the model zoo (`zoo/`)."""
