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


def reinforce_outcomes(rewards: torch.Tensor, failure_reward: float | None) -> torch.Tensor:
    """The paper's REINFORCE outcomes: 1 where the reward is >= 1 (a correct answer), else
    ``failure_reward`` (-0.01 in the reference). None: the rewards as they are (partial
    credit keeps its values)."""
    if failure_reward is None:
        return rewards.float()
    return torch.where(rewards >= 1.0, torch.ones_like(rewards, dtype=torch.float32),
                       torch.full_like(rewards, failure_reward, dtype=torch.float32))


@dataclass
class RunningBaseline:
    """REINFORCE with a running baseline from past batches only (the reference's
    ``RunningBaselineAdvantageEstimator``): advantage = outcome - b, with b before this
    batch (0 at the start), then b <- decay b + (1 - decay) mean(outcomes)."""

    decay: float = 0.9
    value: float = 0.0

    def advantages(self, outcomes: torch.Tensor) -> torch.Tensor:
        adv = outcomes.float() - self.value
        self.value = self.decay * self.value + (1.0 - self.decay) * float(outcomes.float().mean())
        return adv

    def state_dict(self) -> dict:
        return {"decay": self.decay, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        # checkpoints of the earlier baseline hold None before their first batch
        self.decay, self.value = float(state["decay"]), float(state["value"] or 0.0)


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
