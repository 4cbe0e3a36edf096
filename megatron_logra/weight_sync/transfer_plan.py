"""Which piece of a trainer rank's shard goes where in which vLLM worker (direct channel).

Pure index arithmetic, no torch.distributed and no vLLM: ``shard_blocks`` maps the part
of a canonical (Megatron TP=1) parameter that one trainer rank holds (its TP shard: row
runs and a column range) onto the vLLM workers' fused, sharded parameters
(``vllm_layout.vllm_placements``) through the HF row mapping
(``hf_mapping.row_segments``: qkv interleave per query group, fc1 = [gate; up], vocab
padding). The result is a list of rectangular ``Block`` copies, each from one sender to
one worker: no rank assembles a parameter and no worker receives rows it does not hold
(a worker holding replicated KV heads or a norm gets its own copy).

``worker_rows`` does the same for the rows of a sketch delta (a worker needs the D rows
of every HF row it holds, whatever its columns).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_logra.weight_sync.vllm_layout import vllm_placements
from megatron_logra.model.arch import ModelArch
from megatron_logra.model.hf_mapping import row_segments
from megatron_logra.model.sharding import shard_ranges


@dataclass(frozen=True)
class Block:
    """Rows [src_row, src_row + rows) x columns [src_col, src_col + cols) of the sender's
    local shard of canonical parameter ``name`` are rows [dst_row, ...) x columns
    [dst_col, ...) of vLLM parameter ``param`` on engine TP rank ``worker``, whose rows
    are ``dst_width`` wide (``cols`` and ``dst_width`` None: a 1-D tensor)."""

    name: str
    worker: int
    param: str
    src_row: int
    dst_row: int
    rows: int
    src_col: int = 0
    dst_col: int = 0
    cols: int | None = None
    dst_width: int | None = None

    @property
    def numel(self) -> int:
        return self.rows * (self.cols or 1)


@dataclass(frozen=True)
class ShardExtent:
    """What one trainer rank holds of a canonical parameter: canonical row runs
    [start, stop) in its local row order, and its canonical columns (None: 1-D)."""

    row_runs: tuple[tuple[int, int], ...]
    cols: tuple[int, int] | None


def shard_extent(shape: tuple[int, ...], split: tuple[int, int] | None, tp_rank: int,
                 tp_size: int) -> ShardExtent:
    """The extent of TP rank ``tp_rank``'s shard of a parameter of canonical ``shape``;
    ``split``: (partition_dim, stride) of a tensor-parallel one (``sharding.tp_split``),
    None when replicated."""
    rows = ((0, shape[0]),)
    cols = (0, shape[1]) if len(shape) == 2 else None
    if split is None or tp_size == 1:
        return ShardExtent(rows, cols)
    dim, stride = split
    ranges = tuple(shard_ranges(shape[dim], stride, tp_rank, tp_size))
    if dim == 0:
        return ShardExtent(ranges, cols)
    if len(ranges) != 1:
        raise ValueError(f"a column split with stride {stride} is not a Megatron layout")
    return ShardExtent(rows, ranges[0])


def shard_blocks(arch: ModelArch, name: str, extent: ShardExtent, engine_tp: int) -> list[Block]:
    """Every block of this shard of canonical parameter ``name`` that some vLLM worker of
    an engine at TP ``engine_tp`` holds (see the module doc)."""
    out = []
    local = 0
    segments = row_segments(arch, name)
    for a, b in extent.row_runs:
        offset = 0
        for seg in segments:
            lo, hi = offset, offset + seg.rows
            offset = hi
            start, stop = max(a, lo), min(b, hi)
            if seg.hf_name is None or start >= stop:
                continue
            hf0, hf1 = start - lo + seg.start, stop - lo + seg.start
            src0 = local + start - a  # the shard's local row of HF row hf0
            for worker in range(engine_tp):
                for p in vllm_placements(arch, seg.hf_name, engine_tp, worker):
                    r0, r1 = max(hf0, p.row0), min(hf1, p.row1)
                    if r0 >= r1:
                        continue
                    rows = dict(src_row=src0 + r0 - hf0, dst_row=p.local_row + r0 - p.row0,
                                rows=r1 - r0)
                    if extent.cols is None or p.col0 is None:
                        out.append(Block(name, worker, p.param, **rows))
                        continue
                    c0, c1 = max(extent.cols[0], p.col0), min(extent.cols[1], p.col1)
                    if c0 < c1:
                        out.append(Block(name, worker, p.param, **rows,
                                         src_col=c0 - extent.cols[0], dst_col=c0 - p.col0,
                                         cols=c1 - c0, dst_width=p.col1 - p.col0))
        local += b - a
    return out


def worker_rows(arch: ModelArch, name: str, rows: torch.Tensor,
                engine_tp: int) -> list[torch.Tensor]:
    """For each engine TP rank: a bool mask over canonical ``rows`` [n] of parameter
    ``name``, True where that worker holds the row's HF row (any columns of it)."""
    masks = [torch.zeros(rows.numel(), dtype=torch.bool) for _ in range(engine_tp)]
    offset = 0
    for seg in row_segments(arch, name):
        lo, hi = offset, offset + seg.rows
        offset = hi
        if seg.hf_name is None:
            continue
        hf_rows = rows - lo + seg.start
        inside = (rows >= lo) & (rows < hi)
        for worker in range(engine_tp):
            for p in vllm_placements(arch, seg.hf_name, engine_tp, worker):
                masks[worker] |= inside & (hf_rows >= p.row0) & (hf_rows < p.row1)
    return masks
