"""Assemble full (TP=1, all stages) parameters from a sharded model, by canonical name.

Small-model utility of the tests (parity across layouts): every rank of the
model-parallel group ends with the full state dict on CPU. Streaming export of large
models lives in the conversion tools; weight sync streams to rank 0
(``weight_sync.gathered_weights``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_logra.model.arch import ModelArch
from megatron_logra.model.provider import canonical_param_names, unwrap
from megatron_logra.model.sharding import full_of_shards, tp_split
from megatron_logra.runtime.collectives import every_rank


@torch.no_grad()
def gather_full_state_dict(model: torch.nn.Module, arch: ModelArch) -> dict[str, torch.Tensor]:
    """{canonical name: full fp32 CPU tensor} for the whole model (identical on every rank)."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    names = canonical_param_names(model, arch)
    stage: dict[str, torch.Tensor] = {}
    for local_name, param in unwrap(model).named_parameters():
        value = param.detach()
        split = tp_split(param)
        if split is not None and tp_size > 1:
            shards = [torch.empty_like(value) for _ in range(tp_size)]
            dist.all_gather(shards, value.contiguous(), group=tp_group)
            value = full_of_shards(shards, split[0], split[1])
        stage.setdefault(names[local_name], value.float().cpu().clone())
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if pp_size == 1:
        return stage
    stages = every_rank(stage, group=parallel_state.get_pipeline_model_parallel_group())
    full: dict[str, torch.Tensor] = {}
    for part in stages:
        for name, value in part.items():
            full.setdefault(name, value)
    return full
