"""The rollout engines: vLLM's own servers, where they run, their life cycle, generation.

``engines.RolloutEngines`` is the RL stage's handle on them (placement, the servers'
settings, ``--rollout-replicas``, starts, restarts, sleep and wake, generation);
``vllm_server.VllmServer`` is the HTTP client of one server, and implements what a
weight push needs of an engine (``weight_sync.contract.PushTarget``); ``server_process``
starts a server on trainer rank 0. This package imports ``weight_sync.contract`` (and the
vLLM-side names it starts servers with), never ``rl/``.
"""
