"""Counter-based random projections: A[i, j] = f(seed, i, j), regenerated, never stored.

A sketched weight W (out x in) gets a projection A (r x in) per update. Every
entry is a pure function of (seed, row i, column j), computed with 32-bit integer
hashing in int64 tensors (no overflow, no floating point in the hash), so:

* any column slice ``A[:, c0:c1]`` is generated without the rest, identically on
  every rank (a row-parallel TP shard uses its slice of the *global* A);
* CPU and CUDA give bit-identical Rademacher values (and the rollout engine can
  regenerate them from the seed alone).

Rademacher (default): +-1/sqrt(r), 32 signs per hashed word: word (i, b) covers
columns 32 b .. 32 b + 31 of row i, bit k of it the sign of column 32 b + k (one
hash per 32 entries; generating A was a third of a LoGRA step when every entry
cost a hash). Gaussian: N(0, 1/r) by Box-Muller on two 24-bit uniforms in
float64, two hashes per entry; identical across ranks of one device type, and
within one float32 ulp between CPU and CUDA (libm differences in log/cos).
E[A^T A] = I for both, so G A^T A is an unbiased estimate of G.
"""

from __future__ import annotations

import hashlib
import math

import torch

MASK32 = 0xFFFFFFFF
PROJECTIONS = ("rademacher", "gaussian")


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), exactly (no int64 overflow)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer mixer (Wellons' lowbias32) on int64 tensors in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_words(seed: int, rows: torch.Tensor, cols: torch.Tensor, stream: int) -> torch.Tensor:
    """[len(rows), len(cols)] 32-bit random words, a pure function of (seed, row, col, stream)
    for integer row/column indices (any subset, any device). Streams: 0, 1 projections, 2
    stochastic rounding."""
    key = hash32(torch.tensor((seed ^ (stream * 0x9E3779B9)) & MASK32, dtype=torch.int64,
                              device=rows.device))
    h_row = hash32((rows.to(torch.int64) ^ key) & MASK32)
    return hash32((h_row[:, None] * 0x10001 + hash32(cols.to(torch.int64) + key)[None, :])
                  & MASK32 ^ key)


def projection_block(seed: int, rank: int, cols: tuple[int, int], *, kind: str = "rademacher",
                     device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Columns ``cols = (c0, c1)`` of the global projection A: shape [rank, c1 - c0]."""
    if kind not in PROJECTIONS:
        raise ValueError(f"projection {kind!r}: choose one of {PROJECTIONS}")
    rows = torch.arange(rank, device=device)
    scale = 1.0 / math.sqrt(rank)
    if kind == "rademacher":
        return rademacher_signs(seed, rows, cols).to(dtype) * scale
    columns = torch.arange(cols[0], cols[1], device=device)
    words = counter_words(seed, rows, columns, stream=0)
    u1 = ((words >> 8).to(torch.float64) + 1.0) / 16777217.0  # (0, 1): log is finite
    u2 = (counter_words(seed, rows, columns, stream=1) >> 8).to(torch.float64) / 16777216.0
    gauss = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
    return (gauss * scale).to(dtype)


SIGNS_PER_WORD = 32


def as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) -> int32 with the same 32 bits."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def rademacher_signs(seed: int, rows: torch.Tensor, cols: tuple[int, int]) -> torch.Tensor:
    """[len(rows), c1 - c0] int32 +-1: bit (c mod 32) of word (row, c // 32), stream 0."""
    c0, c1 = cols
    first, last = c0 // SIGNS_PER_WORD, -(-c1 // SIGNS_PER_WORD)
    blocks = torch.arange(first, last, device=rows.device)
    words = as_int32(counter_words(seed, rows, blocks, stream=0))  # [r, blocks]
    shifts = torch.arange(SIGNS_PER_WORD, dtype=torch.int32, device=rows.device)
    # bit k of each word (an arithmetic shift's sign fill lands only above bit 31 - k)
    bits = (words[:, :, None] >> shifts).bitwise_and_(1).view(len(rows), -1)
    skip = first * SIGNS_PER_WORD
    return bits[:, c0 - skip:c1 - skip].mul(2).sub_(1)


def parameter_seed(base_seed: int, update: int, name: str) -> int:
    """The 31-bit seed of parameter ``name``'s projection at update ``update`` (layout-independent
    canonical name, so every TP/PP layout and the rollout engine derive the same A)."""
    digest = hashlib.blake2b(f"{base_seed}/{update}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF
