"""The tangent a LoGRA update puts on a sketched layer's output, for forward-mode AD.

The update W -= c D A has weight tangent dW = -c D A (out x in), which is never formed:
for Y = X W^T the output tangent it adds is  dY = X dW^T = -(X A^T) (c D)^T, an
[..., r] then [..., out] product. Under ``active(tangents)`` each sketched weight's
``LowRankTangent`` sits on its ``SketchSlot.tangent``; the sketched layers
(``logra/sketched_linear``) find it there and call ``add_to_output`` /
``add_to_lookup`` on their (dual) outputs. Outside ``active`` the slots hold None and
the layers do nothing. ``logra/`` never imports this module: a layer only calls the
methods of the object on its slot.

Tensor parallel: a column-parallel rank holds rows of W, D and of dY (local); a
row-parallel rank holds columns of W and of A, so X_local A_local^T is a partial sum,
reduced over TP by the layer's own all-reduce (whose jvp reduces the tangent too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd import forward_ad


@dataclass(frozen=True)
class LowRankTangent:
    """dW = -coefficient D A on this rank: d [out_local, r], projection A [r, in_local]."""

    coefficient: float
    d: torch.Tensor
    projection: torch.Tensor

    def output_tangent(self, x: torch.Tensor) -> torch.Tensor:
        """-(X A^T) (c D)^T: x [..., in_local] -> [..., out_local] (x's dtype)."""
        xa = torch.matmul(x.float(), self.projection.t().float())
        return torch.matmul(xa, self.d.t().float()).mul_(-self.coefficient).to(x.dtype)

    def lookup_tangent(self, ids: torch.Tensor) -> torch.Tensor:
        """An embedding's rows: -(c D[ids]) A, ids [...] local rows -> [..., h] fp32."""
        return torch.matmul(self.d[ids].float(), self.projection.float()).mul_(-self.coefficient)

    def add_to_output(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """A linear's output ``out`` (dual) with X dW^T added to its tangent; ``x`` is the
        layer's input (dual or plain: its primal is used)."""
        return add_tangent(out, self.output_tangent(primal_of(x)))

    def add_to_lookup(self, out: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None,
                      tp_group) -> torch.Tensor:
        """An embedding's output ``out`` [b, s, h] with -(c D[ids]) A added to its tangent.
        ids: this rank's local rows; mask (None without TP): True where the id is another
        TP rank's (zero here), the tangent then summed over ``tp_group``."""
        extra = self.lookup_tangent(ids)
        if mask is not None:
            extra = extra.masked_fill(mask[..., None], 0.0)
            dist.all_reduce(extra, group=tp_group)
        return add_tangent(out, extra)  # [b, s, h], as the lookup


def low_rank_tangents(slots: Iterable, coefficient: float) -> dict:
    """SketchSlot -> its update's tangent -c D A; each slot's ``sketch`` holds D (all rows,
    after ``LograOptimizer.gather_directions``) and ``projection`` A."""
    return {slot: LowRankTangent(coefficient, slot.sketch, slot.projection) for slot in slots}


@contextlib.contextmanager
def active(tangents: Mapping):
    """Put each tangent on its slot (``SketchSlot.tangent``) for the duration of the
    forward-mode pass; every slot is cleared again on exit."""
    try:
        for slot, tangent in tangents.items():
            slot.tangent = tangent
        yield
    finally:
        for slot in tangents:
            slot.tangent = None


def add_tangent(y: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """y with ``extra`` added to its forward-mode tangent (y's primal unchanged)."""
    primal, tangent = forward_ad.unpack_dual(y)
    extra = extra.to(primal.dtype)
    return forward_ad.make_dual(primal, extra if tangent is None else tangent + extra)


def primal_of(x: torch.Tensor) -> torch.Tensor:
    return forward_ad.unpack_dual(x).primal
