"""Low-rank updates from any trainer (``weight_sync.low_rank_push``), without a server.

{HF name: (B, A)} -> sketch updates with A carried: applied to whole HF tensors they are
W - B A (fp32: to fp32 rounding, against a dense product; bf16: within the stochastic
rounding's one ulp); packed for a TP2 server's two workers, sent through the message
format and applied to each worker's fused, sharded pieces (qkv_proj, gate_up_proj, a
column slice of o_proj and down_proj, the padded vocabulary) they give the trainer's
tensors bit for bit. Bad factors are refused naming the weight. The real server:
tests/integration/test_low_rank_push_server.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron_logra.model.arch import load_arch
from megatron_logra.model.hf_mapping import hf_param_shapes
from megatron_logra.model.tiny_assets import EMBEDDED_DEFAULT
from megatron_logra.weight_sync.low_rank_push import apply_low_rank, low_rank_updates
from megatron_logra.weight_sync.messages import Outbox, add_updates, received_updates
from megatron_logra.weight_sync.sketch_rows import apply_updates_into, check_updates
from megatron_logra.weight_sync.vllm_layout import vllm_placements

RANK = 4
NAMES = ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
         "model.layers.1.self_attn.v_proj.weight", "model.layers.1.self_attn.o_proj.weight",
         "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
         "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight"]


def _model(arch, dtype):
    g = torch.Generator().manual_seed(0)
    weights = {n: (0.05 * torch.randn(s, generator=g)).to(dtype)
               for n, s in hf_param_shapes(arch).items()}
    factors = {n: (0.02 * torch.randn(weights[n].shape[0], RANK, generator=g),
                   torch.randn(RANK, weights[n].shape[1], generator=g)) for n in NAMES}
    return weights, factors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_update_is_w_minus_b_a(dtype):
    arch = load_arch(EMBEDDED_DEFAULT)
    weights, factors = _model(arch, dtype)
    before = {n: w.clone() for n, w in weights.items()}
    touched = apply_low_rank(arch, weights, low_rank_updates(arch, factors, seed=7))
    assert touched == set(NAMES)
    for name, w in weights.items():
        if name not in factors:
            assert torch.equal(w, before[name]), name
            continue
        b, a = factors[name]
        want = before[name].float() - b @ a
        if dtype == torch.float32:
            torch.testing.assert_close(w, want, rtol=1e-6, atol=1e-7)
        else:  # stochastic rounding: within one bf16 ulp (2^-7 of the value, at most)
            assert bool(((w.float() - want).abs() <= 2 ** -7 * want.abs() + 1e-30).all()), name
            assert not torch.equal(w, want.to(dtype))  # rounded otherwise than to nearest


def _worker_params(arch, weights: dict, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """A TP ``rank`` worker's fused, sharded parameters, filled from HF ``weights``."""
    params: dict[str, torch.Tensor] = {}
    for name, value in weights.items():
        for p in vllm_placements(arch, name, tp, rank):
            rows = p.local_row + p.row1 - p.row0
            shape = (rows,) if value.dim() == 1 else \
                (rows, value.shape[1] if p.col0 is None else p.col1 - p.col0)
            held = params.get(p.param)
            if held is None or held.shape[0] < rows:
                grown = torch.zeros(shape, dtype=value.dtype)
                if held is not None:
                    grown[:held.shape[0]] = held
                params[p.param] = held = grown
            piece = value[p.row0:p.row1] if p.col0 is None else value[p.row0:p.row1, p.col0:p.col1]
            held[p.local_row:rows] = piece
    return params


def test_a_tp2_servers_pieces_take_the_trainers_update_bit_for_bit():
    arch = load_arch(EMBEDDED_DEFAULT)
    weights, factors = _model(arch, torch.bfloat16)
    workers = [_worker_params(arch, weights, 2, r) for r in range(2)]
    updates = low_rank_updates(arch, factors, seed=11)
    apply_low_rank(arch, weights, updates)  # the trainer
    boxes = [Outbox(), Outbox()]
    add_updates(boxes, arch, updates)
    for rank, (box, params) in enumerate(zip(boxes, workers)):
        meta, tensors = box.pack(torch.float32, torch.device("cpu"))
        received = received_updates(meta, tensors)
        assert all(u.projection is not None for u in received)
        check_updates(arch, received, hf_param_shapes(arch))
        apply_updates_into(arch, received, lambda n, r=rank, ps=params: [
            (ps[p.param], p) for p in vllm_placements(arch, n, 2, r)])
        want = _worker_params(arch, weights, 2, rank)
        for param, value in params.items():
            assert torch.equal(value, want[param]), (rank, param)


def test_bad_factors_are_refused_naming_the_weight():
    arch = load_arch(EMBEDDED_DEFAULT)
    _, factors = _model(arch, torch.float32)
    b, a = factors[NAMES[0]]
    for bad, match in (({"model.layers.0.self_attn.x_proj.weight": (b, a)}, "x_proj.*not a 2-D"),
                       ({"model.norm.weight": (b, a)}, "norm.*not a 2-D"),
                       ({NAMES[0]: (b[:-1], a)}, "q_proj.*must be"),
                       ({NAMES[0]: (b, a[:, :-1])}, "q_proj.*must be"),
                       ({NAMES[0]: (b, a[:-1])}, "q_proj.*must be")):
        with pytest.raises(ValueError, match=match):
            low_rank_updates(arch, bad)
    good = low_rank_updates(arch, {NAMES[0]: (b, a)})[0]
    shapes = hf_param_shapes(arch)
    with pytest.raises(ValueError, match="A .* expected"):
        check_updates(arch, [replace(good, projection=a[:, :-1])], shapes)
    with pytest.raises(ValueError, match="kind 'explicit'"):
        check_updates(arch, [replace(good, projection=None)], shapes)
