"""What one trainer rank sends one vLLM worker in a direct-channel round, and how the
worker applies it to its live parameters. Plain torch: the sender packs, the worker
checks then applies; both are testable without any process group.

A message carries up to three kinds of content, in this order:

- blocks: rectangular copies (``transfer_plan.Block``) of values into the worker's
  parameters (a full push; the dense tensors of a sparse delta; the unsketched tensors
  that train, with a sketch delta);
- sets: (parameter, flat indices, values), the changed elements of a sparse delta;
- sketch updates: ``sketch_delta.RowsUpdate`` rows of D the worker holds, applied as
  W -= c D A(seed) to its pieces (stochastic rounding keyed by canonical row and global
  column, bit-identical to the trainer's step).

Meta: {"blocks": [(param, dst_row, rows, dst_col, cols)], "sets": [(param, count)],
"updates": [(name, rows, rank, coefficient, seed, kind)]}; tensors: [block values, set
indices (int32, or int64 past 2^31), set values, then per update its row runs (int64,
[k * 2]), its rows of D ([rows * rank]) and, for kind explicit only, A ([rank * in],
fp32)]. Every tensor travels as itself, never
pickled into the meta: the bytes of a push are its values plus a few bytes per entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from megatron_logra.weight_sync.sketch_rows import EXPLICIT, RowsUpdate, encode_rows
from megatron_logra.weight_sync.transfer_plan import Block, worker_rows


@dataclass
class Outbox:
    """One message being packed for one worker (sender side)."""

    blocks: list[tuple] = field(default_factory=list)
    block_values: list[torch.Tensor] = field(default_factory=list)
    sets: list[tuple[str, int]] = field(default_factory=list)
    set_indices: list[torch.Tensor] = field(default_factory=list)
    set_values: list[torch.Tensor] = field(default_factory=list)
    updates: list = field(default_factory=list)

    def add_block(self, block: Block, shard: torch.Tensor) -> None:
        """Copy ``block`` of the sender's local ``shard`` (engine dtype)."""
        piece = shard[block.src_row:block.src_row + block.rows]
        if block.cols is not None:
            piece = piece[:, block.src_col:block.src_col + block.cols]
        self.blocks.append((block.param, block.dst_row, block.rows, block.dst_col, block.cols))
        self.block_values.append(piece.reshape(-1))

    def add_set(self, param: str, indices: torch.Tensor, values: torch.Tensor) -> None:
        """Set flat elements ``indices`` [k] of the worker's ``param`` to ``values`` [k]."""
        if indices.numel():
            self.sets.append((param, indices.numel()))
            self.set_indices.append(indices.to(torch.int64))
            self.set_values.append(values)

    @property
    def empty(self) -> bool:
        return not (self.blocks or self.sets or self.updates)

    def pack(self, dtype: torch.dtype, device: torch.device) -> tuple[dict, list[torch.Tensor]]:
        """(meta, tensors on ``device``) of the message; indices in int32 when they fit."""
        def cat(parts, kind):
            return (torch.cat(parts) if parts else torch.zeros(0, dtype=kind)).to(device)

        indices = cat(self.set_indices, torch.int64)
        if indices.numel() and int(indices.max()) < 2**31:
            indices = indices.to(torch.int32)
        meta = {"blocks": self.blocks, "sets": self.sets,
                "updates": [(u.name, u.d.shape[0], u.d.shape[1], u.coefficient, u.seed, u.kind)
                            for u in self.updates]}
        tensors = [cat(self.block_values, dtype), indices, cat(self.set_values, dtype)]
        for u in self.updates:
            tensors += [u.runs.reshape(-1).to(device), u.d.reshape(-1).to(device)]
            if u.projection is not None:
                tensors.append(u.projection.reshape(-1).to(device, torch.float32))
        return meta, tensors


def add_updates(boxes: list[Outbox], arch, updates: list[RowsUpdate]) -> None:
    """Each sketch update's rows into the outbox of every worker holding them (``boxes``:
    one per engine TP rank); an A carried goes whole to each of them."""
    for u in updates:
        rows = u.rows
        for worker, mask in enumerate(worker_rows(arch, u.name, rows, len(boxes))):
            if bool(mask.any()):
                boxes[worker].updates.append(replace(u, runs=encode_rows(rows[mask]),
                                                     d=u.d[mask].contiguous()))


