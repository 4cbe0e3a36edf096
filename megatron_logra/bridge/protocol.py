"""What the trainer, the engine process and the vLLM workers say to each other.

Three hops carry a rollout request or a weight push (the direct channel,
``bridge.direct``, moves a push's tensors from every trainer rank straight to the
workers over a torch.distributed group; the pipe then carries only its commands):

    trainer rank 0 (``engine_client.RolloutEngine``)
        --pipe: (Command, payload) -> (Reply, value)-->
    engine process (``engine_server.serve``: vLLM's ``LLM`` + ``receiver.InPlaceReceiver``)
        --vLLM ``collective_rpc(WorkerRPC.X)``-->
    every vLLM worker (``vllm_worker.VllmWorkerExtension``, one per engine TP rank)

The names of both hops are the enums below; nothing else spells them. Tensors cross
the pipe through torch.multiprocessing's shared memory.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from enum import StrEnum


class EngineError(RuntimeError):
    """The engine died or refused a request; restart it and push the weights again."""


class PushInFlight(EngineError):
    """Generation or scoring was asked for while a push is loaded but not committed: the
    engine would mix two versions, so it refuses (and keeps running); commit the push, or
    restart the engine and push again."""


class PushRefused(ValueError):
    """A weight push was refused before anything was applied (bad names or shapes, a delta
    on the wrong base version); the engine still serves its previous version."""


@dataclass(frozen=True)
class Delivery:
    """How a delta push went, the same on every trainer rank: refused before anything
    was applied (the reason), or failed (the engine's error), else the bytes it took."""

    refused: str = ""
    failed: str = ""
    sent: int = 0


def require_base(base_version: int, serving: int) -> None:
    """Refuse a delta on ``base_version`` when the engine serves ``serving`` (checked by
    the client, and again by the engine process for the direct channel)."""
    if serving != base_version:
        raise PushRefused(f"a delta on version {base_version}, the engine serves "
                          f"{serving}: push full weights")


IN_FLIGHT = "a weight push is in flight (loaded, not committed): commit it first"


class Transport(StrEnum):
    """How a weight push travels (``--weight-sync``); the values are the flag's choices."""

    FULL = "full"  # every HF tensor, bucketed
    SPARSE_DELTA = "sparse-delta"  # the engine-dtype elements that changed (exact)
    SKETCH_DELTA = "sketch-delta"  # LoGRA: D and the projection seed per sketched weight
    LORA_ADAPTER = "lora-adapter"  # LoRA: the adapter only, served by vLLM's LoRA support


class Channel(StrEnum):
    """What carries a push's tensors (``--weight-sync-channel``)."""

    PIPE = "pipe"  # to trainer rank 0, over its pipe to the engine process, to every worker
    DIRECT = "direct"  # each trainer rank to each worker, its pieces only (``bridge.direct``)


class Command(StrEnum):
    """Trainer -> engine process, over the pipe."""

    GENERATE = "generate"
    PROMPT_LOGPROBS = "prompt_logprobs"
    VERSION = "version"
    LOAD = "load"  # one bucket of a full push
    COMMIT = "commit"
    SKETCH_DELTA = "sketch_delta"
    SPARSE_DELTA = "sparse_delta"
    FINGERPRINTS = "fingerprints"
    WEIGHTS = "weights"  # read the live weights back (tests)
    LORA_ADAPTER = "lora_adapter"  # a LoRA adapter in PEFT's format, served from now on
    SLEEP = "sleep"  # sleep mode (colocated): release weights (to host) and KV cache
    WAKE = "wake"  # take back the given parts: ["weights"], ["kv_cache"]
    SHUTDOWN = "shutdown"


class Reply(StrEnum):
    """Engine process -> trainer: the status of an answer."""

    OK = "ok"
    REFUSED = "refused"  # PushRefused: nothing applied, previous version still serving
    IN_FLIGHT = "in_flight"  # PushInFlight: nothing run
    ERROR = "error"  # the engine is dead (vLLM cannot recover from an RPC failure)
    PROGRESS = "progress"  # (done, total, vLLM's speed note) while generating; not an answer


class WorkerRPC(StrEnum):
    """Engine process -> every vLLM worker (``collective_rpc``): the methods of
    ``vllm_worker.VllmWorkerExtension`` (vLLM refuses extension methods that shadow the
    Worker's own, hence the prefix). ``vllm_worker`` checks each one exists."""

    LOAD = "mlogra_load"
    COMMIT = "mlogra_commit"
    VERSION = "mlogra_version"
    CHECK_LAYOUT = "mlogra_check_layout"
    SKETCH_DELTA = "mlogra_sketch_delta"
    SPARSE_DELTA = "mlogra_sparse_delta"
    SET = "mlogra_set"
    FINGERPRINTS = "mlogra_fingerprints"
    PIECES = "mlogra_pieces"


def call_workers(llm, rpc: WorkerRPC, *args) -> list:
    """Run ``rpc`` on every worker of ``llm`` (vLLM's ``LLM``): one result per worker."""
    return llm.collective_rpc(rpc.value, args=args)


WORKER_EXTENSION = "megatron_logra.bridge.vllm_worker.VllmWorkerExtension"
"""Set to "1" before vLLM builds its workers: importing ``vllm_worker`` then keeps the
CPU linear weights plain and live, so deltas can be applied to them in place."""


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str  # an HF folder (the policy's export): the engine starts from it
    max_model_len: int
    dtype: str = "float32"  # float32 (CPU parity) | bfloat16 (GPU)
    kv_cache_gib: float = 1.0
    tensor_parallel_size: int = 1
    seed: int = 0
    max_num_seqs: int = 128
    # accept delta pushes, applied in place to the live weights (on CPU: linear layers keep
    # plain weights and use F.linear instead of vLLM's packed oneDNN kernels)
    delta_sync: bool = False
    lora_rank: int = 0  # > 0: vLLM serves the base plus a LoRA adapter of this rank
    env: tuple[tuple[str, str], ...] = ()  # set in the engine process first (placement)
    cpu_cores: tuple[int, ...] = ()  # CPU, dedicated: the only cores the engine runs on
    sleep_mode: bool = False  # CUDA, colocated: release weights and KV cache between turns
    # CUDA, on the trainer's GPUs (inherit, colocated): vLLM's start-up memory fraction,
    # sized from what the trainer left free (``engine_memory``); None: vLLM's default
    gpu_memory_utilization: float | None = None
    # "dummy": start from random weights, the first push brings the real ones (the direct
    # channel: no weights file on the engine's node, no rank holding the whole model)
    load_format: str = "auto"
    url: str = ""  # a running vLLM server (``rollout.vllm_server``): the engine, not started here
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
