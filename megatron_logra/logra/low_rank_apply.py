"""Apply a received low-rank update to bf16 weights exactly as the trainer did.

An update of a sketched weight is (D, coefficient, seed): W <- W - coefficient * D A(seed).
In the ``none`` precision mode the trainer applies it with this function, and any other
process holding the same bf16 W (a rollout engine, a replica, a later audit) gets
bit-identical weights from the same inputs, for any split of W's rows or columns:
A's columns are regenerated from the seed, each element of D A is a sum over the r
sketch coordinates only (fp64, exact products for bf16 D and Rademacher A), and the
stochastic rounding bits depend only on (seed, global row, global column).
"""

from __future__ import annotations

import torch

from megatron_logra.logra.projection import projection_block
from megatron_logra.logra.rounding import rounded_to_bf16_, stochastic_round_bits_
from megatron_logra.logra.row_adam import DEFAULT_CHUNK_ROWS, apply_low_rank_update


def apply_bf16_update(weight: torch.Tensor, d: torch.Tensor, coefficient: float, seed: int, *,
                      rank: int, kind: str, global_rows: torch.Tensor, col_offset: int,
                      projection: torch.Tensor | None = None,
                      chunk_rows: int = DEFAULT_CHUNK_ROWS) -> None:
    """In place on bf16 ``weight`` [rows, cols] (global rows ``global_rows``, columns from
    ``col_offset``): W <- SR(W - coefficient * D A), D [rows, rank]."""
    if weight.dtype != torch.bfloat16:
        raise ValueError(f"apply_bf16_update needs bf16 weights, got {weight.dtype}")
    if projection is None:
        projection = projection_block(seed, rank, (col_offset, col_offset + weight.shape[1]),
                                      kind=kind, device=weight.device)

    def round_fn(new: torch.Tensor, r0: int) -> torch.Tensor:  # bf16 bits, no float cast
        rows = global_rows[r0:r0 + new.shape[0]]
        return rounded_to_bf16_(stochastic_round_bits_(new, seed, rows, col_offset))

    apply_low_rank_update(weight, d, projection, coefficient, chunk_rows=chunk_rows,
                          round_fn=round_fn)
