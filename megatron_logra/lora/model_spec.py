"""LoRA's change to the network, handed to the model builder (``ModelBuildConfig``).

``LoraAdapters(cfg)`` swaps the targeted linears of megatron-core's local layer spec for
their LoRA versions (``lora.layers``), marks the adapters' tensor-parallel split after
megatron has marked the base weights, and initialises A layout-independently (the same
full A at any TP/PP for a seed) and B to zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state

from megatron_logra.lora.config import LoraConfig
from megatron_logra.lora.layers import initial_lora_a, lora_layer_spec, lora_modules
from megatron_logra.model.provider import global_shape, layer_offset, unwrap
from megatron_logra.model.sharding import canonical_name, shard_of_full, tp_split


@dataclass(frozen=True)
class LoraAdapters:
    cfg: LoraConfig

    def layer_spec(self, local_spec):
        c = self.cfg
        return lora_layer_spec(local_spec, c.rank, c.alpha, c.dropout, c.targets)

    def after_build(self, model) -> None:
        for _, module in lora_modules(model):
            module.mark_lora_tensor_parallel()

    @torch.no_grad()
    def init_params(self, model, arch, seed: int) -> None:
        inner = unwrap(model)
        offset = layer_offset(inner)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        for name, module in lora_modules(inner):
            a = module.lora_a
            full = initial_lora_a(canonical_name(f"{name}.lora_a", offset), global_shape(a), seed)
            split = tp_split(a)
            shard = full if split is None else shard_of_full(full, *split, tp_rank, tp_size)
            a.copy_(shard.to(a.dtype))
            module.lora_b.zero_()
