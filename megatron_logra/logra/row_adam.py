"""RowAdam and the low-rank step: pure tensor math, no process groups.

For a sketched weight W (out x in) with sketch S = G A^T (out x r) and projection
A (r x in) (docs/method.md, section 2):

    v_i  <- b2 v_i + (1 - b2) mean_j S_ij^2           one fp32 number per output row
    rho_i = sqrt(v_i / (1 - b2^t))
    D_ij  = S_ij / (rho_i + eps * mean_{k in m} rho_k)   eps relative to the module's mean rho
    D_m  <- D_m * ||S_m||_F / ||D_m||_F               norm restoration, per module m
    W    <- W - c D A                                  applied in row chunks

A module m is one HF weight (q, k, v, o, gate, up, down): megatron's fused qkv and
fc1 hold several, each with its own relative-eps mean and its own restoration, as the
paper's reference (separate HF modules) computes them. Restoration makes each module's
direction carry its sketch's norm, so modules move in proportion to their gradients;
without it (plain RowAdam) every row is normalised to about the same size.

Under model parallelism a rank holds some rows of W (column-parallel) or a column
slice (row-parallel); the callers reduce the partial quantities (per-module sums of rho,
of S^2 and D^2, squared weight norms, ``update_sq_norm``) over the right groups, so the
math here is the same whatever the layout.
"""

from __future__ import annotations

import torch

from megatron_logra.runtime.host_read import host_value

DEFAULT_CHUNK_ROWS = 1024


def update_row_moments(v: torch.Tensor, sketch: torch.Tensor, beta2: float) -> None:
    """In place: v [out] <- b2 v + (1 - b2) mean_j S_ij^2, for S [out, r] (fp32)."""
    v.mul_(beta2).add_(sketch.float().pow(2).mean(dim=1), alpha=1.0 - beta2)


def row_scale(v: torch.Tensor, step: int, beta2: float) -> torch.Tensor:
    """rho [out] = sqrt(v / (1 - b2^step)): the bias-corrected row RMS of the sketch."""
    if step < 1:
        raise ValueError(f"step {step}: RowAdam steps count from 1")
    return (v / (1.0 - beta2 ** step)).sqrt()


def direction(sketch: torch.Tensor, rho: torch.Tensor, mean_rho: float | torch.Tensor,
              eps: float) -> torch.Tensor:
    """D [out, r] = S / (rho + eps * mean_rho) (fp32). ``mean_rho`` is over ALL rows of the
    layer (callers reduce it over tensor parallel ranks). A row that never had a gradient
    (rho = 0, so S = 0; all of them when mean_rho = 0 too) gets D = 0, not 0 / 0."""
    return sketch.float() / row_denominator(rho, mean_rho, eps)[:, None]


def row_denominator(rho: torch.Tensor, mean_rho: float | torch.Tensor,
                    eps: float) -> torch.Tensor:
    """[out] rho + eps * mean_rho, with 1 where that is 0 (rows without gradient: S = 0)."""
    denom = rho + eps * mean_rho
    return torch.where(denom > 0, denom, torch.ones_like(denom))


def module_sums(values: torch.Tensor, modules: torch.Tensor, num_modules: int) -> torch.Tensor:
    """Per-module sums [num_modules] (fp64) of per-row ``values`` [rows]; ``modules`` [rows]
    (int64) is each row's module index."""
    out = torch.zeros(num_modules, dtype=torch.float64, device=values.device)
    return out.index_add_(0, modules.to(values.device), values.double())


def restoration_factors(sketch_sq: torch.Tensor, direction_sq: torch.Tensor) -> torch.Tensor:
    """||S_m|| / ||D_m|| per module from squared norms [m] (0 where D_m = 0: no gradient)."""
    ok = direction_sq > 0
    return torch.where(ok, (sketch_sq / torch.where(ok, direction_sq, 1.0)).sqrt(), 0.0)


