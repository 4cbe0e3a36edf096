"""The RL stage's settings (``--stage rl``): rollouts, rewards, advantages, evaluation.

No torch, no megatron. Weight sync (``bridge.config``) and predicted-KL control
(``kl.config``) own their settings; ``RLConfig`` holds them as its ``sync`` and ``kl``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_logra.bridge.config import WeightSyncConfig
from megatron_logra.flags import flag_spec
from megatron_logra.kl.config import KLControlConfig

_POSITIVE = flag_spec(minimum=1)


@dataclass(frozen=True)
class RLConfig:
    """The RL stage (``--stage rl``): rollouts, rewards, advantages, evaluation."""

    algorithm: Literal["grpo", "reinforce"] = "grpo"
    """Group-normalised advantages, or REINFORCE with a running baseline."""
    prompts_per_step: int = field(default=8, metadata=_POSITIVE)
    """Prompts per update."""
    responses_per_prompt: int = field(default=4, metadata=_POSITIVE)
    """Samples per prompt (global batch = prompts x responses)."""
    max_new_tokens: int = field(default=64, metadata=_POSITIVE)
    """Response length limit."""
    temperature: float = 1.0
    """Sampling temperature of rollouts."""
    rollout_seed: int = 0
    """Sampling seed."""
    tis_cap: float | None = field(default=2.0, metadata=flag_spec(minimum=0, zero_is_none=True))
    """Truncated importance sampling cap on pi_train/pi_rollout (0: off)."""
    baseline_decay: float = 0.9
    """reinforce: b <- decay b + (1 - decay) mean(outcomes of this batch), after its
    advantages (past batches only; b starts at 0)."""
    failure_reward: float = -0.01
    """reinforce with binary rewards: the outcome of an answer scoring below 1 (a correct
    one is 1), as the paper's running-baseline REINFORCE."""
    reward: Literal["binary", "partial"] = "binary"
    """Binary correctness (score == 1) or the scorer's partial credit."""
    verifier_timeout_s: float = field(default=10.0,
                                      metadata=flag_spec(flag="--verifier-timeout"))
    """Seconds per scored answer (a timeout scores 0)."""
    eval_interval: int = field(default=0, metadata=flag_spec(minimum=0))
    """Updates between evaluations (0: only before and after training)."""
    eval_prompts: int = field(default=32, metadata=_POSITIVE)
    """Held-out prompts per evaluation."""
    eval_samples: int = field(default=4, metadata=_POSITIVE)
    """Samples per eval prompt (the k of pass@k)."""
    eval_temperature: float = 0.7
    """Sampling temperature of evaluations (the paper: 0.7)."""
    eval_top_p: float = 0.7
    """Nucleus sampling of evaluations (the paper: 0.7; 1 turns it off)."""
    rollout_tensor_parallel_size: int = field(default=1, metadata=_POSITIVE)
    """vLLM tensor-parallel size of the rollout engine."""
    rollout_dtype: Literal["float32", "bfloat16"] = "float32"
    """vLLM weights dtype (float32: trainer/engine logprobs agree to ~1e-6)."""
    rollout_kv_cache_gib: float = 1.0
    """vLLM KV cache size."""
    sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    kl: KLControlConfig = field(default_factory=KLControlConfig)
