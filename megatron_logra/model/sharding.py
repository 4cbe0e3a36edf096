"""Pure tensor-parallel slicing rules and layout-independent parameter names.

A megatron-core parameter that is tensor-parallel carries ``partition_dim`` (0 =
column parallel, 1 = row parallel) and ``partition_stride`` (2 for fc1, whose
rows are [gate; up] and whose TP rank r holds [gate_r; up_r]). These helpers map
between the full (TP=1) tensor and a rank's shard, and give every parameter a
name that does not depend on the TP/PP layout (global layer index, local-spec
names even under the Transformer Engine spec).
"""

from __future__ import annotations

import re

import torch

# Transformer Engine fuses the norms into the following linear; the local spec
# names them on their own. Canonical names use the local-spec form.
_TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def shard_of_full(full: torch.Tensor, partition_dim: int, stride: int, rank: int,
                  size: int) -> torch.Tensor:
    """The TP shard of ``full`` that rank ``rank`` of ``size`` holds (a copy-free view if possible).

    full: the TP=1 tensor; returns a tensor whose ``partition_dim`` is 1/size as long.
    """
    if size == 1:
        return full
    if full.shape[partition_dim] % (size * stride):
        raise ValueError(f"dim {partition_dim} of shape {tuple(full.shape)} does not split into "
                         f"{size} ranks x stride {stride}")
    parts = full.chunk(stride, dim=partition_dim)
    return torch.cat([part.chunk(size, dim=partition_dim)[rank] for part in parts],
                     dim=partition_dim)


def shard_ranges(length: int, stride: int, rank: int, size: int) -> list[tuple[int, int]]:
    """The [start, stop) index ranges of the partitioned dim that rank ``rank`` of ``size`` holds,
    in shard order (``shard_of_full`` == cat of those slices)."""
    if length % (size * stride):
        raise ValueError(f"length {length} does not split into {size} ranks x stride {stride}")
    part, chunk = length // stride, length // (stride * size)
    return [(s * part + rank * chunk, s * part + (rank + 1) * chunk) for s in range(stride)]


def full_of_shards(shards: list[torch.Tensor], partition_dim: int, stride: int) -> torch.Tensor:
    """Inverse of ``shard_of_full``: shards[r] is rank r's shard."""
    if len(shards) == 1:
        return shards[0]
    per_rank = [shard.chunk(stride, dim=partition_dim) for shard in shards]
    return torch.cat([per_rank[r][s] for s in range(stride) for r in range(len(shards))],
                     dim=partition_dim)


def canonical_name(local_name: str, layer_offset: int) -> str:
    """Layout-independent name: global layer index, local-spec naming.

    ``decoder.layers.{j}.x`` on a pipeline stage whose first layer is global layer
    ``layer_offset`` becomes ``decoder.layers.{j + layer_offset}.x``.
    """
    name = local_name.removeprefix("module.")
    while name.startswith("module."):
        name = name.removeprefix("module.")
    match = _LAYER.match(name)
    if not match:
        return name
    index, rest = int(match.group(1)), match.group(2)
    rest = _TE_TO_LOCAL.get(rest, rest)
    return f"decoder.layers.{index + layer_offset}.{rest}"


def tp_split(param: torch.Tensor) -> tuple[int, int] | None:
    """(partition_dim, stride) when ``param`` is tensor-parallel, else None (replicated)."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return int(param.partition_dim), int(getattr(param, "partition_stride", 1))
