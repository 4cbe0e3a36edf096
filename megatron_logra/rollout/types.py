"""The rollout engine's data types: what a server is started with (``ServerSpec``), a
sampling request, a completion (the push vocabulary and the engine's errors:
``weight_sync.contract``).

The engine is vLLM's own server: the trainer talks to it over HTTP (generation, vLLM's
weight-transfer routes, versions, checksums), and its workers receive pushes from every
trainer rank through this project's ``mlogra`` weight-transfer backend
(``weight_sync.vllm_backend``). Nothing else crosses between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_logra.rollout.config import EngineConfig


@dataclass(frozen=True)
class ServerSpec:
    """One vLLM server: the run's engine settings as they are (``engine``, the
    ``--rollout-*`` slice) and what the trainer derives for this server. The server at
    ``url`` (one of ``engine.engine_urls``, started by the user): only the timeouts apply;
    else trainer rank 0 starts it (``rollout.server_process``)."""

    model_dir: str  # config and tokenizer of the policy (the weights come with the first push)
    max_model_len: int
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_num_seqs: int = 128
    lora_rank: int = 0  # > 0: vLLM serves the base plus a LoRA adapter of this rank
    env: tuple[tuple[str, str], ...] = ()  # set in the server's environment (placement)
    cpu_cores: tuple[int, ...] = ()  # CPU, dedicated: the only cores the server runs on
    sleep_mode: bool = False  # CUDA, colocated: release weights and KV cache between turns
    # CUDA, on the trainer's GPUs (inherit, colocated): vLLM's start-up memory fraction,
    # sized from what the trainer left free, measured before each start (set then by
    # ``rollout.engines``, ``engine_memory.SharedGpuSizer``); None: vLLM's default
    gpu_memory_utilization: float | None = None
    replica: int = 0  # which of the run's engines (its log, adapters, weight group)
    url: str = ""  # the server the user runs at this address (--rollout-engine-url); "": ours
    # "dummy": the server starts on random weights and the first push brings the
    # trainer's (no weights file anywhere); "auto": it loads ``model_dir``'s (tests)
    load_format: str = "dummy"
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 1800.0


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # log pi_rollout(token | prefix), after temperature
    truncated: bool  # stopped at max_new_tokens, not at EOS


@dataclass(frozen=True)
class SampleRequest:
    prompt_ids: list[int]
    seed: int  # one request per sample, each seeded: reproducible whatever the batch
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0  # nucleus sampling (evaluations; training samples the full softmax)
