"""Column/RowParallelLinear whose backward accumulates S += dY^T (X A^T), never G = dY^T X.

The layers are megatron-core's, with one override: ``_forward_impl`` (the matmul
megatron calls between its TP communication) runs ``_SketchedMatmul`` when the
weight carries a ``logra_slot`` with a projection. Forward: Y = X W^T (+ b), and
X A^T [N, r] is saved instead of X. Backward: dX = dY W (all-reduced over TP when
megatron asks for it), S += dY^T (X A^T) (the product in the activations' dtype, the
sum in fp32), db = sum dY. The weight has
``requires_grad=False``, so DDP gives it no grad buffer and autograd no ``.grad``.

Tensor parallel: a column-parallel rank holds rows of W, so its S rows are the
global S rows (local). A row-parallel rank holds columns c0:c1 of W and multiplies
its input slice by A[:, c0:c1]; its S is a partial sum, reduced over the TP group
once per update (``SketchSet.reduce``), which equals the TP=1 sketch.

megatron-core internals touched (0.16.x, checked against 0.16.1; another version is
refused by ``runtime.versions`` when the layers are built):
- ``ColumnParallelLinear._forward_impl`` / ``RowParallelLinear._forward_impl``:
  overridden in subclasses. Replaces the local matmul between megatron's own TP
  communication (which stays megatron's); a weight without a slot, or with no grad
  enabled, runs megatron's matmul unchanged, so outputs are megatron's bit for bit.
- ``VocabParallelEmbedding.forward``: overridden; the masked lookup and TP all-reduce
  are megatron's, restated. Reads ``vocab_start_index``, ``vocab_end_index``,
  ``reduce_scatter_embeddings`` and ``tp_group``.
- ``__class__`` of the built embedding and output layer (``sketch_embedding_and_output``):
  they are built by ``GPTModel`` outside the layer spec, so their class is swapped for
  the sketched subclass, which adds no state (nothing to re-initialise or save).
- ``weight.logra_slot``: an attribute hung on each sketched weight (``SketchSet``),
  read only by these layers; megatron never looks at it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from megatron_logra.logra.config import TARGETS
from megatron_logra.model.provider import replace_linears
from megatron_logra.runtime import versions


@dataclass(eq=False)
class SketchSlot:
    """One sketched weight's LoGRA state on this rank (mutable: refreshed every update;
    compared and hashed by identity, so a slot can key a dict)."""

    name: str  # canonical, layout-independent (global layer index), e.g. decoder.layers.3.mlp.linear_fc2.weight
    parallel: str  # "column" (rows split over TP) | "row" (columns split over TP)
    global_rows: torch.Tensor  # [out_local] canonical row index of each local row (int64)
    col_offset: int  # global index of this rank's first input column
    module_rows: torch.Tensor  # [out_local] int64: the HF module (index into module_names) of each row
    module_names: tuple[str, ...]  # HF tensors the weight fuses (q, k, v; gate, up; one)
    sketch: torch.Tensor  # [out_local, r] fp32 accumulator S
    projection: torch.Tensor | None = None  # [r, in_local] this rank's columns of A
    duplicate: bool = False  # the last stage's copy of a tied embedding (PP > 1)
    gated_halves: bool = False  # a gated fc1: local rows are [gate_t; up_t]
    tangent: object | None = None  # the KL controller's forward-mode tangent of this
    # weight's update, set only during that pass (its add_to_output / add_to_lookup)


class _SketchedMatmul(torch.autograd.Function):
    """Y = X W^T (+ b); saves X A^T [..., r] in X's dtype; backward adds dY^T (X A^T) to the
    fp32 sketch. Both products run in the activations' dtype (bf16 in a bf16 model: the
    reference's ``_AccumulateSketch`` computes ``gradient.T @ projected`` in bf16 and adds
    it to its fp32 sketch, as here), so the saved X A^T costs 2 r bytes per token."""

    @staticmethod
    def forward(ctx, x, weight, bias, projection, sketch, allreduce_dgrad, tp_group):
        """x [..., in_local], weight [out_local, in_local], projection [r, in_local]."""
        out = torch.matmul(x, weight.t())
        if bias is not None:
            out = out + bias
        xa = torch.matmul(x, projection.t().to(x.dtype))  # [..., r]
        ctx.save_for_backward(weight, xa)
        ctx.sketch, ctx.has_bias = sketch, bias is not None
        ctx.allreduce_dgrad, ctx.tp_group = allreduce_dgrad, tp_group
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weight, xa = ctx.saved_tensors
        grad_input = torch.matmul(grad_out, weight)
        handle = None
        if ctx.allreduce_dgrad:
            handle = dist.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        xa = xa.reshape(-1, xa.shape[-1]).to(dy.dtype)
        if dy.dtype == torch.float32:
            ctx.sketch.addmm_(dy.t(), xa)
        else:
            ctx.sketch.add_(dy.t() @ xa)  # bf16 product, fp32 accumulation across microbatches
        grad_bias = dy.float().sum(0).to(grad_out.dtype) if ctx.has_bias else None
        if handle is not None:
            handle.wait()
        return grad_input, None, grad_bias, None, None, None, None


class _SketchedLookup(torch.autograd.Function):
    """Embedding lookup whose backward adds dY A^T into the rows of the looked-up ids:
    S = G A^T with G = sum_t e_{id_t} dY_t^T, never forming G (V x hidden)."""

    @staticmethod
    def forward(ctx, ids, weight, projection, sketch, mask, anchor):
        """ids [b, s] local row ids, weight [V_local, h], mask [b, s] (True: another rank's id)."""
        out = F.embedding(ids, weight)
        if mask is not None:
            out = out.masked_fill(mask[..., None], 0.0)
        ctx.save_for_backward(ids, projection, mask if mask is not None else ids.new_empty(0))
        ctx.sketch, ctx.has_mask = sketch, mask is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        ids, projection, mask = ctx.saved_tensors
        dya = grad_out.reshape(-1, grad_out.shape[-1]).float() @ projection.t().float()
        if ctx.has_mask:
            dya = dya.masked_fill(mask.reshape(-1, 1), 0.0)
        ctx.sketch.index_add_(0, ids.reshape(-1), dya)
        return None, None, None, None, None, None


class SketchedVocabParallelEmbedding(VocabParallelEmbedding):
    """VocabParallelEmbedding with a sketched weight gradient (no sequence parallel)."""

    logra_parallel = "column"  # vocab rows are split over TP

    def forward(self, input_):
        slot: SketchSlot | None = getattr(self.weight, "logra_slot", None)
        tangent = slot.tangent if slot is not None else None
        if tangent is not None:  # forward-mode pass of the KL controller
            return self._forward_with_tangent(input_, tangent)
        if slot is None or slot.projection is None or not torch.is_grad_enabled():
            return super().forward(input_)
        if self.reduce_scatter_embeddings:
            raise NotImplementedError("LoGRA's sketched embedding does not support sequence "
                                      "parallel")
        mask = None
        if self.tp_group.size() > 1:
            mask = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            input_ = (input_ - self.vocab_start_index).masked_fill(mask, 0)
        if not hasattr(self, "_logra_anchor"):  # makes autograd call the backward (ids and
            self._logra_anchor = torch.zeros((), requires_grad=True)  # weight need no grad)
        out = _SketchedLookup.apply(input_, self.weight, slot.projection, slot.sketch, mask,
                                    self._logra_anchor)
        return reduce_from_tensor_model_parallel_region(out, group=self.tp_group)

    def _forward_with_tangent(self, input_, tangent):
        """megatron's lookup plus the update's tangent -(c D[ids]) A, reduced over TP
        (``tangent.add_to_lookup``: the object the KL controller put on the slot)."""
        if self.reduce_scatter_embeddings:
            raise NotImplementedError("the KL-control tangent pass does not support sequence "
                                      "parallel")
        out = super().forward(input_)
        ids, mask = input_, None
        if self.tp_group.size() > 1:
            mask = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            ids = (input_ - self.vocab_start_index).masked_fill(mask, 0)
        return tangent.add_to_lookup(out, ids, mask, self.tp_group)  # [b, s, h]


class _SketchedMatmulMixin:
    """Overrides megatron's ``_forward_impl`` (the matmul between its TP communication):
    the sketched matmul while the weight's slot has a projection and grad is enabled,
    megatron's own otherwise (eval, forward-only schedules)."""

    def _forward_impl(self, input, weight, *args, bias=None, allreduce_dgrad=False,
                      tp_group=None, **kwargs):
        slot: SketchSlot | None = getattr(weight, "logra_slot", None)
        if slot is None or slot.projection is None or not torch.is_grad_enabled():
            out = super()._forward_impl(input, weight, *args, bias=bias,
                                        allreduce_dgrad=allreduce_dgrad, tp_group=tp_group,
                                        **kwargs)
            tangent = slot.tangent if slot is not None else None
            if tangent is not None:  # the KL controller's forward-mode pass: + X dW^T
                out = tangent.add_to_output(out, input)
            return out
        return _SketchedMatmul.apply(input, weight, bias, slot.projection, slot.sketch,
                                     allreduce_dgrad, tp_group)


class SketchedColumnParallelLinear(_SketchedMatmulMixin, ColumnParallelLinear):
    """ColumnParallelLinear (qkv, fc1, output layer) with a sketched weight gradient."""

    logra_parallel = "column"


class SketchedRowParallelLinear(_SketchedMatmulMixin, RowParallelLinear):
    """RowParallelLinear (attention proj, fc2) with a sketched weight gradient."""

    logra_parallel = "row"


SKETCHED_TYPES = (SketchedColumnParallelLinear, SketchedRowParallelLinear)


def sketch_embedding_and_output(model, targets: tuple[str, ...]) -> None:
    """Swap the classes of ``model``'s embedding / output layer for their sketched versions
    (built outside the layer spec; the subclasses add no state, so the swap is safe)."""
    versions.require("megatron-core", "megatron_logra.logra.sketched_linear")
    tied = model.share_embeddings_and_output_weights
    want_emb = "embedding" in targets or (tied and "output" in targets)
    want_out = "output" in targets or (tied and "embedding" in targets)
    if want_emb and model.pre_process:
        model.embedding.word_embeddings.__class__ = SketchedVocabParallelEmbedding
    if want_out and model.post_process:
        model.output_layer.__class__ = SketchedColumnParallelLinear


def sketched_layer_spec(spec, targets: tuple[str, ...] = TARGETS):
    """The local GPT layer spec with the chosen linears replaced by their sketched versions
    (``targets``: ``LograConfig.targets``, checked there)."""
    versions.require("megatron-core", "megatron_logra.logra.sketched_linear")
    return replace_linears(spec, targets, SketchedColumnParallelLinear,
                           SketchedRowParallelLinear)
