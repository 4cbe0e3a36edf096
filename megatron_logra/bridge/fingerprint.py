"""A cheap per-tensor fingerprint in HF coordinates: f(X) = u^T X v (fp64).

u and v are fixed pseudo-random vectors in [0.5, 1.5) indexed by HF row and column
(counter-based, the same in every process), so two processes holding the same HF
tensor get the same number up to fp64 summation order, and a single changed element
moves it by about |delta| (u_i v_j ~ 1). Cost: one matrix-vector product per tensor.
Compared with ``same_fingerprint`` (relative 1e-9: far below a one-ulp bf16 change of
any element, far above fp64 reordering).
"""

from __future__ import annotations

import torch

from megatron_logra.logra.projection import counter_words

_SEED = 0x5EED
RTOL = 1e-9


def _weights(start: int, n: int, stream: int) -> torch.Tensor:
    index = torch.arange(start, start + n)
    words = counter_words(_SEED, torch.zeros(1, dtype=torch.int64), index, stream)[0]
    return 0.5 + (words >> 8).to(torch.float64) / 16777216.0


def fingerprint(tensor: torch.Tensor, row0: int = 0, col0: int = 0) -> float:
    """u^T X v of a 1-D or 2-D tensor (fp64). For a piece of a larger tensor (rows from
    ``row0``, columns from ``col0``), its share: the pieces of a tensor sum to its
    fingerprint (a sharded receiver adds up its workers')."""
    x = tensor.detach().to("cpu", torch.float64)
    if x.dim() == 1:
        return float(x @ _weights(row0, x.shape[0], 3))
    if x.dim() != 2:
        x = x.reshape(x.shape[0], -1)
    return float(_weights(row0, x.shape[0], 3) @ (x @ _weights(col0, x.shape[1], 4)))


def same_fingerprint(a: float, b: float) -> bool:
    return abs(a - b) <= RTOL * max(abs(a), abs(b), 1e-30)
