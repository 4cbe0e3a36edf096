"""Sparse-delta weight sync: only the engine-dtype elements that changed since the last sync.

Each parameter's sender (the rank that assembles it for a full push) keeps the HF
tensors it last sent, in the engine's dtype (its "shadow": one engine-dtype copy of
the parameters it sends). A sync compares the new engine-dtype values with the shadow
bit for bit and sends (flat indices, values) of the elements that differ: exact by
construction, for any optimizer and any layout. In bf16 most elements of a small
update do not change at all (the step is under half a bf16 ulp), which is what makes
the payload small. A tensor where so many elements changed that indices + values
would outweigh the values alone goes dense (all its values, no indices), so a sparse
delta is never larger than a full push (plus names).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_logra.bridge.vllm_layout import Locate, whole_tensors

BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
"""The integer dtype of each float dtype's width: comparing values bit for bit."""


@dataclass(frozen=True)
class SparseDelta:
    """tensor.view(-1)[indices] = values for HF tensor ``name`` (dense: all values)."""

    name: str
    shape: tuple[int, ...]
    indices: torch.Tensor  # [k] int32 (int64 past 2^31 elements), ascending; [0] when dense
    values: torch.Tensor  # [k] engine dtype; [numel] when dense
    dense: bool = False

    def nbytes(self) -> int:
        return (self.indices.numel() * self.indices.element_size()
                + self.values.numel() * self.values.element_size() + 8 + len(self.name))


def changed_elements(name: str, new: torch.Tensor, shadow: torch.Tensor) -> SparseDelta:
    """The elements of ``new`` whose bits differ from ``shadow`` (same shape and dtype); the
    shadow is updated to ``new``."""
    if new.shape != shadow.shape or new.dtype != shadow.dtype:
        raise ValueError(f"sparse delta {name}: {tuple(new.shape)} {new.dtype} vs the last "
                         f"sync's {tuple(shadow.shape)} {shadow.dtype}")
    bits = BITS[new.dtype]
    flat_new, flat_old = new.reshape(-1), shadow.reshape(-1)
    idx = (flat_new.view(bits) != flat_old.view(bits)).nonzero().squeeze(1)
    index_dtype = torch.int32 if new.numel() < 2**31 else torch.int64
    item = torch.empty((), dtype=new.dtype).element_size()
    index_size = torch.empty((), dtype=index_dtype).element_size()
    if idx.numel() * (index_size + item) >= new.numel() * item:  # denser than the tensor
        flat_old.copy_(flat_new)
        return SparseDelta(name, tuple(new.shape), torch.zeros(0, dtype=index_dtype),
                           flat_new.clone(), dense=True)
    values = flat_new[idx].clone()
    flat_old[idx] = values
    return SparseDelta(name, tuple(new.shape), idx.to(index_dtype), values)


def check_deltas(deltas: list[SparseDelta], held: dict[str, torch.Tensor]) -> None:
    """Refuse a payload before anything is applied (unknown tensor, shape, dtype, index)."""
    for d in deltas:
        t = held.get(d.name)
        if t is None or tuple(t.shape) != d.shape:
            raise ValueError(f"sparse delta for {d.name} {d.shape}: the receiver holds "
                             f"{None if t is None else tuple(t.shape)}")
        want = (t.numel(),) if d.dense else tuple(d.indices.shape)
        if d.values.dtype != t.dtype or tuple(d.values.shape) != want:
            raise ValueError(f"sparse delta {d.name}: values {d.values.dtype} "
                             f"{tuple(d.values.shape)} for {t.dtype} and {d.indices.numel()} "
                             f"indices")
        if d.indices.numel() and (int(d.indices.min()) < 0 or int(d.indices.max()) >= t.numel()):
            raise ValueError(f"sparse delta {d.name}: index outside [0, {t.numel()})")


def apply_deltas(deltas: list[SparseDelta], held: dict[str, torch.Tensor]) -> set[str]:
    """Apply in place (after checking all of them); returns the tensors that changed."""
    check_deltas(deltas, held)
    return apply_deltas_into(deltas, whole_tensors(held))


@torch.no_grad()
def apply_deltas_into(deltas: list[SparseDelta], locate: Locate) -> set[str]:
    """Apply (checked) ``deltas`` to the pieces ``locate`` finds (whole HF tensors, or a
    vLLM worker's shards): each piece takes the changed elements inside it."""
    for d in deltas:
        cols = d.shape[1] if len(d.shape) == 2 else 1
        if d.dense:
            index = None
        else:
            index = d.indices.long()
            rows, columns = index // cols, index % cols
        for target, p in locate(d.name):
            if d.dense:
                full = d.values.view(d.shape)
                piece = full[p.row0:p.row1] if p.col0 is None else full[p.row0:p.row1,
                                                                        p.col0:p.col1]
                target[p.local_row:p.local_row + p.row1 - p.row0].copy_(piece)
                continue
            inside = (rows >= p.row0) & (rows < p.row1)
            if p.col0 is not None:
                inside &= (columns >= p.col0) & (columns < p.col1)
            pick = inside.nonzero().squeeze(1)
            dev = target.device  # payloads arrive on CPU
            local, values = (rows[pick] - p.row0 + p.local_row).to(dev), d.values[pick].to(dev)
            if p.col0 is None:
                target[local] = values
            else:
                target[local, (columns[pick] - p.col0).to(dev)] = values
    return {d.name for d in deltas if d.dense or d.indices.numel()}
