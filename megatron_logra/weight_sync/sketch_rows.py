"""Sketch-delta weight sync: per sketched weight the scaled D and its seed, not W.

An update of a sketched weight is W -= coefficient * D A(seed) (``LograOptimizer``
with ``keep_updates``). The trainer sends, per canonical weight, the rows of D it
owns with their canonical (TP=1) row indices; the receiver maps those rows onto its
HF tensors (qkv interleave per query group, fc1 = [gate; up], vocab padding:
``hf_mapping.row_segments``), regenerates A from the seed with the counter-based
generator and applies the same update. With ``--logra-master-weights none`` (bf16
weights, stochastic rounding keyed by seed, global row and column) the result is
bit-identical to the trainer's weights, whatever the trainer's TP/PP/DP layout.

Who sends what (each rank only what it owns, no TP gather): a column-parallel weight's
TP ranks hold disjoint rows; a row-parallel weight's D rows are whole on every TP rank
(TP rank 0 sends them); with DP-sharded rows each DP rank sends its own rows, else DP
rank 0; a tied embedding's last-stage copy is skipped (the first stage sends it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_logra.weight_sync.vllm_layout import Locate, whole_tensors
from megatron_logra.logra.low_rank_apply import apply_bf16_update
from megatron_logra.logra.projection import projection_block
from megatron_logra.logra.row_adam import apply_low_rank_update
from megatron_logra.model.arch import ModelArch
from megatron_logra.model.hf_mapping import megatron_param_shape, row_segments


def encode_rows(rows: torch.Tensor) -> torch.Tensor:
    """Sorted row indices [n] -> runs [k, 2] (start, length) int64: a TP shard's rows are
    one or two runs, an embedding's touched rows many short ones."""
    if rows.numel() == 0:
        return torch.zeros(0, 2, dtype=torch.int64)
    breaks = torch.nonzero(rows[1:] - rows[:-1] != 1).squeeze(1) + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
    ends = torch.cat([breaks, torch.tensor([rows.numel()])])
    return torch.stack([rows[starts], ends - starts], dim=1)


def decode_rows(runs: torch.Tensor) -> torch.Tensor:
    if runs.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(int(a), int(a) + int(n)) for a, n in runs.tolist()])


EXPLICIT = "explicit"
"""``RowsUpdate.kind`` of an update that carries A itself (``projection``): a trainer whose
A is not a seeded projection (``weight_sync.low_rank_push``)."""


@dataclass(frozen=True)
class RowsUpdate:
    """Rows of one sketched weight's update: W[rows] -= coefficient * d A, A regenerated
    from ``seed`` (``kind`` rademacher | gaussian) or carried (``kind`` explicit)."""

    name: str  # canonical megatron name
    runs: torch.Tensor  # [k, 2] int64 (start, length) runs of canonical rows, ascending
    d: torch.Tensor  # [n, r] (bf16 values in SR mode), rows in the runs' order
    coefficient: float
    seed: int  # A's seed, and the stochastic rounding's (bf16 weights)
    rank: int
    kind: str  # projection: rademacher | gaussian | explicit
    projection: torch.Tensor | None = None  # [r, in] fp32: A itself (kind explicit only)

    @property
    def rows(self) -> torch.Tensor:
        return decode_rows(self.runs)

    def nbytes(self) -> int:
        carried = 0 if self.projection is None else self.projection.numel() * 4
        return (self.runs.numel() * 8 + self.d.numel() * self.d.element_size() + carried
                + 8 + 8 + len(self.name))


def owned_updates(optimizer) -> list[RowsUpdate]:
    """This rank's share of the last update of every sketched weight (see module doc)."""
    from megatron.core import parallel_state  # trainer only: vLLM workers import this module

    sk = optimizer.sketches
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    out = []
    for slot in sk.slots:
        update = optimizer.last_updates.get(slot.name)
        if update is None:
            raise RuntimeError("sketch-delta sync needs the optimizer's last updates: set "
                               "keep_updates before the step")
        if slot.duplicate or (slot.parallel == "row" and tp_rank != 0):
            continue
        if not update.shard.sharded and dp_rank != 0:
            continue
        rows = update.shard.take(slot.global_rows[:, None])[:, 0].cpu()
        d = update.d.cpu()
        if optimizer.cfg.master_weights == "none":
            d = d.to(torch.bfloat16)  # exact: D was rounded to bf16 values for the step
        nonzero = d.abs().amax(dim=1) > 0  # an embedding's unseen tokens do not change
        if not bool(nonzero.all()):
            rows, d = rows[nonzero], d[nonzero]
        order = torch.argsort(rows)  # fc1's local rows are [gate_t; up_t]: two runs
        out.append(RowsUpdate(slot.name, encode_rows(rows[order]), d[order].contiguous(),
                              update.coefficient, update.seed, sk.cfg.rank, sk.cfg.projection))
    return out


