"""The policy's full weights, from the Megatron TP/PP/DP layout to rank 0, as bucketed
HF-named tensors in the engine's dtype: what the server's weights are checked against
(``weight_sync.checksums``), and tests' reference; LoRA adapters gathered to rank 0.

Streaming: parameters go one at a time in the canonical order (no rank ever holds
the whole model). For each parameter, the data-parallel replica 0 of the pipeline
stage that owns it gathers its TP shards (a tied output layer's last-stage copy is
skipped: the first stage owns the embedding), converts it to HF tensors and, when
that rank is not rank 0, sends them to rank 0 point to point. Rank 0 yields a bucket
whenever ``bucket_bytes`` have collected; other ranks yield nothing but must drive
the generator to its end too (it is a collective over the job).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_logra.model.arch import ModelArch
from megatron_logra.model.hf_mapping import (hf_from_megatron, megatron_param_names,
                                             megatron_param_shape)
from megatron_logra.model.provider import canonical_param_names, served_parameters, unwrap
from megatron_logra.model.sharding import full_of_shards, tp_split

Bucket = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class PushPlan:
    """Who sends each canonical parameter: {name: global rank of its sender}."""

    sender: dict[str, int]


def plan_push(model_chunks, arch: ModelArch) -> PushPlan:
    """The sender of each canonical parameter: TP rank 0, DP rank 0 of the first pipeline
    stage that holds it (a tied embedding: the first stage's copy). From the layout alone,
    no collective: megatron-core numbers the ranks TP fastest, then DP, then PP (its
    default order, "tp-cp-ep-dp-pp" without CP and EP), which this rank's own groups are
    checked against; the layers split evenly over the stages (``ModelArch.check_parallel``).
    ``model_chunks``: this rank's (unused: every rank's plan is the same)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    dp = parallel_state.get_data_parallel_world_size()
    _check_rank_order(tp, pp, dp)
    per_stage = arch.num_layers // pp
    return PushPlan({name: _stage_of(name, per_stage, pp) * tp * dp
                     for name in megatron_param_names(arch)})


def _stage_of(name: str, per_stage: int, pp: int) -> int:
    """The first pipeline stage holding canonical parameter ``name``."""
    if name.startswith("decoder.layers."):
        return int(name.split(".")[2]) // per_stage
    if name.startswith("embedding."):
        return 0
    return pp - 1  # the final norm, an untied output layer


def _check_rank_order(tp: int, pp: int, dp: int) -> None:
    """Refuse a rank numbering other than TP fastest, then DP, then PP (``plan_push``)."""
    t = parallel_state.get_tensor_model_parallel_rank()
    d = parallel_state.get_data_parallel_rank()
    pipeline = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    tensor = dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
    if (pipeline != [t + tp * (d + dp * s) for s in range(pp)]
            or tensor != [tensor[0] + i for i in range(tp)]):
        raise RuntimeError(f"weight push: megatron-core numbered the ranks in another order "
                           f"than TP, DP, PP (pipeline group {pipeline}, tensor group "
                           f"{tensor}); plan_push assumes its default order")


@torch.no_grad()
def _sender_hf_tensors(model_chunks, arch: ModelArch, plan: PushPlan,
                       names: list[str] | None = None, merged: bool = True):
    """Per canonical parameter (canonical order; ``names``: only these): (name, its full HF
    tensors on its sender rank, None on every other rank). The sender's TP peers take part
    in the gather."""
    rank = dist.get_rank()
    canonical = canonical_param_names(model_chunks[0], arch)
    # the values the forward uses (LoRA: W + (alpha / r) B A, merged on each rank), or with
    # ``merged=False`` the parameters themselves (an engine serving the adapter on its own)
    local = {canonical[n]: pv if merged else (pv[0], pv[0].detach)
             for n, pv in served_parameters(model_chunks[0]).items()}
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    stage_owner_dp0 = parallel_state.get_data_parallel_rank() == 0
    wanted = None if names is None else set(names)
    for name in megatron_param_names(arch):
        if wanted is not None and name not in wanted:
            continue
        sender = plan.sender[name]
        hf_tensors = None
        if name in local and stage_owner_dp0 and _tp_peer_of(sender):
            param, value = local[name]  # the served value, computed now (one at a time)
            full = _gather_tp(param, value(), tp_group, tp_size)
            if rank == sender:
                hf_tensors = hf_from_megatron(arch, name, full)
        yield name, hf_tensors


