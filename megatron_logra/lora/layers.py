"""LoRA on megatron-core's Column/RowParallelLinear: Y = X W^T + (alpha / r) (X A^T) B^T.

A [r, in] and B [out, r] are the adapter (PEFT's ``lora_A`` / ``lora_B``); W stays frozen.
Tensor parallel, with megatron's own mappings and every grad complete on every rank:

- column-parallel base (W rows split): A replicated, B split by rows like W (stride 2 for
  a gated fc1, whose local rows are [gate_t; up_t]). h = X A^T is the same on every rank;
  ``copy_to_tensor_model_parallel_region(h)`` all-reduces dh in the backward, so A's grad
  and the input's grad from the adapter are whole.
- row-parallel base (W columns split): A split by columns like W, B replicated. The
  partial X_t A_t^T are summed by ``reduce_from_tensor_model_parallel_region`` before B,
  so B's grad is whole, and the adapter's output is added after megatron's own reduce.

The adapter's output is added to the layer's output, after megatron's forward (no
sequence parallel). megatron-core internals touched (0.16.x, refused otherwise by
``runtime.versions``): ``forward`` and ``sharded_state_dict`` are extended in
subclasses (megatron's code runs unchanged, the adapter is added to its result and
its tensors to its state dict), the TP attributes megatron reads are set on A and B with
megatron's own setter.
"""

from __future__ import annotations

import math
from functools import cache

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

from megatron_logra.lora.config import TARGETS
from megatron_logra.model.provider import param_generator, replace_linears
from megatron_logra.runtime import versions


class _LoraMixin:
    """Adds ``lora_a`` / ``lora_b`` to a megatron linear; set up by ``lora_layer_class``."""

    lora_rank: int
    lora_scale: float
    lora_dropout: float
    lora_parallel: str  # "column" | "row"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # column-parallel: W [out_t, in], A [r, in] whole, B [out_t, r] split;
        # row-parallel: W [out, in_t], A [r, in_t] split, B [out, r] whole
        out_local, in_local = self.weight.shape
        opts = dict(dtype=self.weight.dtype, device=self.weight.device)
        self.lora_a = torch.nn.Parameter(torch.zeros(self.lora_rank, in_local, **opts))
        self.lora_b = torch.nn.Parameter(torch.zeros(out_local, self.lora_rank, **opts))

    def mark_lora_tensor_parallel(self) -> None:
        """Set the TP attributes of A and B from the base weight's (call after megatron's are
        set on the weight): the split one follows W's split dim and stride."""
        stride = int(getattr(self.weight, "partition_stride", 1))
        if self.lora_parallel == "column":
            set_tensor_model_parallel_attributes(self.lora_b, True, 0, stride)
        else:
            set_tensor_model_parallel_attributes(self.lora_a, True, 1, stride)

    def lora_output(self, x: torch.Tensor) -> torch.Tensor:
        """(alpha / r) (X A^T) B^T for this layer's input x [s, b, in(_local)]."""
        if self.lora_dropout and self.training:
            x = self._dropout(x)
        h = torch.matmul(x, self.lora_a.t().to(x.dtype))
        if self.lora_parallel == "column":
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        else:
            h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return torch.matmul(h, self.lora_b.t().to(h.dtype)) * self.lora_scale

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """A column-parallel input is the same on every TP rank and must get the same mask
        (the default RNG, seeded alike on all TP ranks); a row-parallel input is this
        rank's slice of the features and gets its own mask (megatron's model-parallel RNG,
        seeded per TP rank), so TP=2 drops features as independently as TP=1 does."""
        if self.lora_parallel == "column":
            return F.dropout(x, self.lora_dropout)
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        with get_cuda_rng_tracker().fork():
            return F.dropout(x, self.lora_dropout)

    def served_weight(self) -> torch.Tensor:
        """This rank's shard of W + (alpha / r) B A, in W's dtype: a column-parallel rank
        holds rows of B (and all of A), a row-parallel one columns of A, so the shard needs
        no communication (``model.provider.served_parameters``)."""
        delta = self.lora_b.detach().float() @ self.lora_a.detach().float()
        return (self.weight.detach().float() + self.lora_scale * delta).to(self.weight.dtype)

    def forward(self, input_, *args, **kwargs):
        out, bias = super().forward(input_, *args, **kwargs)
        return out + self.lora_output(input_).to(out.dtype), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """megatron's, plus A and B sharded like the base weight (a gated fc1's B through
        megatron's SwiGLU factory, as its weight is)."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        split = {"lora_b": 0} if self.lora_parallel == "column" else {"lora_a": 1}
        adapters = {k: getattr(self, k) for k in ("lora_a", "lora_b")}
        sharded = make_sharded_tensors_for_checkpoint(
            adapters, prefix, split, sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"])
        if int(getattr(self.weight, "partition_stride", 1)) == 2:
            key = f"{prefix}lora_b"
            sharded[key] = apply_swiglu_sharded_factory(sharded[key], sharded_offsets)
        out.update(sharded)
        return out


@cache
def lora_layer_class(base: type, rank: int, alpha: float, dropout: float) -> type:
    """The LoRA subclass of ``base`` (Column/RowParallelLinear) for these settings."""
    versions.require("megatron-core", "megatron_logra.lora.layers")
    parallel = "column" if issubclass(base, ColumnParallelLinear) else "row"
    return type(f"Lora{base.__name__}", (_LoraMixin, base), {
        "lora_rank": rank, "lora_scale": alpha / rank, "lora_dropout": dropout,
        "lora_parallel": parallel})


def lora_layer_spec(spec, rank: int, alpha: float, dropout: float,
                    targets: tuple[str, ...] = TARGETS):
    """The local GPT layer spec with the chosen linears replaced by their LoRA versions
    (``targets``: ``LoraConfig.targets``, checked there)."""
    column = lora_layer_class(ColumnParallelLinear, rank, alpha, dropout)
    row = lora_layer_class(RowParallelLinear, rank, alpha, dropout)
    return replace_linears(spec, targets, column, row)


def lora_modules(model) -> list[tuple[str, _LoraMixin]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _LoraMixin)]


def initial_lora_a(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A's full (TP=1) initial value: PEFT's default, kaiming-uniform with a = sqrt(5)
    (uniform in +-1/sqrt(in)), drawn from a generator seeded by (seed, name); B starts at
    zero, so the adapted model equals the base at step 0."""
    gen = param_generator(seed, name)  # the base weights' rule, by A's canonical name
    bound = 1.0 / math.sqrt(shape[1])
    return (torch.rand(shape, generator=gen) * 2 - 1) * bound
