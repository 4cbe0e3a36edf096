"""Advantages, importance weights and the policy-gradient loss: pure tensor math.

Shapes: P prompts x G responses per prompt; B = P * G responses; T response tokens
(padded). ``mask`` [B, T] is 1 on generated tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def grpo_advantages(rewards: torch.Tensor, *, scale_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO: rewards [P, G] -> (r - mean_group) / (std_group + eps) [P, G] (population std;
    a group whose rewards are all equal gets advantage 0)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [prompts, responses per prompt], got {tuple(rewards.shape)}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centred
    return centred / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)


@dataclass
class RunningBaseline:
    """REINFORCE with a running baseline b: advantage = r - b (b before this batch), then
    b <- decay b + (1 - decay) mean(r). The first batch sets b to its mean first."""

    decay: float = 0.9
    value: float | None = None

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        mean = float(rewards.float().mean())
        if self.value is None:
            self.value = mean
        adv = rewards - self.value
        self.value = self.decay * self.value + (1.0 - self.decay) * mean
        return adv

    def state_dict(self) -> dict:
        return {"decay": self.decay, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.decay, self.value = float(state["decay"]), state["value"]


def truncated_importance_weights(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                                 cap: float) -> torch.Tensor:
    """TIS: min(pi_train / pi_rollout, cap) per token [B, T], no gradient (it corrects the
    rollout engine's numerics, not the policy)."""
    if cap <= 0:
        raise ValueError(f"importance-sampling cap must be > 0, got {cap}")
    return torch.exp(train_logprobs.detach() - rollout_logprobs).clamp(max=cap)


def policy_gradient_loss_sum(logprobs: torch.Tensor, advantages: torch.Tensor,
                             mask: torch.Tensor, weights: torch.Tensor | None = None
                             ) -> torch.Tensor:
    """sum over generated tokens of -w A log pi: logprobs [B, T] (with grad), advantages [B],
    mask [B, T], weights [B, T] or None. Token-level normalisation divides this by the
    number of generated tokens of the whole global batch (the caller's ``num_tokens``)."""
    per_token = -advantages[:, None] * logprobs * mask
    if weights is not None:
        per_token = per_token * weights
    return per_token.sum()


def logprob_mismatch(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> float:
    """Mean |log pi_train - log pi_rollout| over generated tokens."""
    n = mask.sum()
    return float(((train_logprobs - rollout_logprobs).abs() * mask).sum() / n.clamp(min=1))
