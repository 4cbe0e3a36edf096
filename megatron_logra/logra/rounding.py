"""Deterministic stochastic rounding fp32 -> bf16 with counter-based random bits.

The random bits of element (i, j) are a pure function of (seed, global row i,
global column j), so two processes holding the same bf16 weights and the same
fp32 values of W - c D A round them to bit-identical bf16 weights, whatever
their tensor-parallel layout or device. Rounding is unbiased:
E[round(x)] = x for every finite x (the magnitude's low 16 bits decide).

No float conversion decides a bit: the rounded fp32 values have their low 16 bits
zero, and their bf16 is their high 16 bits, taken by an integer shift
(``rounded_to_bf16_``). torch's own fp32 -> bf16 cast encodes a NaN differently by
device (0xFFFF on this x86 CPU, vectorized or not; a positive canonical NaN on CUDA),
so every NaN is first made ``CANONICAL_NAN`` here, on every device.
"""

from __future__ import annotations

import torch

from megatron_logra.logra.projection import MASK32, as_int32, hash32
from megatron_logra.runtime.host_read import host_value

CANONICAL_NAN = 0x7FC00000
"""The fp32 bits every NaN is rounded to (bf16 0x7FC0: positive, quiet, no payload)."""


def rounding_noise(seed: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """16 random bits per element [len(rows), len(cols)] (int32), a pure function of (seed,
    global row, global column). Rows and columns are hashed once each (lowbias32, stream
    2); an element combines its two hashes (h_row + 0x9E37 h_col mod 2^32), then one
    xorshift-multiply round, and keeps the top 16 bits of the 32-bit word. Measured
    uniform down to P(noise < 4) (``tests/unit/test_logra_math.py``); six times fewer
    passes over the block than a full per-element hash, which made SR most of the cost
    of a bf16 update. (Combining the hashes with xor instead left P(noise < 16) 2.3x too
    high: biased rounding of sub-resolution updates.)

    The per-element work runs in place in int32, whose products wrap mod 2^32 (CPU and
    CUDA alike): the same low 32 bits as the mod-2^32 arithmetic in int64 that
    ``_rounding_noise_int64`` spells out (the tests check they agree), at a quarter of the
    memory traffic. Shifts are arithmetic in int32, so each is masked to 16 bits."""
    h_row, h_col = _row_and_column_hashes(seed, rows, cols)
    mixed = as_int32(h_col)[None, :] * 0x9E37 + as_int32(h_row)[:, None]
    mixed ^= (mixed >> 16).bitwise_and_(0xFFFF)
    mixed *= 0x2C1B3C6D
    return (mixed >> 16).bitwise_and_(0xFFFF)


def _row_and_column_hashes(seed: int, rows: torch.Tensor, cols: torch.Tensor):
    key = hash32(torch.tensor((seed ^ (2 * 0x9E3779B9)) & MASK32, dtype=torch.int64,
                              device=rows.device))
    return (hash32((rows.to(torch.int64) ^ key) & MASK32),
            hash32((cols.to(torch.int64) + key) & MASK32))


def _rounding_noise_int64(seed: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``rounding_noise`` in int64 with explicit mod-2^32 masks (the reference it must equal)."""
    h_row, h_col = _row_and_column_hashes(seed, rows, cols)
    mixed = (h_row[:, None] + h_col[None, :] * 0x9E37) & MASK32  # products < 2^63
    mixed = mixed ^ (mixed >> 16)
    return (((mixed * 0x2C1B3C6D) & MASK32) >> 16).to(torch.int32)


def stochastic_round_bf16(values: torch.Tensor, seed: int, rows: torch.Tensor,
                          col0: int) -> torch.Tensor:
    """values fp32 [n, cols] -> bf16 [n, cols]; ``rows`` [n] are the elements' global row
    indices (canonical, layout-independent), ``col0`` the global index of the first column.

    In int32: the noise (< 2^16) is added to the fp32 bit pattern and the low 16 bits are
    cut. For a negative value the two's-complement add is the same bit pattern as adding
    to its magnitude, so both signs round away from zero with probability equal to the
    cut fraction (unbiased); infinities are kept, every NaN becomes ``CANONICAL_NAN``. The
    bf16 result is the rounded bits' high half (``rounded_to_bf16_``): the same bits on
    every device."""
    return rounded_to_bf16_(stochastic_round_bits_(values.clone(), seed, rows, col0))


def stochastic_round_bits_(values: torch.Tensor, seed: int, rows: torch.Tensor,
                           col0: int) -> torch.Tensor:
    """``stochastic_round_bf16`` in place on contiguous fp32 ``values``, which are left
    holding the rounded bf16 values in fp32 (low 16 bits zero; ``rounded_to_bf16_`` makes
    them bf16 without a float conversion). Returns ``values``."""
    if values.dtype != torch.float32 or values.dim() != 2 or rows.shape != values.shape[:1] \
            or not values.is_contiguous():
        raise ValueError(f"want a contiguous 2-D fp32 tensor and one row index per row, got "
                         f"{values.dtype} {tuple(values.shape)} and rows {tuple(rows.shape)}")
    device = values.device
    cols = torch.arange(col0, col0 + values.shape[1], device=device, dtype=torch.int64)
    noise = rounding_noise(seed, rows.to(device=device, dtype=torch.int64), cols)
    keep_high = -65536  # 0xFFFF0000 as int32
    bits = values.view(torch.int32)
    low, high = torch.aminmax(values)  # one read; NaN propagates into both
    if host_value(torch.isfinite(low) & torch.isfinite(high), assume=True):
        bits.add_(noise).bitwise_and_(keep_high)
    else:  # non-finite: infinities truncated (exact), NaNs canonical (adding noise could
        # wrap a NaN's bits into a number; truncating one could make it an infinity)
        finite = torch.isfinite(values)
        nan = torch.isnan(values)
        rounded = torch.where(finite, (bits + noise) & keep_high, bits & keep_high)
        bits.copy_(rounded.masked_fill_(nan, CANONICAL_NAN))
    return values


def rounded_to_bf16_(values: torch.Tensor) -> torch.Tensor:
    """fp32 ``values`` whose low 16 bits are zero (``stochastic_round_bits_``'s) -> the bf16
    tensor of their high 16 bits, by an arithmetic shift in int32 (exact: nothing is cut;
    no float conversion, so the bits are the same on every device, NaNs included).
    Consumes ``values`` (their bits are shifted in place)."""
    if values.dtype != torch.float32:
        raise ValueError(f"rounded_to_bf16_ takes fp32 values, got {values.dtype}")
    return values.view(torch.int32).bitwise_right_shift_(16).to(torch.int16).view(torch.bfloat16)