def received_updates(meta: dict, tensors: list[torch.Tensor]) -> list[RowsUpdate]:
    """The sketch updates of a received message, rebuilt from its meta and tensors."""
    rest = tensors[3:]
    expected = sum(3 if kind == EXPLICIT else 2 for *_, kind in meta["updates"])
    if len(rest) != expected:
        raise ValueError(f"direct push: {len(rest)} update tensors for "
                         f"{len(meta['updates'])} sketch updates")
    out, at = [], 0
    for name, rows, rank, coefficient, seed, kind in meta["updates"]:
        runs, d = rest[at], rest[at + 1]
        projection = rest[at + 2] if kind == EXPLICIT else None
        at += 2 if projection is None else 3
        if runs.numel() % 2 or d.numel() != rows * rank or (
                projection is not None and projection.numel() % rank):
            raise ValueError(f"direct push: the sketch update of {name} holds "
                             f"{d.numel()} values for {rows} x {rank}")
        out.append(RowsUpdate(name, runs.view(-1, 2).cpu(), d.view(rows, rank), coefficient,
                              seed, rank, kind,
                              None if projection is None else projection.view(rank, -1)))
    return out


def check_message(meta: dict, tensors: list[torch.Tensor],
                  params: dict[str, torch.Tensor]) -> None:
    """Refuse (ValueError) a message that does not fit the worker's parameters, before
    any of it is applied."""
    values, indices, set_values = tensors[:3]
    expected = 0
    for param, row, rows, col, cols in meta["blocks"]:
        target = _param(params, param)
        if target.numel() == 0:
            raise ValueError(f"direct push: {param} holds no live tensor (vLLM-CPU packs its "
                             f"linear weights for oneDNN and empties them): start the server "
                             f"with MLOGRA_LIVE_WEIGHTS=1 in its environment")
        fits = row >= 0 and rows > 0 and row + rows <= target.shape[0] and (
            cols is None if target.dim() == 1 else
            cols is not None and col >= 0 and col + cols <= target.shape[1])
        if not fits:
            raise ValueError(f"direct push: block rows {row}+{rows} cols {col}+{cols} outside "
                             f"{param} {tuple(target.shape)}")
        expected += rows * (cols or 1)
    if values.numel() != expected:
        raise ValueError(f"direct push: {values.numel()} block values for {expected} elements")
    if sum(n for _, n in meta["sets"]) != indices.numel() or indices.numel() != set_values.numel():
        raise ValueError("direct push: set indices and values do not match their counts")
    start = 0
    for param, n in meta["sets"]:
        part = indices[start:start + n]
        start += n
        numel = _param(params, param).numel()
        if n and (int(part.min()) < 0 or int(part.max()) >= numel):
            raise ValueError(f"direct push: an index outside {param} ({numel} elements)")
    dtypes = {t.dtype for t in params.values()}
    for t in (values, set_values):
        if t.numel() and t.dtype not in dtypes:
            raise ValueError(f"direct push: values in {t.dtype}, the engine holds {dtypes}")


@torch.no_grad()
def apply_message(meta: dict, tensors: list[torch.Tensor], params: dict[str, torch.Tensor],
                  apply_updates=None) -> None:
    """Apply a checked message in place to ``params`` (the worker's live parameters by
    vLLM name); ``apply_updates(updates)`` applies its sketch updates (the worker's
    ``sketch_delta.apply_updates_into`` over its own pieces)."""
    values, indices, set_values = tensors[:3]
    start = 0
    for param, row, rows, col, cols in meta["blocks"]:
        target = params[param]
        n = rows * (cols or 1)
        piece = values[start:start + n].to(target.device)
        start += n
        if cols is None:
            target[row:row + rows].copy_(piece)
        else:
            target[row:row + rows, col:col + cols].copy_(piece.view(rows, cols))
    start = 0
    for param, n in meta["sets"]:
        target = params[param]
        flat = target.view(-1)
        flat[indices[start:start + n].to(target.device, torch.int64)] = set_values[
            start:start + n].to(target.device)
        start += n
    if meta["updates"]:
        apply_updates(received_updates(meta, tensors))


def _param(params: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in params:
        raise ValueError(f"direct push: the engine has no parameter {name!r}")
    return params[name]
