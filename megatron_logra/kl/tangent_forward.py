"""The logits and their forward-mode tangent along an update, through TP and PP.

``UpdateTangents`` is one update's direction on this rank: a tangent per dense param
(the megatron optimizer's step, in the model's layout) and a ``LowRankTangent`` per
sketched weight (-c D A, never formed), keyed by its ``SketchSlot``.
``logits_with_tangent`` runs one forward of this rank's model chunk with
``torch.autograd.forward_ad``: dense params enter as dual tensors, sketched layers find
their tangent on their slot (``weight_tangent.active``) and add -(X A^T)(c D)^T to
their outputs, megatron's TP Functions carry the tangent through their communication
(``patches/forward_ad``). Pipeline stages run in order; each sends its hidden state
[s, b, h] and that state's tangent to the next stage. The probe is small, so there is
no microbatch interleaving.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch.autograd import forward_ad

from megatron_logra.kl import weight_tangent
from megatron_logra.kl.weight_tangent import LowRankTangent
from megatron_logra.logra.sketched_linear import SketchSlot
from megatron_logra.model.provider import unwrap


@dataclass
class UpdateTangents:
    dense: dict[str, torch.Tensor] = field(default_factory=dict)  # param name -> tangent
    low_rank: dict[SketchSlot, LowRankTangent] = field(default_factory=dict)


def _hidden_shape(module, batch: dict[str, torch.Tensor]) -> tuple[int, int, int]:
    b, s = batch["tokens"].shape
    return s, b, module.config.hidden_size


def _recv_hidden(module, batch, dtype, dual: bool) -> torch.Tensor:
    """The previous stage's hidden state [s, b, h] (and its tangent, made a dual, when
    ``dual``)."""
    prev = parallel_state.get_pipeline_model_parallel_prev_rank()
    device = batch["tokens"].device
    primal = torch.empty(_hidden_shape(module, batch), dtype=dtype, device=device)
    dist.recv(primal, src=prev)
    if not dual:
        return primal
    tangent = torch.empty_like(primal)
    dist.recv(tangent, src=prev)
    return forward_ad.make_dual(primal, tangent)


def _send_hidden(hidden: torch.Tensor, dual: bool) -> None:
    """This stage's hidden state to the next (and its tangent, zeros if it has none, when
    ``dual``)."""
    nxt = parallel_state.get_pipeline_model_parallel_next_rank()
    primal, tangent = forward_ad.unpack_dual(hidden)
    dist.send(primal.contiguous(), dst=nxt)
    if dual:
        dist.send((torch.zeros_like(primal) if tangent is None else tangent).contiguous(),
                  dst=nxt)


@torch.no_grad()
def logits_with_tangent(model_chunks: list, batch: dict[str, torch.Tensor],
                        tangents: UpdateTangents | None
                        ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(logits, d logits) [b, s, Vp/TP] in the model's dtype on the last pipeline stage,
    None elsewhere (the callers take the rows they need and compute in fp64 a chunk at a
    time: an fp32 copy of the whole probe's logits and tangent, 16 bytes per vocabulary
    entry and position, would be most of the pass's memory).

    batch: tokens / position_ids / attention_mask on the model's device, the same on every
    rank of the pipeline. ``tangents`` None (on every rank): the plain forward, whose
    stages pass hidden states without tangents; d logits is None.
    """
    if len(model_chunks) != 1:
        raise NotImplementedError("the KL-control tangent pass needs one model chunk per "
                                  "rank (no virtual pipeline)")
    module = unwrap(model_chunks[0])
    dual = tangents is not None
    tangents = tangents or UpdateTangents()
    # what the previous stage sends: megatron's pipeline dtype (its activations'), not a
    # parameter's (the first of a later stage is a norm weight, kept in fp32)
    dtype = module.config.pipeline_dtype
    was_training = module.training
    module.eval()
    try:
        with forward_ad.dual_level(), weight_tangent.active(tangents.low_rank):
            params = dict(module.named_parameters())
            unknown = sorted(set(tangents.dense) - set(params))
            if unknown:
                raise KeyError(f"tangents for params the model does not have: {unknown[:3]}")
            duals = {n: forward_ad.make_dual(params[n].detach(), t.to(params[n].dtype))
                     for n, t in tangents.dense.items()}
            if not parallel_state.is_pipeline_first_stage():
                module.set_input_tensor(_recv_hidden(module, batch, dtype, dual))
            out = torch.func.functional_call(
                module, duals, (batch["tokens"], batch["position_ids"], batch["attention_mask"]),
                strict=False)
            if not parallel_state.is_pipeline_last_stage():
                _send_hidden(out, dual)
                return None
            primal, tangent = forward_ad.unpack_dual(out)
            if not dual:
                return primal, None
            return primal, torch.zeros_like(primal) if tangent is None else tangent
    finally:
        module.set_input_tensor(None)  # the received state is this pass's, not the model's
        module.train(was_training)
