"""RowAdam state as megatron dist_checkpointing sharded tensors (reshardable across layouts).

Each sketched weight's row state v [out] and, when kept, its fp32 master [out, in]
are saved in the canonical TP=1 layout under ``logra.<kind>.<canonical name>``:
column-parallel tensors are sharded along rows over TP (the gated fc1's
[gate_t; up_t] rows as two tensors, ``.gate`` and ``.up``, as megatron saves the
weight itself), row-parallel ones replicate v over TP and shard the master along
columns. With row-aligned DP sharding (``row_shards``) each DP rank's rows are a
further even split of its TP chunk along rows; unsharded, DP ranks hold replicas.
The step count is common state.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing import ShardedTensor


def _pieces(slot, shard, tensor: torch.Tensor):
    """[(key suffix, view of the owned state, rank_offsets, replica_id)] of one state tensor
    (``tensor``: v [owned rows] or master [owned rows, in_local]) of ``slot``."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    dp_replica = 0 if shard.sharded else parallel_state.get_data_parallel_rank()
    ns, si = shard.num_shards, shard.index
    out = []
    for k, (_, state_rows) in enumerate(shard.pieces()):
        view = tensor[state_rows]
        suffix = (".gate", ".up")[k] if slot.gated_halves else ""
        if slot.parallel == "column":  # rows: TP chunk tp_rank, then DP piece si within it
            offsets, tp_replica = [(0, tp_rank * ns + si, tp_size * ns)], 0
        else:  # rows whole over TP (DP piece si); a master's columns split over TP
            offsets = [(0, si, ns)] if shard.sharded else []
            tp_replica = tp_rank if tensor.dim() == 1 else 0  # v replicated over TP
            if tensor.dim() == 2:
                offsets.append((1, tp_rank, tp_size))
        out.append((suffix, view, tuple(offsets), (int(slot.duplicate), tp_replica, dp_replica)))
    return out


def _entries(opt):
    for i, slot in enumerate(opt.sketches.slots):
        yield f"row_v.{slot.name}", slot, opt.shards[i], opt.row_v[i]
        if opt.masters[i] is not None:
            yield f"master.{slot.name}", slot, opt.shards[i], opt.masters[i]


def logra_sharded_state(opt) -> dict:
    state = {"steps": opt.steps}
    for key, slot, shard, tensor in _entries(opt):
        for suffix, view, offsets, replica in _pieces(slot, shard, tensor):
            state[key + suffix] = ShardedTensor.from_rank_offsets(
                f"logra.{key}{suffix}", view, *offsets, replica_id=replica)
    return state


def load_logra_state(opt, state: dict) -> None:
    opt.steps = int(state["steps"])
    for key, slot, shard, tensor in _entries(opt):
        for suffix, view, _, _ in _pieces(slot, shard, tensor):
            loaded = state[key + suffix]
            view.copy_(loaded.data if isinstance(loaded, ShardedTensor) else loaded)
