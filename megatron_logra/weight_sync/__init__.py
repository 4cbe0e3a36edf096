"""Weight sync into vLLM through vLLM's own RL weight-transfer interface (docs/weight-sync.md).

``vllm_plugin`` registers this package's transfer backends in every vLLM process
(the ``vllm.general_plugins`` entry point of pyproject.toml); ``vllm_backend`` is the
worker side of the ``mlogra`` backend, ``worker_shards`` what a worker does with what it
receives, ``cpu_live_weights`` the CPU patch that keeps vLLM's linear weights in place.
"""
