"""The peers' own producer protocols, spoken on top of the transports: vLLM's `ECMooncakeConnector`
producer role (`vllm_mooncake.py`, over the consumer's control socket in `mooncake_control.py`) and its
`ECCPUConnector` producer role in P2P mode (`vllm_cpu.py`, consumers reading over NIXL).

Imports the vLLM producer (`vllm_producer`: items identified, decoded and encoded as vLLM does),
`transport` (the bytes), `ops` and `records`; `http` imports it.
"""
