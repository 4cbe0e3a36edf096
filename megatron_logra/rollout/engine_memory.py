"""How much of a GPU a rollout engine that shares it with the trainer may ask vLLM for.

vLLM's GPU worker refuses to start unless the GPU's free memory is at least
``gpu_memory_utilization`` x its total (``vllm/v1/worker/utils.py: request_memory``; 0.92
by default), and it checks that even when ``kv_cache_memory_bytes`` sizes the KV cache.
Under ``inherit`` and ``colocated`` placement the engine starts on GPUs where trainer
ranks already hold their model and optimizer, so the default can never pass there. The
utilization is therefore sized from what those GPUs have free (measured by the trainer
ranks on them after releasing their cached blocks), less a margin for the engine
process's own CUDA context, and a start that cannot fit is refused before vLLM is asked,
with the settings to change. It is measured again before every start of a server
(``SharedGpuSizer``, called by ``rollout.engines`` where every rank takes part): a restart
after the first update meets Adam's state and the allocator's cache, which the first
start did not, and each of several colocated engines is sized from its own GPUs
(``engine_gpus``). The sizing is pure arithmetic (``size_engines``); the measuring is one
collective per start.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
VLLM_DEFAULT_UTILIZATION = 0.92  # vllm.config.cache.CacheConfig.gpu_memory_utilization
# vLLM's CUDA context, workspace and sampler on an awake engine (the memory model's
# engine share, memory/forecast.py, uses it too): taken after the trainer measured what
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


def engine_gpus(placement, engine_tp: int) -> tuple[int, ...]:
    """Node 0's visible indices of the GPUs an engine placed by ``placement``
    (``rollout.placement.EnginePlacement``) starts on: a colocated replica's own run
    (``split_replicas``), else the first ``engine_tp`` (TP rank i on visible GPU i)."""
    return tuple(placement.devices) or tuple(range(engine_tp))


def size_engines(reports: list, placements: list, replicas: list[int], engine_tp: int,
                 needed: int) -> dict[int, float]:
    """vLLM's ``gpu_memory_utilization`` for each of ``replicas``, from its own GPUs'
    reports: ``reports`` is every rank's (node rank, local rank, ``GpuMemory``), and local
    rank i of node 0 is on visible GPU i (GPUs no trainer rank uses hold no trainer state
    and are left out). ValueError naming the engine when one does not fit."""
    sizes = {}
    for replica in replicas:
        gpus = engine_gpus(placements[replica], engine_tp)
        seen = [gpu for node, local, gpu in reports if node == "0" and local in gpus]
        try:
            sizes[replica] = shared_gpu_utilization(seen, needed)
        except ValueError as exc:
            which = f"rollout engine {replica}" if len(placements) > 1 else "the rollout engine"
            raise ValueError(f"starting {which} on node 0's GPUs {list(gpus)}: {exc}") from None
    return sizes


class SharedGpuSizer:
    """``sizer(replicas)``: collective, vLLM's ``gpu_memory_utilization`` for each of
    ``replicas`` about to start (``rollout.engines``): every rank frees its cached blocks and
    reports its GPU's free memory now; rank 0 sizes each engine from its own GPUs
    (``size_engines``), and a refusal is raised on every rank."""

    def __init__(self, needed: int, engine_tp: int, placements: list):
        """``needed``: one engine's bytes per GPU (``engine_bytes``); ``placements``: rank
        0's placement of each engine (``split_replicas``; empty on the other ranks)."""
        self.needed, self.engine_tp, self.placements = needed, engine_tp, placements

    def __call__(self, replicas: list[int]) -> dict[int, float]:
        import os

        import torch
        from megatron_logra.runtime.collectives import every_rank, from_rank0
        from megatron_logra.runtime.device import release_cached_memory

        release_cached_memory()
        free, total = torch.cuda.mem_get_info()
        reports = every_rank((os.environ.get("GROUP_RANK", "0"),
                              int(os.environ.get("LOCAL_RANK", "0")),
                              GpuMemory(int(free), int(total))))
        return from_rank0(lambda: size_engines(reports, self.placements, replicas,
                                               self.engine_tp, self.needed))


def shared_gpu_sizer(engine, arch, placement, placements: list) -> SharedGpuSizer | None:
    """The sizer of this run's engines when they start on node 0's trainer GPUs (CUDA,
    ``inherit`` or ``colocated``, not a server at --rollout-engine-url:
    ``placement.shares_trainer_gpus``); None elsewhere (CPU, dedicated GPUs, a remote
    engine: vLLM's default). ``engine``: the run's ``rollout.config.EngineConfig``;
    ``arch``: its ``ModelArch``;
    ``placement``: the engines' ``EnginePlacement`` (every rank), ``placements``: each
    engine's (rank 0)."""
    if not placement.shares_trainer_gpus:
        return None
    tp = engine.tensor_parallel_size
    needed = engine_bytes(arch.num_parameters, tp, 2 if engine.dtype == "bfloat16" else 4,
                          int(engine.kv_cache_gib * GIB))
    return SharedGpuSizer(needed, tp, placements)
