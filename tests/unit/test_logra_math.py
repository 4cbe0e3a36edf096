"""LoGRA's pure math: projections, sketch statistics, RowAdam vs a plain reference, rounding."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_logra.logra import row_adam
from megatron_logra.logra.projection import hash32, parameter_seed, projection_block
from megatron_logra.logra.rounding import (
    _rounding_noise_int64,
    rounding_noise,
    stochastic_round_bf16,
    stochastic_round_bits_,
)


# --- projections -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_any_column_slice_equals_the_slice_of_the_whole(kind):
    whole = projection_block(123, 16, (0, 96), kind=kind)
    for c0, c1 in [(0, 48), (48, 96), (17, 61), (95, 96)]:
        assert torch.equal(projection_block(123, 16, (c0, c1), kind=kind), whole[:, c0:c1])
    assert not torch.equal(projection_block(124, 16, (0, 96), kind=kind), whole)


def test_rademacher_entries_and_balance():
    a = projection_block(7, 64, (0, 4096))
    assert set(a.unique().tolist()) == {-1 / 8, 1 / 8}
    assert abs(float((a > 0).float().mean()) - 0.5) < 0.01
    # rows are independent: the off-diagonal of A A^T is small against its diagonal (in/r)
    gram = a @ a.t()
    assert torch.allclose(gram.diagonal(), torch.full((64,), 4096 / 64))
    assert float((gram - torch.diag(gram.diagonal())).abs().max()) < 0.1 * 4096 / 64


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_projection_is_isotropic_in_expectation(kind):
    """E[A^T A] = I: averaged over seeds, A^T A approaches the identity."""
    n, r, seeds = 24, 8, 400
    acc = torch.zeros(n, n, dtype=torch.float64)
    for s in range(seeds):
        a = projection_block(s, r, (0, n), kind=kind).double()
        acc += a.t() @ a
    mean = acc / seeds
    assert float((mean - torch.eye(n, dtype=torch.float64)).abs().max()) < 0.2
    assert float((mean.diagonal() - 1).abs().mean()) < (1e-6 if kind == "rademacher" else 0.05)


def test_gaussian_moments():
    a = projection_block(3, 50, (0, 8000), kind="gaussian").double() * math.sqrt(50)
    assert abs(float(a.mean())) < 0.01 and abs(float(a.var()) - 1) < 0.01
    assert abs(float((a ** 4).mean()) - 3) < 0.1  # normal kurtosis, not uniform/+-1


def test_hash_is_a_bijection_on_a_range():
    x = torch.arange(0, 1 << 16, dtype=torch.int64)
    assert hash32(x).unique().numel() == x.numel()
    assert int(hash32(torch.tensor([0xFFFFFFFF])).item()) < 2 ** 32


def test_parameter_seed_depends_on_every_part():
    base = parameter_seed(1, 0, "decoder.layers.0.mlp.linear_fc1.weight")
    assert base == parameter_seed(1, 0, "decoder.layers.0.mlp.linear_fc1.weight")
    others = {parameter_seed(2, 0, "decoder.layers.0.mlp.linear_fc1.weight"),
              parameter_seed(1, 1, "decoder.layers.0.mlp.linear_fc1.weight"),
              parameter_seed(1, 0, "decoder.layers.1.mlp.linear_fc1.weight")}
    assert base not in others and len(others) == 3 and 0 <= base < 2 ** 31


# --- sketch statistics ---------------------------------------------------------------------

def test_sketch_reconstruction_is_unbiased_over_seeds():
    """E_A[G A^T A] = G: the mean reconstruction over many seeds approaches G."""
    torch.manual_seed(0)
    g = torch.randn(12, 64, dtype=torch.float64)
    acc = torch.zeros_like(g)
    seeds = 2000
    for s in range(seeds):
        a = projection_block(s, 8, (0, 64)).double()
        acc += (g @ a.t()) @ a
    rel = float((acc / seeds - g).norm() / g.norm())
    assert rel < 0.15, rel  # Monte-Carlo error ~ sqrt(in / (r * seeds)) = 0.063
    one = (g @ projection_block(0, 8, (0, 64)).double().t()) @ projection_block(0, 8, (0, 64)).double()
    assert float((one - g).norm() / g.norm()) > 1.0  # a single sketch is far from G


@pytest.mark.parametrize("r,n", [(16, 256), (64, 256), (32, 1024)])
def test_reconstruction_cosine_is_about_sqrt_r_over_in(r, n):
    torch.manual_seed(r)
    g = torch.randn(64, n, dtype=torch.float64)
    a = projection_block(5, r, (0, n)).double()
    rec = (g @ a.t()) @ a
    cos = float((rec * g).sum() / (rec.norm() * g.norm()))
    assert abs(cos - math.sqrt(r / n)) < 0.25 * math.sqrt(r / n), (cos, math.sqrt(r / n))


# --- RowAdam vs a plain reference ---------------------------------------------------------

def _reference_rowadam(sketches, beta2, eps):
    """Textbook RowAdam, one loop per row, in float64."""
    out, r = sketches[0].shape
    v = [0.0] * out
    directions = []
    for t, s in enumerate(sketches, start=1):
        s = s.double()
        rho = []
        for i in range(out):
            v[i] = beta2 * v[i] + (1 - beta2) * sum(float(x) ** 2 for x in s[i]) / r
            rho.append(math.sqrt(v[i] / (1 - beta2 ** t)))
        mean = sum(rho) / out
        directions.append(torch.tensor([[float(s[i, j]) / (rho[i] + eps * mean) for j in range(r)]
                                        for i in range(out)], dtype=torch.float64))
    return directions


def test_rowadam_matches_the_reference_over_several_steps():
    torch.manual_seed(1)
    sketches = [torch.randn(6, 5) * (1 + i) for i in range(4)]
    sketches[2][3] = 0.0  # a zero row: relative eps keeps it finite
    beta2, eps = 0.95, 1e-3
    expected = _reference_rowadam(sketches, beta2, eps)
    v = torch.zeros(6)
    for t, (s, want) in enumerate(zip(sketches, expected), start=1):
        row_adam.update_row_moments(v, s, beta2)
        rho = row_adam.row_scale(v, t, beta2)
        d = row_adam.direction(s, rho, float(rho.mean()), eps)
        assert torch.allclose(d.double(), want, rtol=1e-5, atol=1e-6), t
    with pytest.raises(ValueError, match="count from 1"):
        row_adam.row_scale(v, 0, beta2)


def test_first_step_direction_is_row_normalised():
    """At t=1 rho_i is the row RMS of S, so each row of D has RMS ~1 (eps aside)."""
    s = torch.randn(4, 32) * torch.tensor([[1e-3], [1.0], [10.0], [1e3]])
    v = torch.zeros(4)
    row_adam.update_row_moments(v, s, 0.95)
    d = row_adam.direction(s, row_adam.row_scale(v, 1, 0.95), 0.0, 1e-8)
    assert torch.allclose(d.pow(2).mean(1).sqrt(), torch.ones(4), atol=1e-5)


def test_rows_without_gradient_get_a_zero_direction_not_nan():
    """A batch with zero advantages (every GRPO group scored alike) gives S = 0: D must be
    0 (no update), for the rows without gradient and for a layer without any."""
    for s in (torch.zeros(3, 8), torch.cat([torch.zeros(1, 8), torch.randn(2, 8)])):
        v = torch.zeros(3)
        row_adam.update_row_moments(v, s, 0.95)
        rho = row_adam.row_scale(v, 1, 0.95)
        d = row_adam.direction(s, rho, float(rho.mean()), 1e-8)
        assert torch.isfinite(d).all()
        assert torch.equal(d[0], torch.zeros(8))


def test_update_norm_without_forming_da_and_split_over_column_slices():
    torch.manual_seed(2)
    d, a = torch.randn(10, 8), projection_block(9, 8, (0, 40))
    full = float((d.double() @ a.double()).pow(2).sum())
    assert math.isclose(float(row_adam.update_sq_norm(d, a)), full, rel_tol=1e-6)  # fp32 products
    parts = sum(float(row_adam.update_sq_norm(d, a[:, c0:c1])) for c0, c1 in [(0, 13), (13, 40)])
    assert math.isclose(parts, full, rel_tol=1e-6)


def test_norm_ratio_factor():
    assert math.isclose(row_adam.norm_ratio_factor(1e-3, 16.0, 4.0), 1e-3 * 4 / 2)
    assert row_adam.norm_ratio_factor(1e-3, 16.0, 0.0) == 0.0
    with pytest.raises(ValueError):
        row_adam.norm_ratio_factor(1e-3, -1.0, 1.0)


@pytest.mark.parametrize("chunk", [1, 3, 1024])
@pytest.mark.parametrize("exact", [True, False])
def test_low_rank_update_in_chunks_equals_the_dense_update(chunk, exact):
    torch.manual_seed(3)
    w, d, a = torch.randn(7, 20), torch.randn(7, 4), projection_block(1, 4, (0, 20))
    want = w - 0.01 * (d @ a)
    got = w.clone()
    row_adam.apply_low_rank_update(got, d, a, 0.01, chunk_rows=chunk, exact=exact)
    assert torch.allclose(got, want, atol=1e-6)
    assert float((got - w).abs().max()) > 1e-3  # the update is far above the tolerance
    half = w.bfloat16()
    row_adam.apply_low_rank_update(half, d, a, 0.01, chunk_rows=chunk, exact=exact)
    assert torch.equal(half, (w.bfloat16().float() - 0.01 * (d @ a)).bfloat16())
    with pytest.raises(ValueError, match="do not chain"):
        row_adam.apply_low_rank_update(got, d, a[:, :10], 0.01)


def test_low_rank_product_does_not_depend_on_the_column_split():
    torch.manual_seed(4)
    d = torch.randn(5, 16).bfloat16().float()
    a = projection_block(2, 16, (0, 64))
    whole = row_adam.low_rank_product(d, a)
    split = torch.cat([row_adam.low_rank_product(d, a[:, :24]),
                       row_adam.low_rank_product(d, a[:, 24:])], dim=1)
    rows = torch.cat([row_adam.low_rank_product(d[:2], a), row_adam.low_rank_product(d[2:], a)])
    assert torch.equal(whole, split) and torch.equal(whole, rows)


# --- stochastic rounding ---------------------------------------------------------------------

def test_stochastic_rounding_is_deterministic_and_slice_independent():
    torch.manual_seed(5)
    x = torch.randn(6, 40)
    rows = torch.arange(6)
    whole = stochastic_round_bf16(x, 11, rows, 0)
    assert whole.dtype == torch.bfloat16 and torch.equal(whole, stochastic_round_bf16(x, 11, rows, 0))
    cols = torch.cat([stochastic_round_bf16(x[:, :15], 11, rows, 0),
                      stochastic_round_bf16(x[:, 15:], 11, rows, 15)], dim=1)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    permuted = stochastic_round_bf16(x[perm], 11, rows[perm], 0)
    assert torch.equal(whole, cols) and torch.equal(whole[perm], permuted)
    assert not torch.equal(whole, stochastic_round_bf16(x, 12, rows, 0))


def test_stochastic_rounding_is_unbiased_and_brackets_the_value():
    x = torch.full((1, 4096), 1.0 + 2 ** -10)  # between bf16 neighbours 1 and 1 + 2^-7
    out = stochastic_round_bf16(x, 0, torch.zeros(1, dtype=torch.int64), 0).float()
    assert set(out.unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert abs(float(out.mean()) - float(x[0, 0])) < 3e-4  # round-to-nearest would give 1.0
    neg = stochastic_round_bf16(-x, 0, torch.zeros(1, dtype=torch.int64), 0).float()
    assert torch.equal(neg, -out)
    exact = torch.tensor([[1.5, -2.0, 0.0, float("inf")]])
    assert torch.equal(stochastic_round_bf16(exact, 3, torch.zeros(1, dtype=torch.int64), 0).float(),
                       exact)
    # non-finite values are truncated, never wrapped into finite ones (a negative NaN's bit
    # pattern 0xFFFFFFFF plus noise would wrap to +0)
    odd = torch.tensor([[float("nan"), -float("inf"), 3.0]])
    odd[0, 0] = torch.tensor(-1, dtype=torch.int32).view(torch.float32)  # 0xFFFFFFFF
    got = stochastic_round_bf16(odd, 3, torch.zeros(1, dtype=torch.int64), 0).float()
    assert got[0, 0].isnan() and got[0, 1] == -float("inf") and got[0, 2] == 3.0
    scratch = x.clone()
    in_place = stochastic_round_bits_(scratch, 0, torch.zeros(1, dtype=torch.int64), 0)
    assert in_place is scratch and torch.equal(scratch, out)  # fp32 holding the bf16 values
    with pytest.raises(ValueError, match="contiguous"):
        stochastic_round_bits_(torch.randn(4, 6)[:, ::2], 0, torch.arange(4), 0)


def test_int32_rounding_noise_equals_the_int64_arithmetic():
    """The in-place int32 noise (wrapping products, masked arithmetic shifts) has exactly the
    bits of the explicit mod-2^32 int64 computation, on rows and columns whose hashes cover
    the whole 32-bit range (signs included)."""
    rows, cols = torch.arange(40_000, 40_512), torch.arange(7_000, 7_700)
    for seed in (0, 12345, 2 ** 31 - 1):
        assert torch.equal(rounding_noise(seed, rows, cols), _rounding_noise_int64(seed, rows, cols))


def test_rounding_noise_is_uniform_down_to_small_thresholds():
    """A sub-resolution update (a small fraction f of a bf16 step) rounds up when noise <
    f 2^16: the 16 noise bits must be uniform down to small thresholds, or such updates
    are biased (an xor-combined hash was 2.3x off at 16, 6x at 4). 5-sigma Poisson bounds."""
    noise = rounding_noise(5, torch.arange(3072), torch.arange(576)).flatten()
    for threshold in (4, 16, 164, 1000, 32768):
        expected = noise.numel() * threshold / 65536
        got = float((noise < threshold).sum())
        assert abs(got - expected) < 5 * expected ** 0.5 + 1, (threshold, got, expected)


@pytest.mark.parametrize("gated", [False, True])
def test_row_shards_partition_whole_rows(gated):
    """Over the DP ranks the owned rows cover every local row exactly once, whole rows only,
    and a gated fc1's shard holds the same piece of the gate and of the up half."""
    from megatron_logra.logra.row_shards import plan_row_shard

    out, dp = 24, 3
    seen = []
    for rank in range(dp):
        shard = plan_row_shard(out, gated, dp, rank)
        assert shard.sharded and shard.num_owned == out // dp
        rows = torch.cat([torch.arange(out)[r] for r, _ in shard.pieces()])
        assert torch.equal(shard.take(torch.arange(out)), rows)
        if gated:
            gate, up = rows[: out // (2 * dp)], rows[out // (2 * dp):]
            assert torch.equal(up - out // 2, gate)
        seen.append(rows)
    assert torch.equal(torch.sort(torch.cat(seen)).values, torch.arange(out))


def test_row_shards_fall_back_to_all_rows_when_not_divisible():
    from megatron_logra.logra.row_shards import plan_row_shard

    shard = plan_row_shard(10, True, 2, 1)  # halves of 5 rows do not split over 2 ranks
    assert not shard.sharded and shard.num_owned == 10
    assert plan_row_shard(10, False, 2, 1).pieces() == [(slice(5, 10), slice(0, 5))]


def test_gated_fc1_local_rows_map_to_canonical_gate_and_up_rows():
    """fc1 of a gated MLP holds [gate_t; up_t] per TP rank; the canonical (TP=1) rows are
    [gate; up]. The TP ranks' rows together are every canonical row once."""
    from types import SimpleNamespace

    from megatron_logra.logra.sketches import _canonical_rows

    module = SimpleNamespace(logra_parallel="column")
    ffn, tp = 8, 2  # canonical rows: gate 0..7, up 8..15; each rank holds 4 + 4
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    r0, r1 = (_canonical_rows(module, name, 2 * ffn // tp, rank, tp, True) for rank in range(tp))
    assert r0.tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert r1.tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
