"""Deterministic stochastic rounding fp32 -> bf16 with counter-based random bits.

The random bits of element (i, j) are a pure function of (seed, global row i,
global column j), so two processes holding the same bf16 weights and the same
fp32 values of W - c D A round them to bit-identical bf16 weights, whatever
their tensor-parallel layout or device. Rounding is unbiased:
E[round(x)] = x for every finite x (the magnitude's low 16 bits decide).
"""

from __future__ import annotations

import torch

from megatron_logra.logra.projection import MASK32, counter_words


def _signed32(x: torch.Tensor) -> torch.Tensor:
    """int64 in [0, 2^32) -> the int32 with the same bits."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def stochastic_round_bf16(values: torch.Tensor, seed: int, rows: torch.Tensor,
                          col0: int) -> torch.Tensor:
    """values fp32 [n, cols] -> bf16 [n, cols]; ``rows`` [n] are the elements' global row
    indices (canonical, layout-independent), ``col0`` the global index of the first column."""
    if values.dtype != torch.float32 or values.dim() != 2 or rows.shape != values.shape[:1]:
        raise ValueError(f"want a 2-D fp32 tensor and one row index per row, got {values.dtype} "
                         f"{tuple(values.shape)} and rows {tuple(rows.shape)}")
    device = values.device
    rows = rows.to(device=device, dtype=torch.int64)
    cols = torch.arange(col0, col0 + values.shape[1], device=device, dtype=torch.int64)
    noise = counter_words(seed, rows, cols, stream=2) & 0xFFFF
    bits = values.contiguous().view(torch.int32).to(torch.int64) & MASK32
    finite = torch.isfinite(values)
    rounded = torch.where(finite, (bits + noise) & 0xFFFF0000, bits & 0xFFFF0000)
    return _signed32(rounded).view(torch.float32).to(torch.bfloat16)
