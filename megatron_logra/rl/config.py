"""The RL stage's settings (``--stage rl``): rollouts, rewards, advantages, evaluation.

No torch, no megatron. Weight sync (``weight_sync.config``) and predicted-KL control
(``kl.config``) own their settings; ``RLConfig`` holds them as its ``sync`` and ``kl``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_logra.weight_sync.config import WeightSyncConfig
from megatron_logra.flags import flag_spec
from megatron_logra.kl.config import KLControlConfig

_POSITIVE = flag_spec(minimum=1)

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"]


@dataclass(frozen=True)
class PolicyObjective:
    """What the policy loss is (``rl.objective``); ``RLConfig.policy_objective()`` builds it."""

    tis_cap: float | None = 2.0  # None: no engine correction
    clip_low: float | None = None  # eps_low; None: no ratio clipping
    clip_high: float | None = None  # eps_high; None: eps_low
    ratio_level: Literal["token", "sequence"] = "token"
    loss_agg_mode: LossAggMode = "token-mean"
    max_new_tokens: int = 1  # seq-mean-token-sum-norm's constant


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
    ppo_epochs: int = field(default=1, metadata=_POSITIVE)
    """Passes over each rollout batch; each minibatch of each pass is one optimizer step
    (one LoGRA sketch/RowAdam update), against the logprobs the update started from."""
    ppo_minibatches: int = field(default=1, metadata=_POSITIVE)
    """Minibatches per pass: the rollout batch in this many equal parts, in order."""
    clip_ratio_low: float | None = field(default=None, metadata=flag_spec(
        minimum=0, zero_is_none=True))
    """PPO ratio clipping: eps_low of clip(r, 1 - eps_low, 1 + eps_high) (0: off; PPO and
    DAPO use 0.2, GSPO 3e-4). It bites only from the second optimizer step of a batch."""
    clip_ratio_high: float | None = field(default=None, metadata=flag_spec(
        minimum=0, zero_is_none=True))
    """eps_high (default: --clip-ratio-low; DAPO's clip-higher: 0.28, GSPO 4e-4)."""
    importance_ratio_level: Literal["token", "sequence"] = "token"
    """The PPO ratio per token, or GSPO's per response: exp(mean log-ratio of its tokens)."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How token terms become the loss: token-mean (over the global batch's tokens),
    seq-mean-token-sum, seq-mean-token-mean (GSPO), seq-mean-token-sum-norm (Dr.GRPO: sum /
    (responses x --max-new-tokens))."""
    grpo_std_norm: bool = True
    """GRPO: divide advantages by the group's reward std (--no-grpo-std-norm: Dr.GRPO)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (GRPO): groups whose rewards are all equal (zero advantage,
    full cost) are dropped and more prompts generated, up to --dynamic-sampling-max-rounds
    generations per update; a batch still short is filled with dropped groups."""
    dynamic_sampling_max_rounds: int = field(default=3, metadata=_POSITIVE)
    """Generation rounds per update at most with --dynamic-sampling (1: filter only)."""
    rollout_tensor_parallel_size: int = field(default=1, metadata=_POSITIVE)
    """vLLM tensor-parallel size of the rollout engine."""
    rollout_dtype: Literal["float32", "bfloat16"] = "float32"
    """vLLM weights dtype (float32: trainer/engine logprobs agree to ~1e-6)."""
    rollout_kv_cache_gib: float = 1.0
    """vLLM KV cache size."""
    rollout_placement: Literal["inherit", "dedicated", "colocated"] = "inherit"
    """Where the engine runs (``rollout.placement``): on trainer rank 0's devices (inherit),
    on devices of its own (dedicated: --rollout-devices), or sharing the trainer's and
    taking turns with it (colocated: vLLM's sleep mode on CUDA)."""
    rollout_devices: str = ""
    """--rollout-placement dedicated: node 0's GPUs (visible indices, one per engine TP
    rank, e.g. 6,7) or on CPU its cores (e.g. 6-7) for the engine alone."""
    rollout_engine_url: str = ""
    """http://HOST:PORT of a vLLM server to generate the rollouts (started by you, as
    docs/usage.md shows: VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config
    '{"backend": "mlogra"}'); the trainer pushes its weights into it through vLLM's RL
    weight-transfer routes. Empty: trainer rank 0 starts one."""
    sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    kl: KLControlConfig = field(default_factory=KLControlConfig)

    @property
    def steps_per_update(self) -> int:
        """Optimizer steps per rollout batch."""
        return self.ppo_epochs * self.ppo_minibatches

    def policy_objective(self) -> PolicyObjective:
        return PolicyObjective(tis_cap=self.tis_cap, clip_low=self.clip_ratio_low,
                               clip_high=self.clip_ratio_high,
                               ratio_level=self.importance_ratio_level,
                               loss_agg_mode=self.loss_agg_mode,
                               max_new_tokens=self.max_new_tokens)
