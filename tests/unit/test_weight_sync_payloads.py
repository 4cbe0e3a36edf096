"""Weight-sync payloads: the sketch-delta receiver against the trainer's own update in HF
coordinates; the transport choice.

For a fused qkv (per-group interleave -> q/k/v), a gated fc1 (-> gate/up), a
row-parallel fc2 and the padded embedding: applying (rows of D, seed, coefficient)
to the HF tensors equals the update W -= c D A(seed) applied in the Megatron layout
and then mapped to HF, bit for bit for bf16 (stochastic rounding, as the trainer's SR
mode) and to fp32 rounding for fp32. Bad payloads are refused before anything
changes.
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.weight_sync.sketch_rows import (RowsUpdate, apply_updates, decode_rows,
                                                encode_rows)
from megatron_logra.logra.low_rank_apply import apply_bf16_update
from megatron_logra.logra.projection import projection_block
from megatron_logra.model.arch import load_arch
from megatron_logra.model.hf_mapping import hf_from_megatron, megatron_param_shape
from megatron_logra.model.tiny_assets import EMBEDDED_DEFAULT

RANK = 8
NAMES = ["decoder.layers.1.self_attention.linear_qkv.weight",
         "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.2.mlp.linear_fc2.weight",
         "embedding.word_embeddings.weight"]


def test_row_runs_round_trip():
    for rows in ([], [3], [0, 1, 2, 7, 8, 20], list(range(5, 40))):
        t = torch.tensor(rows, dtype=torch.int64)
        runs = encode_rows(t)
        assert torch.equal(decode_rows(runs), t)
    assert encode_rows(torch.arange(10, 50)).tolist() == [[10, 40]]


def _case(arch, name: str, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = megatron_param_shape(arch, name)
    weight = (torch.randn(shape, generator=g) * 0.05).to(dtype)
    rows = torch.sort(torch.randperm(shape[0], generator=g)[: shape[0] // 2]).values
    d = (torch.randn(rows.numel(), RANK, generator=g)).to(torch.bfloat16).float()
    return weight, rows, d


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_receiver_applies_the_trainer_update_in_hf_coordinates(dtype):
    arch = load_arch(EMBEDDED_DEFAULT)
    coefficient = 3e-3
    hf_before, hf_want, updates = {}, {}, []
    for i, name in enumerate(NAMES):
        weight, rows, d = _case(arch, name, dtype, i)
        seed = 1000 + i
        trainer = weight.clone()
        block = trainer[rows]
        if dtype == torch.bfloat16:  # the trainer's SR-mode update
            apply_bf16_update(block, d, coefficient, seed, rank=RANK, kind="rademacher",
                              global_rows=rows, col_offset=0)
        else:
            a = projection_block(seed, RANK, (0, weight.shape[1]))
            block -= coefficient * (d @ a)
        trainer[rows] = block
        hf_before.update((n, t.clone()) for n, t in hf_from_megatron(arch, name, weight))
        hf_want.update(hf_from_megatron(arch, name, trainer))
        updates.append(RowsUpdate(name, encode_rows(rows), d.to(torch.bfloat16), coefficient,
                                  seed, RANK, "rademacher"))
    touched = apply_updates(arch, hf_before, updates)
    assert touched == set(hf_want)
    for n, want in hf_want.items():
        if dtype == torch.bfloat16:
            assert torch.equal(hf_before[n], want), n
        else:
            torch.testing.assert_close(hf_before[n], want, rtol=1e-6, atol=1e-7)


def test_bad_payloads_are_refused_before_anything_changes():
    arch = load_arch(EMBEDDED_DEFAULT)
    name = NAMES[0]
    weight, rows, d = _case(arch, name, torch.float32, 0)
    held = dict((n, t.clone()) for n, t in hf_from_megatron(arch, name, weight))
    snapshot = {n: t.clone() for n, t in held.items()}
    good = RowsUpdate(name, encode_rows(rows), d, 1e-3, 1, RANK, "rademacher")
    bad = [
        (RowsUpdate("decoder.layers.99.mlp.linear_fc9.weight", good.runs, d, 1e-3, 1, RANK,
                    "rademacher"), "unknown weight"),
        (RowsUpdate(name, good.runs, d[:-1], 1e-3, 1, RANK, "rademacher"), "D "),
        (RowsUpdate(name, torch.tensor([[10_000, 2]]), d[:2], 1e-3, 1, RANK, "rademacher"),
         "rows outside"),
        (RowsUpdate(NAMES[1], good.runs, d, 1e-3, 1, RANK, "rademacher"), "holds no"),
    ]
    for update, message in bad:
        with pytest.raises(ValueError, match=message):
            apply_updates(arch, held, [good, update])  # the good one is not applied either
        for n in held:
            assert torch.equal(held[n], snapshot[n])


def test_transport_choice_falls_back_to_full_when_a_delta_cannot_apply():
    from megatron_logra.weight_sync.sync import choose_transport

    kw = dict(version=7, engine_version=6, shadow_version=6, anchor_interval=0)
    assert choose_transport("sketch-delta", **kw) == "sketch-delta"
    assert choose_transport("sparse-delta", **kw) == "sparse-delta"
    assert choose_transport("full", **kw) == "full"
    # the engine restarted (serves the start-up weights, version 0) or lags behind
    assert choose_transport("sketch-delta", **dict(kw, engine_version=0)) == "full"
    # sparse deltas need the senders' last sent tensors at version - 1
    assert choose_transport("sparse-delta", **dict(kw, shadow_version=5)) == "full"
    assert choose_transport("sparse-delta", **dict(kw, shadow_version=None)) == "full"
    assert choose_transport("sketch-delta", **dict(kw, shadow_version=None)) == "sketch-delta"
    # an anchor update (every 7th version here) is full, the next one a delta again
    assert choose_transport("sketch-delta", **dict(kw, anchor_interval=7)) == "full"
    assert choose_transport("sketch-delta", version=8, engine_version=7, shadow_version=None,
                            anchor_interval=7) == "sketch-delta"
    # an engine on dummy weights (the direct channel's start) serves nothing yet: -1 is
    # not the version before a first push of version 0
    assert choose_transport("sketch-delta", version=0, engine_version=-1, shadow_version=None,
                            anchor_interval=0) == "full"
