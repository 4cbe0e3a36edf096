"""The tangent a LoGRA update puts on a sketched layer's output, for forward-mode AD.

The update W -= c D A has weight tangent dW = -c D A (out x in), which is never formed:
for Y = X W^T the output tangent it adds is  dY = X dW^T = -(X A^T) (c D)^T, an
[..., r] then [..., out] product. Under ``active(tangents)`` the sketched layers add
this term to their (dual) outputs; outside it they do nothing.

Tensor parallel: a column-parallel rank holds rows of W, D and of dY (local); a
row-parallel rank holds columns of W and of A, so X_local A_local^T is a partial sum,
reduced over TP by the layer's own all-reduce (whose jvp reduces the tangent too).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
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


_ACTIVE: dict[int, LowRankTangent] = {}


@contextlib.contextmanager
def active(tangents: dict[int, LowRankTangent]):
    """Make ``tangents`` (keyed by ``id(slot)`` of a ``SketchSlot``) visible to the layers."""
    _ACTIVE.clear()
    _ACTIVE.update(tangents)
    try:
        yield
    finally:
        _ACTIVE.clear()


def tangent_of(slot) -> LowRankTangent | None:
    return _ACTIVE.get(id(slot)) if _ACTIVE else None


def add_tangent(y: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """y with ``extra`` added to its forward-mode tangent (y's primal unchanged)."""
    primal, tangent = forward_ad.unpack_dual(y)
    extra = extra.to(primal.dtype)
    return forward_ad.make_dual(primal, extra if tangent is None else tangent + extra)


def primal_of(x: torch.Tensor) -> torch.Tensor:
    return forward_ad.unpack_dual(x).primal
