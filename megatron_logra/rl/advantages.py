"""Advantages: GRPO's group-normalised rewards, REINFORCE's outcomes and its running
baseline; pure tensor math (the loss they weight: ``rl.objective``).

Shapes: P prompts x G responses per prompt; rewards [P, G].
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
