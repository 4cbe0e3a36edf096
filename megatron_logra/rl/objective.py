"""The policy-gradient objective of published recipes: pure tensor math, no megatron.

Shapes: B responses of a microbatch, T positions (padded); ``mask`` [B, T] is 1 on
generated tokens; per-response tensors are [B].

Per token t of response i, with log-probabilities under the current weights (``logp``,
with gradient), under the weights the update started from (``old``: the trainer's, no
gradient) and under the rollout engine (``rollout``):

- engine correction (truncated importance sampling): w_t = min(exp(old - rollout), cap);
- policy ratio: r_t = exp(logp - old) (``token``), or GSPO's sequence ratio
  s_i = exp(mean over i's tokens of (logp - old)), the same for all of i's tokens
  (``sequence``);
- surrogate: l_t = -A_i r_t, or with PPO clipping (DAPO's clip-higher when eps_high >
  eps_low) l_t = max(-A_i r_t, -A_i clip(r_t, 1 - eps_low, 1 + eps_high));
- loss term: w_t l_t.

One optimizer step per rollout batch has old = logp (r = 1, value and gradient of
-w A log pi: the REINFORCE/GRPO loss with TIS), so clipping changes nothing there.
Aggregation (``loss_agg_mode``) gives (numerator, denominator) per microbatch; the trainer
divides the global sum of numerators by the global sum of denominators (megatron's
per-token-loss contract), so the loss is

- ``token-mean``: sum of all terms / generated tokens of the global batch;
- ``seq-mean-token-sum``: mean over responses of the sum of their terms;
- ``seq-mean-token-mean``: mean over responses of the mean of their terms (GSPO's);
- ``seq-mean-token-sum-norm``: sum of all terms / (responses x ``max_new_tokens``), Dr.GRPO's
  constant normaliser (with ``--no-grpo-std-norm``, its unscaled advantages).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_logra.rl.config import PolicyObjective

def _sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B]: the mean over each response's generated tokens (0 for none)."""
    return (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def policy_ratio(logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor,
                 level: str) -> torch.Tensor:
    """r [B, T]: exp(logp - old) per token, or GSPO's exp(mean_i(logp - old)) on all of
    response i's tokens; differentiable in ``logp``."""
    if level == "token":
        return torch.exp(logp - old)
    if level == "sequence":
        return torch.exp(_sequence_mean(logp - old, mask))[:, None].expand_as(logp)
    raise ValueError(f"ratio level must be token or sequence, got {level!r}")


def surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float | None,
              clip_high: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(l [B, T], clipped [B, T] bool): -A r, or PPO's max(-A r, -A clip(r, 1 - lo, 1 + hi));
    ``clipped`` marks the tokens whose clipped term is the larger (no gradient there)."""
    loss = -advantages[:, None] * ratio
    if clip_low is None:
        return loss, torch.zeros_like(loss, dtype=torch.bool)
    high = clip_low if clip_high is None else clip_high
    clipped_loss = -advantages[:, None] * ratio.clamp(1.0 - clip_low, 1.0 + high)
    return torch.maximum(loss, clipped_loss), clipped_loss > loss


def aggregate(terms: torch.Tensor, mask: torch.Tensor, mode: str,
              max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator, denominator) of a microbatch: the loss is sum(numerators) /
    sum(denominators) over the global batch (module docstring)."""
    terms = terms * mask
    responses = mask.new_tensor(float(mask.shape[0]))
    if mode == "token-mean":
        return terms.sum(), mask.sum()
    if mode == "seq-mean-token-sum":
        return terms.sum(), responses
    if mode == "seq-mean-token-mean":
        return (terms.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum(), responses
    if mode == "seq-mean-token-sum-norm":
        return terms.sum() / max_new_tokens, responses
    raise ValueError(f"unknown loss aggregation {mode!r}")


@dataclass(frozen=True)
class ObjectiveTerms:
    numerator: torch.Tensor  # scalar, with gradient
    denominator: torch.Tensor  # scalar
    weights: torch.Tensor  # w [B, T] (ones without TIS)
    clipped: torch.Tensor  # [B, T] bool
    ratio: torch.Tensor  # r [B, T], detached


def objective_terms(obj: PolicyObjective, logp: torch.Tensor, old: torch.Tensor,
                    rollout: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    max_new_tokens: int = 1) -> ObjectiveTerms:
    """The microbatch's loss numerator and denominator, and what the trainer reports;
    ``max_new_tokens``: seq-mean-token-sum-norm's constant (``--max-new-tokens``)."""
    old = old.detach()
    if obj.tis_cap is None:
        weights = torch.ones_like(logp)
    else:
        if obj.tis_cap <= 0:
            raise ValueError(f"importance-sampling cap must be > 0, got {obj.tis_cap}")
        weights = torch.exp(old - rollout).clamp(max=obj.tis_cap)
    ratio = policy_ratio(logp, old, mask, obj.importance_ratio_level)
    loss, clipped = surrogate(ratio, advantages, obj.clip_ratio_low, obj.clip_ratio_high)
    numerator, denominator = aggregate(weights * loss, mask, obj.loss_agg_mode,
                                       max_new_tokens)
    return ObjectiveTerms(numerator, denominator, weights, clipped & (mask > 0),
                          ratio.detach())
