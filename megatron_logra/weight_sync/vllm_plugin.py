"""The ``vllm.general_plugins`` entry point (pyproject.toml): vLLM calls ``register`` in
every one of its processes (API server, engine core, workers) before a model is built.

It registers the ``mlogra`` weight-transfer backend (``weight_sync.vllm_backend``, imported
lazily by vLLM's factory when a server is configured for it) and, where the environment
asks for it (``MLOGRA_LIVE_WEIGHTS=1``, on vLLM's CPU platform), keeps CPU linear weights
live (``cpu_live_weights``) so pushes can update them in place. In a server trainer
rank 0 started (``MLOGRA_DIE_WITH_PARENT=1``, ``rollout.server_process``) every vLLM
process dies with the process that started it (``PR_SET_PDEATHSIG``), so a trainer rank 0
killed outright takes the whole server with it: its API server dies with rank 0, the
engine core with the API server, the workers with the engine core. It imports nothing of
megatron-core and touches nothing else.
"""

from __future__ import annotations

from megatron_logra.weight_sync.contract import BACKEND

BACKEND_MODULE = "megatron_logra.weight_sync.vllm_backend"
BACKEND_CLASS = "MlograWeightTransferEngine"
DIE_WITH_PARENT_ENV = "MLOGRA_DIE_WITH_PARENT"


def register() -> None:
    import os

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if os.environ.get(DIE_WITH_PARENT_ENV) == "1":
        from megatron_logra.runtime.processes import die_with_parent

        die_with_parent()

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, BACKEND_MODULE, BACKEND_CLASS)
    except ValueError:  # registered already (vLLM loads plugins once per process)
        pass
    from megatron_logra.weight_sync import cpu_live_weights

    if cpu_live_weights.wanted():
        cpu_live_weights.keep_cpu_weights_live()