def check_updates(arch: ModelArch, updates: list[RowsUpdate],
                  shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse a payload before anything is applied: unknown names, rows out of range,
    D of the wrong shape, HF tensors the receiver does not hold."""
    for u in updates:
        try:
            out_rows, in_cols = megatron_param_shape(arch, u.name)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"sketch delta for unknown weight {u.name!r}") from exc
        if u.runs.dim() != 2 or u.runs.shape[1] != 2 or bool((u.runs[:, 1] < 1).any()):
            raise ValueError(f"sketch delta {u.name}: row runs must be [k, 2] (start, length>0)")
        rows = u.rows
        if u.d.shape != (rows.numel(), u.rank):
            raise ValueError(f"sketch delta {u.name}: D {tuple(u.d.shape)} for {rows.numel()} "
                             f"rows at rank {u.rank}")
        if (u.kind == EXPLICIT) != (u.projection is not None):
            raise ValueError(f"sketch delta {u.name}: an A carried needs kind {EXPLICIT!r} "
                             f"(and kind {EXPLICIT!r} an A), got kind {u.kind!r}")
        if u.projection is not None and tuple(u.projection.shape) != (u.rank, in_cols):
            raise ValueError(f"sketch delta {u.name}: A {tuple(u.projection.shape)}, expected "
                             f"({u.rank}, {in_cols})")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= out_rows):
            raise ValueError(f"sketch delta {u.name}: rows outside [0, {out_rows})")
        for seg in row_segments(arch, u.name):
            if seg.hf_name is not None and seg.hf_name not in shapes:
                raise ValueError(f"sketch delta {u.name}: the receiver holds no {seg.hf_name}")
            if seg.hf_name is not None and shapes[seg.hf_name][-1] != in_cols:
                raise ValueError(f"sketch delta {u.name}: {seg.hf_name} has "
                                 f"{shapes[seg.hf_name][-1]} columns, the update {in_cols}")


@torch.no_grad()
def apply_updates(arch: ModelArch, weights: dict[str, torch.Tensor],
                  updates: list[RowsUpdate]) -> set[str]:
    """Apply ``updates`` in place to HF tensors ``weights`` (bf16: the trainer's SR update,
    bit-exact; fp32: the same fp32 update). Returns the HF names it changed."""
    check_updates(arch, updates, {n: tuple(t.shape) for n, t in weights.items()})
    return apply_updates_into(arch, updates, whole_tensors(weights))


@torch.no_grad()
def apply_updates_into(arch: ModelArch, updates: list[RowsUpdate], locate: Locate) -> set[str]:
    """Apply (checked) ``updates`` in place to the pieces ``locate`` finds: whole HF tensors,
    or a vLLM worker's fused, sharded parameters (``weight_sync.vllm_layout``). Each piece gets
    exactly the trainer's update of its elements: A's columns of the piece, stochastic
    rounding keyed by canonical row and global column. Returns the HF names changed."""
    touched = set()
    for u in updates:
        projections: dict[tuple[int, int], torch.Tensor] = {}
        all_rows = u.rows
        offset = 0
        for seg in row_segments(arch, u.name):
            lo, hi = offset, offset + seg.rows
            offset = hi
            if seg.hf_name is None:
                continue
            hf_rows = all_rows - lo + seg.start
            for target, p in locate(seg.hf_name):
                pick = ((all_rows >= lo) & (all_rows < hi) & (hf_rows >= p.row0)
                        & (hf_rows < p.row1)).nonzero().squeeze(1)
                if pick.numel() == 0:
                    continue
                # payloads arrive on CPU; the pieces live where the engine runs
                dev = target.device
                local = (hf_rows[pick] - p.row0 + p.local_row).to(dev)
                cols = (p.col0, p.col1)
                if cols not in projections:
                    projections[cols] = projection_block(
                        u.seed, u.rank, cols, kind=u.kind, device=dev) \
                        if u.projection is None else \
                        u.projection[:, cols[0]:cols[1]].to(dev, torch.float32)
                block, d = target[local], u.d[pick].to(dev, torch.float32)
                if block.dtype == torch.bfloat16:
                    apply_bf16_update(block, d, u.coefficient, u.seed, rank=u.rank, kind=u.kind,
                                      global_rows=all_rows[pick].to(dev), col_offset=p.col0,
                                      projection=projections[cols])
                else:
                    apply_low_rank_update(block, d, projections[cols], u.coefficient,
                                          exact=False)
                target[local] = block
                touched.add(seg.hf_name)
    return touched
