"""An optimizer step whose size is chosen from its own direction (predicted-KL control).

``scaled_optimizer_step(optimizer, model, choose_alpha)``:
1. megatron's step of the dense params (if any), held back (``HeldBackStep``): their update
   becomes the dense tangent and the model is returned to the old weights;
2. LoGRA: the RowAdam directions D and the factor c are computed, and the sketched
   weights' tangents are -c D A (low rank);
3. ``alpha = choose_alpha(tangents)`` (a forward-mode pass at the old weights);
4. the update is applied scaled by alpha: old + alpha (new - old) for the dense params,
   W -= alpha c D A for the sketched ones.
Dense Adam is the same without step 2.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_logra.kl.held_back_step import HeldBackStep
from megatron_logra.kl.tangent_forward import UpdateTangents
from megatron_logra.kl.weight_tangent import low_rank_tangents
from megatron_logra.logra.optimizer import LograOptimizer
from megatron_logra.model.provider import unwrap

ChooseAlpha = Callable[[UpdateTangents], float]


def stepped_params(model_chunks: list) -> dict:
    """The params the megatron optimizer steps (those requiring grad), by module name."""
    if len(model_chunks) != 1:
        raise NotImplementedError("scaled steps need one model chunk per rank")
    return {n: p for n, p in unwrap(model_chunks[0]).named_parameters() if p.requires_grad}


def scaled_optimizer_step(optimizer, model_chunks: list,
                          choose_alpha: ChooseAlpha) -> tuple[bool, float | None, float]:
    """(update successful, grad norm, alpha); a skipped step (non-finite grads) is alpha 0.
    LoGRA with frozen unsketched parameters has no dense step: its tangent is low rank only
    and its grad norm is the sketches' norm."""
    logra = isinstance(optimizer, LograOptimizer)
    dense = optimizer.dense if logra else optimizer
    scaler, dense_tangents, grad_norm = None, {}, None
    if dense is not None:
        scaler = HeldBackStep(dense, stepped_params(model_chunks))
        scaler.snapshot()
        ok, grad_norm, _ = dense.step()
        if not ok:
            scaler.discard()
            return False, grad_norm, 0.0
        dense_tangents = scaler.tangents()
    chosen: list[float] = []

    def scale(stats: dict | None = None) -> float:
        low_rank = low_rank_tangents(optimizer.gather_directions(), stats["c"]) if logra else {}
        alpha = float(choose_alpha(UpdateTangents(dense_tangents, low_rank)))
        if scaler is not None:
            scaler.apply(alpha)
        chosen.append(alpha)
        return alpha

    if logra:
        optimizer.step_sketches(scale)
        grad_norm = optimizer.reported_grad_norm(grad_norm)
    else:
        scale()
    return True, grad_norm, chosen[0]
