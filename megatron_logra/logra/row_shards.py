"""Row-aligned data-parallel sharding of the sketched weights' optimizer work and state.

With ``--use-distributed-optimizer`` each DP rank of a sketched weight's local block
[out_local, in_local] owns a contiguous run of whole rows: it keeps the RowAdam row
state v and (when kept) the fp32 master only for those rows, computes their update,
and the DP group then all-gathers the updated rows of the weight in place. Rows are
never cut (RowAdam normalises whole rows), unlike megatron's flat 1-D shards.

A gated fc1 holds [gate_t; up_t] (two segments); each segment is split separately so
a shard is also a run of rows in the canonical TP=1 layout of each half, which is how
the checkpoint stores it. A weight whose segments do not divide by the DP size is
not sharded (every DP rank owns all its rows, as without the distributed optimizer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class RowShard:
    """Which rows of a local weight block this DP rank owns.

    ``segments``: the weight's local row ranges [a, b) that are split separately;
    ``num_shards`` pieces each (1: not sharded); this rank owns piece ``index`` of each.
    """

    segments: tuple[tuple[int, int], ...]
    num_shards: int
    index: int

    def pieces(self) -> list[tuple[slice, slice]]:
        """[(rows of the local weight, rows of the owned state)] per segment, in order."""
        out, s0 = [], 0
        for a, b in self.segments:
            n = (b - a) // self.num_shards
            lo = a + self.index * n
            out.append((slice(lo, lo + n), slice(s0, s0 + n)))
            s0 += n
        return out

    @property
    def num_owned(self) -> int:
        return sum((b - a) // self.num_shards for a, b in self.segments)

    @property
    def sharded(self) -> bool:
        return self.num_shards > 1

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """The owned rows of ``tensor`` (dim 0 = the weight's local rows): a view when the
        weight has one segment, else a concatenated copy."""
        parts = [tensor[rows] for rows, _ in self.pieces()]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def plan_row_shard(out_local: int, two_segments: bool, dp_size: int, dp_rank: int) -> RowShard:
    """The shard of a weight with ``out_local`` local rows (``two_segments``: gated fc1)."""
    half = out_local // 2
    segments = ((0, half), (half, out_local)) if two_segments else ((0, out_local),)
    divides = dp_size > 1 and all((b - a) % dp_size == 0 and b > a for a, b in segments)
    return RowShard(segments, dp_size if divides else 1, dp_rank if divides else 0)


def all_gather_rows(weight: torch.Tensor, shard: RowShard, group) -> None:
    """In place: every DP rank's owned rows of ``weight`` [out_local, in] to all ranks of
    ``group`` (one all-gather per segment; the segments' pieces are contiguous in order)."""
    if not shard.sharded:
        return
    for (a, b), (rows, _) in zip(shard.segments, shard.pieces()):
        _all_gather(weight[a:b], weight[rows], group=group)  # in place, as megatron's
