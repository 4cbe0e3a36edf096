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


def _recv_dual(module, batch, dtype) -> torch.Tensor:
    prev = parallel_state.get_pipeline_model_parallel_prev_rank()
    device = batch["tokens"].device
    primal = torch.empty(_hidden_shape(module, batch), dtype=dtype, device=device)
    tangent = torch.empty_like(primal)
    dist.recv(primal, src=prev)
    dist.recv(tangent, src=prev)
    return forward_ad.make_dual(primal, tangent)


def _send_dual(hidden: torch.Tensor) -> None:
    nxt = parallel_state.get_pipeline_model_parallel_next_rank()
    primal, tangent = forward_ad.unpack_dual(hidden)
    if tangent is None:
        tangent = torch.zeros_like(primal)
    dist.send(primal.contiguous(), dst=nxt)
    dist.send(tangent.contiguous(), dst=nxt)


@torch.no_grad()
def logits_with_tangent(model_chunks: list, batch: dict[str, torch.Tensor],
                        tangents: UpdateTangents | None
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(logits, d logits) [b, s, Vp/TP] fp32 on the last pipeline stage, None elsewhere.

    batch: tokens / position_ids / attention_mask on the model's device, the same on every
    rank of the pipeline. ``tangents`` None: the plain forward (tangent zero).
    """
    if len(model_chunks) != 1:
        raise NotImplementedError("the KL-control tangent pass needs one model chunk per "
                                  "rank (no virtual pipeline)")
    module = unwrap(model_chunks[0])
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
                module.set_input_tensor(_recv_dual(module, batch, dtype))
            out = torch.func.functional_call(
                module, duals, (batch["tokens"], batch["position_ids"], batch["attention_mask"]),
                strict=False)
            if not parallel_state.is_pipeline_last_stage():
                _send_dual(out)
                return None
            primal, tangent = forward_ad.unpack_dual(out)
            if tangent is None:
                tangent = torch.zeros_like(primal)
            return primal.float(), tangent.float()
    finally:
        module.train(was_training)
