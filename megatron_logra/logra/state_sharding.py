"""RowAdam state as megatron dist_checkpointing sharded tensors (reshardable across layouts).

Each sketched weight's row state v [out] and, when kept, its fp32 master [out, in]
are saved in the canonical TP=1 layout under ``logra.<kind>.<canonical name>``:
column-parallel tensors are sharded along rows over TP (the gated fc1's
[gate_t; up_t] rows as two tensors, ``.gate`` and ``.up``, as megatron saves the
weight itself), row-parallel ones replicate v over TP and shard the master along
columns. DP ranks hold replicas. The step count is common state.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing import ShardedTensor


def _pieces(slot, tensor: torch.Tensor, gated_fc1: bool):
    """[(key suffix, local view, rank_offsets)] of one state tensor of ``slot``."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if slot.parallel == "row":
        if tensor.dim() == 1:
            return [("", tensor, ())]
        return [("", tensor, ((1, tp_rank, tp_size),))]
    if gated_fc1:
        half = tensor.shape[0] // 2
        return [(".gate", tensor[:half], ((0, tp_rank, tp_size),)),
                (".up", tensor[half:], ((0, tp_rank, tp_size),))]
    return [("", tensor, ((0, tp_rank, tp_size),))]


def _replica_id(slot) -> tuple[int, int, int]:
    tp_replica = parallel_state.get_tensor_model_parallel_rank() if slot.parallel == "row" else 0
    return (int(slot.duplicate), tp_replica, parallel_state.get_data_parallel_rank())


def _entries(opt):
    for i, slot in enumerate(opt.sketches.slots):
        gated = slot.name.endswith("mlp.linear_fc1.weight") and opt.sketches.gated
        yield f"row_v.{slot.name}", slot, opt.row_v[i], gated
        if opt.masters[i] is not None:
            yield f"master.{slot.name}", slot, opt.masters[i], gated


def logra_sharded_state(opt) -> dict:
    state = {"steps": opt.steps}
    for key, slot, tensor, gated in _entries(opt):
        for suffix, view, offsets in _pieces(slot, tensor, gated):
            full = f"logra.{key}{suffix}"
            # v of a row-parallel weight is replicated over TP: the TP rank is a replica index
            is_v_row = slot.parallel == "row" and tensor.dim() == 1
            replica = _replica_id(slot) if is_v_row else (
                int(slot.duplicate), 0, parallel_state.get_data_parallel_rank())
            state[key + suffix] = ShardedTensor.from_rank_offsets(full, view, *offsets,
                                                                  replica_id=replica)
    return state


def load_logra_state(opt, state: dict) -> None:
    opt.steps = int(state["steps"])
    for key, slot, tensor, gated in _entries(opt):
        for suffix, view, _ in _pieces(slot, tensor, gated):
            loaded = state[key + suffix]
            view.copy_(loaded.data if isinstance(loaded, ShardedTensor) else loaded)