def gathered_buckets(model_chunks, arch: ModelArch, plan: PushPlan, *, dtype: torch.dtype,
                     bucket_bytes: int = 64 * 2**20, names: list[str] | None = None,
                     merged: bool = True) -> Iterator[Bucket]:
    """Yield buckets of (HF name, full CPU tensor in ``dtype``) on rank 0; see module doc.
    ``names``: only these canonical parameters (in canonical order), else all.
    ``merged``: LoRA's adapters merged into their weights (else the base weights alone)."""
    rank = dist.get_rank()
    bucket: Bucket = []
    size = 0
    for name, hf_tensors in _sender_hf_tensors(model_chunks, arch, plan, names, merged):
        if hf_tensors is not None:
            hf_tensors = [(n, t.to(dtype).cpu().contiguous()) for n, t in hf_tensors]
        sender = plan.sender[name]
        if sender != 0:
            hf_tensors = _relay(hf_tensors, arch, name, sender, dtype)
        if rank != 0:
            continue
        for hf_name, tensor in hf_tensors:
            bucket.append((hf_name, tensor))
            size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if rank == 0 and bucket:
        yield bucket


def gather_adapters(model_chunks, arch: ModelArch) -> dict[str, torch.Tensor] | None:
    """The parameters beyond the base model's (LoRA's adapters), full (TP=1) by canonical
    name, on rank 0 (None elsewhere). Collective: a TP gather on every rank, then each
    stage's TP/DP rank 0 sends its part to rank 0."""
    canonical = canonical_param_names(model_chunks[0], arch)
    base = set(megatron_param_names(arch))
    group = parallel_state.get_tensor_model_parallel_group()
    size = parallel_state.get_tensor_model_parallel_world_size()
    first = (parallel_state.get_tensor_model_parallel_rank() == 0
             and parallel_state.get_data_parallel_rank() == 0)
    mine = {}
    for local_name, param in unwrap(model_chunks[0]).named_parameters():
        if canonical[local_name] in base:
            continue
        full = _gather_tp(param, param.detach(), group, size)
        if first:
            mine[canonical[local_name]] = full.float().cpu()
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    return {k: v for part in everyone for k, v in part.items()} if everyone else None


def _tp_peer_of(sender: int) -> bool:
    """Whether this rank is in the TP group of global rank ``sender``."""
    return sender in dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())


def _gather_tp(param: torch.Tensor, value: torch.Tensor, group, size: int) -> torch.Tensor:
    """The full (TP=1) ``value`` of ``param`` (split like ``param``), gathered over TP."""
    split = tp_split(param)
    if split is None or size == 1:
        return value
    shards = [torch.empty_like(value) for _ in range(size)]
    dist.all_gather(shards, value.contiguous(), group=group)
    return full_of_shards(shards, split[0], split[1])


def _relay(hf_tensors, arch: ModelArch, name: str, sender: int, dtype: torch.dtype):
    """Sender -> rank 0, point to point (shapes are known on both sides from the arch)."""
    rank = dist.get_rank()
    if rank == sender:
        for _, tensor in hf_tensors:
            dist.send(tensor, dst=0)
        return hf_tensors
    if rank != 0:
        return None
    meta = torch.empty(megatron_param_shape(arch, name), device="meta")
    out = []
    for hf_name, shape_ref in hf_from_megatron(arch, name, meta):
        tensor = torch.empty(shape_ref.shape, dtype=dtype)
        dist.recv(tensor, src=sender)
        out.append((hf_name, tensor))
    return out

