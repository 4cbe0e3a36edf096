"""Weight sync into vLLM through vLLM's own RL weight-transfer interface (docs/weight-sync.md).

``contract`` is the seam, typed: the transports and what each needs of the run, the
engine's errors, the backend's name and ``PushTarget``, what a push needs from an engine;
the rollout side imports it and nothing else of this package's pushes. ``sync.WeightSync``
pushes (one file per transport: ``full_push``, ``sparse_delta_push``,
``sketch_delta_push``, ``lora_adapter_push``); it never restarts an engine.
``vllm_plugin`` registers this package's transfer backends in every vLLM process
(the ``vllm.general_plugins`` entry point of pyproject.toml); ``vllm_backend`` is the
worker side of the ``mlogra`` backend, ``worker_shards`` what a worker does with what it
receives, ``cpu_live_weights`` the CPU patch that keeps vLLM's linear weights in place.
"""
