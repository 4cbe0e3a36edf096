"""Predicted-KL step control, the math (logra-method.md section 3); plain torch.

Per probe token, with p = softmax(z / T) over the vocabulary and d = dz / T the tangent
of the tempered logits along the update:

    K = 1/2 sum_v p_v (d_v - E_p[d])^2      (the softmax's Fisher quadratic form)

so KL(p(theta) || p(theta + alpha dtheta)) ~= alpha^2 K. The step scale is
alpha = min(alpha_max, sqrt(budget / K)) (1 when K = 0). The budget follows a cosine
from ``budget_start`` to ``budget_end`` over ``budget_steps`` updates, minus the
rollout/trainer mismatch m (m <- 0.7 m + 0.3 max(0, mean(gen - prev))), never below
half the scheduled budget.

The logits are vocab-parallel ([n, V/TP] per TP rank): every sum over the vocabulary is
a local sum all-reduced over ``tp_group`` (None: one rank holds the whole vocabulary).
Padded vocabulary entries (global index >= ``vocab_size``) are excluded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_logra.config import KLControlConfig


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _tempered(logits: torch.Tensor, vocab_size: int, vocab_start: int,
              temperature: float) -> torch.Tensor:
    """fp32 z / T [n, V_local] with padded entries at -inf."""
    z = logits.float() / temperature
    pad = torch.arange(vocab_start, vocab_start + z.shape[-1], device=z.device) >= vocab_size
    return z.masked_fill(pad, float("-inf")) if bool(pad.any()) else z


def _log_softmax(z: torch.Tensor, group) -> torch.Tensor:
    """log softmax over the (vocab-parallel) last dimension of z [n, V_local]."""
    zmax = _all_reduce(z.amax(-1, keepdim=True).detach().clone(), group, dist.ReduceOp.MAX)
    sumexp = _all_reduce(torch.exp(z - zmax).sum(-1, keepdim=True), group)
    return z - zmax - torch.log(sumexp)


def fisher_quadratic(logits: torch.Tensor, tangent: torch.Tensor, *, temperature: float,
                     vocab_size: int, vocab_start: int = 0, tp_group=None) -> torch.Tensor:
    """K per token [n] from logits and their tangent [n, V_local] (this TP rank's vocab
    slice, starting at global index ``vocab_start``)."""
    logp = _log_softmax(_tempered(logits, vocab_size, vocab_start, temperature), tp_group)
    p = torch.exp(logp)
    d = tangent.float() / temperature
    mean = _all_reduce((p * d).sum(-1, keepdim=True), tp_group)
    return 0.5 * _all_reduce((p * (d - mean) ** 2).sum(-1), tp_group)


def token_kl(old_logits: torch.Tensor, new_logits: torch.Tensor, *, temperature: float,
             vocab_size: int, vocab_start: int = 0, tp_group=None) -> torch.Tensor:
    """KL(p_old || p_new) per token [n] at temperature T, from vocab-parallel logits."""
    old = _log_softmax(_tempered(old_logits, vocab_size, vocab_start, temperature), tp_group)
    new = _log_softmax(_tempered(new_logits, vocab_size, vocab_start, temperature), tp_group)
    p = torch.exp(old)
    terms = torch.where(p > 0, p * (old - new), torch.zeros_like(p))
    return _all_reduce(terms.sum(-1), tp_group)


def step_scale(k: float, budget: float, alpha_max: float) -> float:
    """alpha = min(alpha_max, sqrt(budget / K)); 1 when K = 0; NaN or negative K is an error."""
    if not math.isfinite(k) or k < 0:
        raise FloatingPointError(f"predicted KL quadratic form K = {k}: the update or the "
                                 "probe logits are not finite; lower the learning rate or "
                                 "check the model's outputs")
    if k == 0.0:
        return 1.0
    return min(alpha_max, math.sqrt(budget / k))


def scheduled_budget(cfg: KLControlConfig, update: int) -> float:
    """The cosine budget at ``update`` (0-based): budget_start -> budget_end over budget_steps."""
    frac = min(update, cfg.budget_steps) / max(cfg.budget_steps, 1)
    return cfg.budget_end + 0.5 * (cfg.budget_start - cfg.budget_end) * (1 + math.cos(math.pi * frac))


@dataclass
class KLController:
    """The controller's state across updates: the mismatch average m (checkpointed)."""

    cfg: KLControlConfig
    mismatch: float = 0.0

    def observe_mismatch(self, mean_gen_minus_prev: float | None) -> None:
        """m <- decay m + (1 - decay) max(0, mean(gen - prev)); None (no EOS-terminated
        response this update) leaves m as it is."""
        if mean_gen_minus_prev is None:
            return
        decay = self.cfg.mismatch_decay
        self.mismatch = decay * self.mismatch + (1 - decay) * max(0.0, mean_gen_minus_prev)

    def budget(self, update: int) -> float:
        scheduled = scheduled_budget(self.cfg, update)
        return max(scheduled - self.mismatch, 0.5 * scheduled)

    def state_dict(self) -> dict:
        return {"mismatch": self.mismatch}

    def load_state_dict(self, state: dict) -> None:
        self.mismatch = float(state["mismatch"])
