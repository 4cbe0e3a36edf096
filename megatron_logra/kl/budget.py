"""Predicted-KL step control, the math (docs/method.md, section 3); plain torch.

Per probe token, with p = softmax(z / T) over the vocabulary and d = dz / T the tangent
of the tempered logits along the update:

    K = 1/2 sum_v p_v (d_v - E_p[d])^2      (the softmax's Fisher quadratic form)

so KL(p(theta) || p(theta + alpha dtheta)) ~= alpha^2 K. The step scale is
alpha = min(alpha_max, sqrt(budget / K)) (1 when K = 0). The budget follows a cosine
from ``budget`` (update 0) to ``budget_final`` (reached at update ``budget_steps``
- 1, as the reference's schedule), minus the rollout/trainer mismatch m
(m <- 0.7 m + 0.3 max(0, mean(gen - prev))), never below half the scheduled budget.

The logits are vocab-parallel ([n, V/TP] per TP rank): every sum over the vocabulary is
a local sum all-reduced over ``tp_group`` (None: one rank holds the whole vocabulary).
Padded vocabulary entries (global index >= ``vocab_size``) are excluded. K and the
realized KL are computed in fp64, ``CHUNK_TOKENS`` tokens at a time (the [n, V] fp64
temporaries of a 4096-token probe would not fit otherwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_logra.kl.config import KLControlConfig


CHUNK_TOKENS = 256


def _chunked(per_token, *tensors: torch.Tensor) -> torch.Tensor:
    """``per_token`` over [n, ...] tensors, CHUNK_TOKENS rows at a time -> [n] fp64."""
    n = tensors[0].shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.float64, device=tensors[0].device)
    return torch.cat([per_token(*(t[i:i + CHUNK_TOKENS] for t in tensors))
                      for i in range(0, n, CHUNK_TOKENS)])


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _tempered(logits: torch.Tensor, vocab_size: int, vocab_start: int,
              temperature: float) -> torch.Tensor:
    """fp64 z / T [n, V_local] with padded entries at -inf."""
    z = logits.double() / temperature
    if vocab_start + z.shape[-1] <= vocab_size:  # no padded entry in this shard
        return z
    pad = torch.arange(vocab_start, vocab_start + z.shape[-1], device=z.device) >= vocab_size
    return z.masked_fill(pad, float("-inf"))


def _log_softmax(z: torch.Tensor, group) -> torch.Tensor:
    """log softmax over the (vocab-parallel) last dimension of z [n, V_local]."""
    zmax = _all_reduce(z.amax(-1, keepdim=True).detach().clone(), group, dist.ReduceOp.MAX)
    sumexp = _all_reduce(torch.exp(z - zmax).sum(-1, keepdim=True), group)
    return z - zmax - torch.log(sumexp)


def fisher_quadratic(logits: torch.Tensor, tangent: torch.Tensor, *, temperature: float,
                     vocab_size: int, vocab_start: int = 0, tp_group=None) -> torch.Tensor:
    """K per token [n] (fp64) from logits and their tangent [n, V_local] (this TP rank's
    vocab slice, starting at global index ``vocab_start``)."""
    def per_token(z: torch.Tensor, dz: torch.Tensor) -> torch.Tensor:
        logp = _log_softmax(_tempered(z, vocab_size, vocab_start, temperature), tp_group)
        p = torch.exp(logp)
        d = dz.double() / temperature
        mean = _all_reduce((p * d).sum(-1, keepdim=True), tp_group)
        return 0.5 * _all_reduce((p * (d - mean) ** 2).sum(-1), tp_group)

    return _chunked(per_token, logits, tangent)


def token_kl(old_logits: torch.Tensor, new_logits: torch.Tensor, *, temperature: float,
             vocab_size: int, vocab_start: int = 0, tp_group=None) -> torch.Tensor:
    """KL(p_old || p_new) per token [n] (fp64) at temperature T, from vocab-parallel
    logits."""
    def per_token(z_old: torch.Tensor, z_new: torch.Tensor) -> torch.Tensor:
        old = _log_softmax(_tempered(z_old, vocab_size, vocab_start, temperature), tp_group)
        new = _log_softmax(_tempered(z_new, vocab_size, vocab_start, temperature), tp_group)
        p = torch.exp(old)
        terms = torch.where(p > 0, p * (old - new), torch.zeros_like(p))
        return _all_reduce(terms.sum(-1), tp_group)

    return _chunked(per_token, old_logits, new_logits)


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
    """The cosine budget at ``update`` (0-based): ``budget`` at update 0, ``budget_final``
    from update budget_steps - 1 on (the reference's ``scheduled_budget``)."""
    frac = min(update / max(cfg.budget_steps - 1, 1), 1.0)
    return cfg.budget_final + 0.5 * (cfg.budget - cfg.budget_final) * (
        1 + math.cos(math.pi * frac))


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
        """The scheduled budget less m (at least half of it); the schedule alone with
        ``mismatch_adjust`` off."""
        scheduled = scheduled_budget(self.cfg, update)
        if not self.cfg.mismatch_adjust:
            return scheduled
        return max(scheduled - self.mismatch, 0.5 * scheduled)

    def state_dict(self) -> dict:
        return {"mismatch": self.mismatch}

    def load_state_dict(self, state: dict) -> None:
        self.mismatch = float(state["mismatch"])