def update_sq_norm(d: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """||D A||_F^2 without forming D A: sum_i (D (A A^T))_i . D_i, D [out, r], A [r, in].

    For a column slice A[:, c0:c1] it gives that slice's share, so summing over the slices
    (tensor-parallel ranks of a row-parallel layer) gives the whole norm. fp32 products (cost
    r^2 (in + out), under one D A product), per-row fp32 dots of r terms, fp64 sum over
    rows."""
    a, d = projection.float(), d.float()
    return torch.linalg.vecdot(d @ (a @ a.t()), d, dim=1).double().sum()


def weight_sq_norm(weight: torch.Tensor, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> float:
    """||W||_F^2 of a [out, in] block in fp64, ``chunk_rows`` rows at a time (a bf16 weight is
    never upcast whole)."""
    total = torch.zeros((), dtype=torch.float64, device=weight.device)
    for r0 in range(0, weight.shape[0], chunk_rows):
        total += torch.linalg.vector_norm(weight[r0:r0 + chunk_rows],
                                          dtype=torch.float32).double() ** 2
    return host_value(total, assume=1.0)  # one read of the device, not one per chunk


def norm_ratio_factor(update_ratio: float, weight_sq: float, update_sq: float) -> float:
    """c = update_ratio * ||W|| / ||D A|| over all sketched layers (0 when there is no update)."""
    if update_sq < 0 or weight_sq < 0:
        raise ValueError(f"negative squared norms: ||W||^2 {weight_sq}, ||DA||^2 {update_sq}")
    if update_sq == 0.0:
        return 0.0
    return update_ratio * (weight_sq ** 0.5) / (update_sq ** 0.5)


def low_rank_product(d_rows: torch.Tensor, projection: torch.Tensor,
                     exact: bool = True) -> torch.Tensor:
    """(D A) for a block of rows: [rows, r] x [r, in] -> fp32 [rows, in].

    ``exact``: accumulated in fp64. Each element is sum_k D_ik A_kj over the r sketch
    coordinates only, so it does not depend on how the columns are split over ranks; with D
    rounded to bf16 and A = +-1/sqrt(r) every product is exact in fp64, which makes the fp32
    result reproducible across layouts and devices. Otherwise a plain fp32 GEMM (faster)."""
    if exact:
        return (d_rows.double() @ projection.double()).float()
    return d_rows.float() @ projection.float()


def apply_low_rank_update(weight: torch.Tensor, d: torch.Tensor, projection: torch.Tensor,
                          scale: float, *, chunk_rows: int = DEFAULT_CHUNK_ROWS,
                          round_fn=None, exact: bool = True) -> None:
    """In place: W [out, in] -= scale * D [out, r] @ A [r, in], ``chunk_rows`` rows at a time
    (D A is never formed whole). ``round_fn(new_fp32, row0)`` rounds each chunk (default:
    round to nearest), returning it in W's dtype or as fp32 values W's dtype holds exactly;
    ``exact`` as in ``low_rank_product``. An fp32 W without
    ``exact`` or ``round_fn`` (an fp32 master) takes one in-place GEMM, W += (-scale) D A."""
    if d.shape[0] != weight.shape[0] or d.shape[1] != projection.shape[0] \
            or projection.shape[1] != weight.shape[1]:
        raise ValueError(f"shapes do not chain: W {tuple(weight.shape)}, D {tuple(d.shape)}, "
                         f"A {tuple(projection.shape)}")
    if not exact and round_fn is None and weight.dtype == torch.float32:
        weight.addmm_(d.float(), projection.float(), alpha=-scale)
        return
    a = projection.double() if exact else projection.float()  # converted once, not per chunk
    for r0 in range(0, weight.shape[0], chunk_rows):
        rows = slice(r0, min(r0 + chunk_rows, weight.shape[0]))
        new = low_rank_product(d[rows], a, exact)  # fp32 D A of the chunk
        if scale == 1.0:  # the usual case: the coefficient is already in the bf16 factor
            torch.sub(weight[rows], new, out=new)  # W - D A in one pass
        else:
            new.mul_(-scale).add_(weight[rows])  # W - fp32(scale D A)
        weight[rows].copy_(new if round_fn is None else round_fn(new, r0))  # cast in the copy
