"""The RL stage's settings (``--stage rl``): rollouts, rewards, advantages, evaluation.

No torch, no megatron. ``RLConfig`` holds the sampling, advantage, evaluation and PPO
settings, and the slices each part of the stage takes as they are: ``objective``
(``PolicyObjective``: the loss, ``rl.objective``), ``verifier`` (``VerifierConfig``:
``rl.verifiers``), ``rollout`` (``rollout.config.EngineConfig``: ``--rollout-*``, the
engines), ``staleness`` (``StalenessConfig``: ``--async-rollouts`` and its bounds,
``rl.staleness``), ``weight_sync`` (``weight_sync.config``: ``--weight-sync-*``) and
``kl`` (``kl.config``: ``--kl-*``). Each checks itself when built (``__post_init__``);
``RLConfig`` checks the rules across them, and the rules that need another slice of the
run (optimizer, batch, layout) are ``config.RunConfig``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from megatron_logra.flags import check_fields, flag_spec
from megatron_logra.kl.config import KLControlConfig
from megatron_logra.rollout.config import EngineConfig
from megatron_logra.runtime.sandbox import SandboxLimits
from megatron_logra.weight_sync.config import WeightSyncConfig
from megatron_logra.weight_sync.contract import check_engines, check_steps_per_push

_POSITIVE = flag_spec(minimum=1)

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"]


@dataclass(frozen=True)
class PolicyObjective:
    """The policy loss (``rl.objective``): the engine correction, the PPO/GSPO ratio and its
    clipping, how token terms become the loss."""

    tis_cap: float | None = field(default=2.0, metadata=flag_spec(minimum=0, zero_is_none=True))
    """Truncated importance sampling cap on pi_train/pi_rollout (0: off)."""
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

    def __post_init__(self) -> None:
        check_fields(self)
        if self.clip_ratio_high is not None and self.clip_ratio_low is None:
            raise ValueError("--clip-ratio-high needs --clip-ratio-low (clipping is off without "
                             "it); DAPO's clip-higher: --clip-ratio-low 0.2 --clip-ratio-high "
                             "0.28")
        if self.clip_ratio_low is not None and self.clip_ratio_low >= 1:
            raise ValueError(f"--clip-ratio-low {self.clip_ratio_low} must be in (0, 1): the "
                             f"ratio is clipped below at 1 - eps_low")


@dataclass(frozen=True)
class VerifierConfig:
    """How answers are scored (``rl.verifiers.Verifier``, ``rl.verifier``)."""

    FLAG_PREFIX: ClassVar[str] = "verifier-"

    reward: Literal["binary", "partial"] = field(default="binary",
                                                 metadata=flag_spec(flag="--reward"))
    """Binary correctness (score == 1) or the scorer's partial credit."""
    timeout: float = 10.0
    """Seconds per scored answer (a timeout scores 0)."""
    max_answer_chars: int = field(default=4000, metadata=flag_spec(cli=False))
    """Longer answers are cut before scoring."""
    limits: SandboxLimits = field(default_factory=SandboxLimits, metadata=flag_spec(cli=False))
    """The scoring process's memory and file caps."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.timeout <= 0:
            raise ValueError(f"--verifier-timeout {self.timeout}: must be > 0 seconds")


@dataclass(frozen=True)
class StalenessConfig:
    """Generation beside training (``--async-rollouts``) and how stale its samples may be
    when they train (``rl.staleness`` applies the bounds)."""

    async_rollouts: bool = False
    """The engines generate the next --max-staleness batches with the current weights while
    the trainer trains on this one (one step off by default); the loss corrects for the
    stale policy with the importance weights (--tis-cap) against the generating version's
    logprobs."""
    max_staleness: int = field(default=1, metadata=_POSITIVE)
    """--async-rollouts: how many versions a sample's weights may be behind the trainer's
    when it trains (and how many batches generation runs ahead); older ones never reach the
    loss."""
    max_staleness_kl: float | None = field(default=None, metadata=flag_spec(
        minimum=0, zero_is_none=True))
    """--async-rollouts: a bound on the KL the policy moved since a sample's weights: the sum
    over the updates in between of each one's realized KL where it was measured
    (--kl-control measure), else its predicted alpha^2 K. Samples beyond it are dropped
    (or down-weighted: --stale-samples) and counted. 0: no bound."""
    stale_samples: Literal["drop", "downweight"] = "drop"
    """What happens to a sample beyond --max-staleness-kl: dropped (no gradient, no token
    count), or down-weighted by bound / its KL."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.async_rollouts and (self.max_staleness != 1 or self.max_staleness_kl):
            raise ValueError("--max-staleness and --max-staleness-kl bound the samples of "
                             "--async-rollouts; add it, or drop them")


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
    baseline_decay: float = 0.9
    """reinforce: b <- decay b + (1 - decay) mean(outcomes of this batch), after its
    advantages (past batches only; b starts at 0)."""
    failure_reward: float = -0.01
    """reinforce with binary rewards: the outcome of an answer scoring below 1 (a correct
    one is 1), as the paper's running-baseline REINFORCE."""
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
    grpo_std_norm: bool = True
    """GRPO: divide advantages by the group's reward std (--no-grpo-std-norm: Dr.GRPO)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (GRPO): groups whose rewards are all equal (zero advantage,
    full cost) are dropped and more prompts generated, up to --dynamic-sampling-max-rounds
    generations per update; a batch still short is filled with dropped groups."""
    dynamic_sampling_max_rounds: int = field(default=3, metadata=_POSITIVE)
    """Generation rounds per update at most with --dynamic-sampling (1: filter only)."""
    objective: PolicyObjective = field(default_factory=PolicyObjective)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    rollout: EngineConfig = field(default_factory=EngineConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    kl: KLControlConfig = field(default_factory=KLControlConfig)

    def __post_init__(self) -> None:
        """Raise ValueError naming the flags and the fix (the rules across the RL stage's
        own settings; each slice has checked its own, and ``RunConfig`` checks those that
        need the optimizer, batch or layout)."""
        check_fields(self)
        if self.temperature <= 0:
            raise ValueError(f"--temperature {self.temperature} must be > 0 (greedy RL has no "
                             f"gradient)")
        if self.algorithm == "grpo" and self.responses_per_prompt < 2:
            raise ValueError("--algorithm grpo needs --responses-per-prompt >= 2 (advantages "
                             "are relative to the prompt's group)")
        if not 0 <= self.baseline_decay < 1:
            raise ValueError("--baseline-decay must lie in [0, 1)")
        if not 0 < self.eval_top_p <= 1 or self.eval_temperature <= 0:
            raise ValueError("need 0 < --eval-top-p <= 1 and --eval-temperature > 0")
        self._check_objective()
        self._check_rollout_schedule()

    def _check_rollout_schedule(self) -> None:
        """Replicas, asynchronous generation and the staleness bounds."""
        staleness = self.staleness
        if staleness.max_staleness_kl and self.kl.control == "none":
            raise ValueError("--max-staleness-kl sums the KL of the updates since a sample's "
                             "weights, which --kl-control none does not estimate: use "
                             "--kl-control predicted (or measure), or bound by "
                             "--max-staleness versions")
        if staleness.async_rollouts and self.rollout.placement == "colocated":
            raise ValueError("--async-rollouts generates while the trainer trains; "
                             "--rollout-placement colocated takes turns on the same devices: "
                             "use dedicated (or inherit) placement")
        check_engines(self.weight_sync.transport, self.rollout.engines)

    def _check_objective(self) -> None:
        """PPO steps, GRPO variants and dynamic sampling."""
        steps = self.steps_per_update
        if steps > 1 and self.kl.control != "none":
            raise ValueError(
                f"--kl-control {self.kl.control} "
                f"{'sizes' if self.kl.control == 'predicted' else 'measures'} the one "
                f"optimizer step of each rollout batch against that update's KL budget; "
                f"--ppo-epochs {self.ppo_epochs} x "
                f"--ppo-minibatches {self.ppo_minibatches} = {steps} steps per batch would "
                f"each move the policy with no budget left for the others. Use --kl-control "
                f"none with several steps per batch (ratio clipping bounds them), or one step "
                f"per batch")
        check_steps_per_push(self.weight_sync.transport, steps)
        if self.algorithm != "grpo" and (self.dynamic_sampling or not self.grpo_std_norm):
            raise ValueError("--dynamic-sampling and --no-grpo-std-norm act on GRPO's groups: "
                             "use them with --algorithm grpo (the running baseline gives "
                             "zero-variance groups a non-zero advantage)")

    @property
    def steps_per_update(self) -> int:
        """Optimizer steps per rollout batch."""
        return self.ppo_epochs * self.ppo_minibatches
