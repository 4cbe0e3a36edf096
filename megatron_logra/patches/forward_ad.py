"""Patch: forward-mode AD (``jvp``) for the megatron-core autograd Functions on a GPT forward
(megatron-core 0.16.x).

What it adds: a ``jvp`` staticmethod to the TP mappings (copy, reduce, scatter, gather),
the two linear Functions (``LinearWithGradAccumulationAndAsyncCommunication``,
``LinearWithFrozenWeight``) and ``MakeViewlessTensor``; their forwards are wrapped to keep
the primal inputs on ``ctx`` while a forward-AD level is active (only then). Why: the
predicted-KL controller takes the tangent of the logits along the update with
``torch.autograd.forward_ad``; megatron's Functions define only ``backward``, so forward AD
stops at the first one.

Why results stay identical: ``forward`` and ``backward`` are untouched (the wrapper
calls the original forward with the same arguments and, outside forward AD, does
nothing else). Each jvp is the linearisation of its forward: a mapping applies the same
communication to the tangent; a linear gives dX W^T + X dW^T + db. Sequence parallel is
not supported in the tangent pass (an error names it).

Supported: megatron-core 0.16.x (checked against 0.16.1); another version is refused
(``runtime.versions``).
"""

from __future__ import annotations

import functools

import torch
from torch.autograd import forward_ad

from megatron_logra.runtime import versions

def _forward_ad_active() -> bool:
    return forward_ad._current_level >= 0


def _keeping_primals(forward, count: int):
    """Wrap a Function's forward to put its first ``count`` inputs on ctx under forward AD."""

    @functools.wraps(forward)
    def wrapped(ctx, *args):
        if _forward_ad_active():
            ctx.mlogra_primals = args[:count]
        return forward(ctx, *args)

    return wrapped


def _linear_jvp(x, weight, bias, x_t, weight_t, bias_t):
    """Tangent of X W^T + b: dX W^T + X dW^T + db (None terms skipped)."""
    out = None
    if x_t is not None:
        out = torch.matmul(x_t, weight.t())
    if weight_t is not None:
        term = torch.matmul(x, weight_t.t())
        out = term if out is None else out + term
    if bias_t is not None:
        out = bias_t.expand(*x.shape[:-1], bias_t.shape[-1]) if out is None else out + bias_t
    if out is None:
        return torch.zeros(*x.shape[:-1], weight.shape[0], dtype=x.dtype, device=x.device)
    return out


@versions.patch_once("megatron_logra.patches.forward_ad")
def apply() -> None:
    from megatron.core import utils
    from megatron.core.tensor_parallel import layers, mappings

    def _communicating(op):
        """A mapping's jvp: the forward's communication applied to the tangent, the same
        way (the reduce is in place and returns its input, the split returns a slice);
        autograd wants a view back where the forward returned its input."""
        def jvp(ctx, x_t, _group):
            out = op(x_t, ctx.mlogra_primals[1])
            return out.view_as(out) if out is x_t else out
        return jvp

    def copy_jvp(ctx, x_t, _group):
        return x_t.view_as(x_t)

    reduce_jvp = _communicating(mappings._reduce)
    scatter_jvp = _communicating(mappings._split_along_last_dim)
    gather_jvp = _communicating(mappings._gather_along_last_dim)

    for cls, jvp in ((mappings._CopyToModelParallelRegion, copy_jvp),
                     (mappings._ReduceFromModelParallelRegion, reduce_jvp),
                     (mappings._ScatterToModelParallelRegion, scatter_jvp),
                     (mappings._GatherFromModelParallelRegion, gather_jvp)):
        cls.forward = staticmethod(_keeping_primals(cls.forward, 2))
        cls.jvp = staticmethod(jvp)

    def accumulating_linear_jvp(ctx, x_t, weight_t, bias_t, *_):
        x, weight, bias, _fusion, _allreduce, sequence_parallel = ctx.mlogra_primals
        if sequence_parallel:
            raise NotImplementedError("the KL-control tangent pass does not support "
                                      "--sequence-parallel")
        return _linear_jvp(x, weight, bias, x_t, weight_t, bias_t)

    def frozen_linear_jvp(ctx, x_t, weight_t, bias_t, *_):
        x, weight, bias = ctx.mlogra_primals
        return _linear_jvp(x, weight, bias, x_t, weight_t, bias_t)

    accumulating = layers.LinearWithGradAccumulationAndAsyncCommunication
    accumulating.forward = staticmethod(_keeping_primals(accumulating.forward, 6))
    accumulating.jvp = staticmethod(accumulating_linear_jvp)
    frozen = layers.LinearWithFrozenWeight
    frozen.forward = staticmethod(_keeping_primals(frozen.forward, 3))
    frozen.jvp = staticmethod(frozen_linear_jvp)
    utils.MakeViewlessTensor.jvp = staticmethod(lambda ctx, x_t, _requires_grad: x_t)
