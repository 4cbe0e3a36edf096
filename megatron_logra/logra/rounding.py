"""Deterministic stochastic rounding fp32 -> bf16 with counter-based random bits.

The random bits of element (i, j) are a pure function of (seed, global row i,
global column j), so two processes holding the same bf16 weights and the same
fp32 values of W - c D A round them to bit-identical bf16 weights, whatever
their tensor-parallel layout or device. Rounding is unbiased:
E[round(x)] = x for every finite x (the magnitude's low 16 bits decide).
"""

from __future__ import annotations

import torch

from megatron_logra.logra.projection import MASK32, hash32


def rounding_noise(seed: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """16 random bits per element [len(rows), len(cols)] (int32), a pure function of (seed,
    global row, global column). Rows and columns are hashed once each (lowbias32, stream
    2); an element combines its two hashes (h_row + 0x9E37 h_col mod 2^32), then one
    xorshift-multiply round, and keeps the top 16 bits of the 32-bit word. Measured
    uniform down to P(noise < 4) (``tests/unit/test_logra_math.py``); six times fewer
    passes over the block than a full per-element hash, which made SR most of the cost
    of a bf16 update. (Combining the hashes with xor instead left P(noise < 16) 2.3x too
    high: biased rounding of sub-resolution updates.)"""
    key = hash32(torch.tensor((seed ^ (2 * 0x9E3779B9)) & MASK32, dtype=torch.int64,
                              device=rows.device))
    h_row = hash32((rows.to(torch.int64) ^ key) & MASK32)
    h_col = hash32((cols.to(torch.int64) + key) & MASK32)
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
    cut fraction (unbiased); non-finite values are only truncated."""
    if values.dtype != torch.float32 or values.dim() != 2 or rows.shape != values.shape[:1]:
        raise ValueError(f"want a 2-D fp32 tensor and one row index per row, got {values.dtype} "
                         f"{tuple(values.shape)} and rows {tuple(rows.shape)}")
    device = values.device
    cols = torch.arange(col0, col0 + values.shape[1], device=device, dtype=torch.int64)
    noise = rounding_noise(seed, rows.to(device=device, dtype=torch.int64), cols)
    bits = values.contiguous().view(torch.int32)
    keep_high = -65536  # 0xFFFF0000 as int32
    rounded = torch.where(torch.isfinite(values), (bits + noise) & keep_high, bits & keep_high)
    return rounded.view(torch.float32).to(torch.bfloat16)
