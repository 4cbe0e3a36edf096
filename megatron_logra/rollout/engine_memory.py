"""How much of a GPU a rollout engine that shares it with the trainer may ask vLLM for.

vLLM's GPU worker refuses to start unless the GPU's free memory is at least
``gpu_memory_utilization`` x its total (``vllm/v1/worker/utils.py: request_memory``; 0.92
by default), and it checks that even when ``kv_cache_memory_bytes`` sizes the KV cache.
Under ``inherit`` and ``colocated`` placement the engine starts on GPUs where trainer
ranks already hold their model and optimizer, so the default can never pass there. The
utilization is therefore sized from what those GPUs have free (measured by the trainer
ranks on them after releasing their cached blocks), less a margin for the engine
process's own CUDA context, and a start that cannot fit is refused before vLLM is asked,
with the settings to change. The sizing is pure arithmetic; the measuring is one
collective at start-up (``shared_gpu_utilization_measured``).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
VLLM_DEFAULT_UTILIZATION = 0.92  # vllm.config.cache.CacheConfig.gpu_memory_utilization
# vLLM's CUDA context, workspace and sampler on an awake engine (the memory model's
# engine share, memory/projection.py, uses it too): taken after the trainer measured what
# is free
ENGINE_OVERHEAD_BYTES = 2 * GIB


@dataclass(frozen=True)
class GpuMemory:
    """One GPU as a trainer rank on it sees it (``torch.cuda.mem_get_info``)."""

    free: int  # bytes
    total: int  # bytes


def engine_bytes(num_parameters: int, engine_tp: int, dtype_bytes: int,
                 kv_cache_bytes: int) -> int:
    """What one engine GPU holds: its share of the weights, its KV cache, the overhead."""
    return (num_parameters * dtype_bytes) // engine_tp + kv_cache_bytes + ENGINE_OVERHEAD_BYTES


def shared_gpu_utilization(gpus: list[GpuMemory], needed: int) -> float:
    """vLLM's ``gpu_memory_utilization`` for an engine on ``gpus`` (each already holding a
    trainer rank's state): the free memory of the fullest one less the engine's overhead,
    as a fraction of its total, at most vLLM's default. ValueError when ``needed`` bytes
    (``engine_bytes``) do not fit, naming what to change."""
    if not gpus:
        raise ValueError("no GPU to size the rollout engine on")
    tightest = min(gpus, key=lambda g: g.free)
    if tightest.free < needed:
        raise ValueError(
            f"the rollout engine does not fit beside the trainer: its GPUs have "
            f"{tightest.free / GIB:.1f} of {tightest.total / GIB:.1f} GiB free after the "
            f"trainer's model and optimizer, and the engine needs about {needed / GIB:.1f} GiB "
            f"(weights, KV cache, {ENGINE_OVERHEAD_BYTES / GIB:.0f} GiB of CUDA context). "
            f"Give the engine GPUs of its own (--rollout-placement dedicated "
            f"--rollout-devices), or lower --rollout-kv-cache-gib, or raise "
            f"--rollout-tensor-parallel-size, or shrink the trainer's share (LoGRA, more "
            f"TP/PP, --optimizer-cpu-offload)")
    # vLLM's own start-up check asks free >= utilization x total, its snapshot taken after
    # its CUDA context exists: the overhead keeps the request below what it will see
    return min(VLLM_DEFAULT_UTILIZATION, (tightest.free - ENGINE_OVERHEAD_BYTES) / tightest.total)


def shared_gpu_utilization_measured(rl, arch, placement) -> float | None:
    """Collective. vLLM's ``gpu_memory_utilization`` for this run's engine when it starts on
    node 0's trainer GPUs (CUDA, ``inherit`` or ``colocated``, not a server at
    --rollout-engine-url): every rank frees its cached blocks and reports its GPU's free memory; rank 0 sizes the
    engine (TP rank i lands on visible GPU i, local rank i's) and a refusal is raised on
    every rank. None elsewhere (CPU, dedicated GPUs, a remote engine: vLLM's default).
    ``rl``: the run's ``RLConfig``; ``arch``: its ``ModelArch``; ``placement``: its
    ``EnginePlacement``."""
    import os

    import torch
    from megatron_logra.runtime.collectives import every_rank, from_rank0
    from megatron_logra.runtime.device import current_device, release_cached_memory

    if (current_device().type != "cuda" or placement.mode == "dedicated"
            or rl.rollout_engine_url):
        return None
    release_cached_memory()
    free, total = torch.cuda.mem_get_info()
    here = (os.environ.get("GROUP_RANK", "0"), int(os.environ.get("LOCAL_RANK", "0")),
            GpuMemory(int(free), int(total)))
    everyone = every_rank(here)
    tp = rl.rollout_tensor_parallel_size
    gpus = [gpu for node, local, gpu in everyone if node == "0" and local < tp]
    needed = engine_bytes(arch.num_parameters, tp, 2 if rl.rollout_dtype == "bfloat16" else 4,
                          int(rl.rollout_kv_cache_gib * GIB))
    return from_rank0(lambda: shared_gpu_utilization(gpus, needed))
