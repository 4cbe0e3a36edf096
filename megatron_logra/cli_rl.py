"""The RL stage's cross-setting checks (``--stage rl``); ``megatron_logra.cli`` calls them."""

from __future__ import annotations

from megatron_logra.rollout.placement import check_placement_flags
from megatron_logra.config import OptimizerConfig, TrainingConfig
from megatron_logra.rl.config import RLConfig


def _check_sketch_delta(opt: OptimizerConfig, training: TrainingConfig, rl: RLConfig) -> None:
    """sketch-delta keeps the engine bit-identical to the trainer only when both apply the
    same bf16 update with the same rounding bits; anything else drifts (every fingerprint
    fails, or silently without verification), so it is refused before any work."""
    if opt.name != "logra":
        raise ValueError("--weight-sync sketch-delta sends LoGRA's low-rank updates: it needs "
                         "--optimizer logra (use --weight-sync full with Adam)")
    inexact = [flag for flag, bad in (
        ("--bf16 (the trainer's weights are fp32)", not training.bf16),
        ("--logra-master-weights none (an fp32 master rounds differently from the engine)",
         opt.logra.master_weights != "none"),
        ("--rollout-dtype bfloat16 (an fp32 engine cannot hold the trainer's bf16 result)",
         rl.rollout_dtype != "bfloat16"),
        ("--logra-projection rademacher (Gaussian entries are not exact in fp64 products)",
         opt.logra.projection != "rademacher")) if bad]
    if inexact:
        raise ValueError("--weight-sync sketch-delta keeps the engine bit-exact only with "
                         "--bf16 --logra-master-weights none --rollout-dtype bfloat16 and "
                         "Rademacher projections; missing: " + "; ".join(inexact) +
                         ". Add them, or use --weight-sync sparse-delta or full")


def _check_objective(rl: RLConfig, training: TrainingConfig, dp: int) -> None:
    """PPO steps, clipping, GRPO variants and dynamic sampling."""
    steps = rl.steps_per_update
    if steps > 1 and rl.kl.mode == "predicted":
        raise ValueError(
            f"--kl-control predicted sizes the one optimizer step of each rollout batch "
            f"against that update's KL budget; --ppo-epochs {rl.ppo_epochs} x "
            f"--ppo-minibatches {rl.ppo_minibatches} = {steps} steps per batch would each "
            f"move the policy with no budget left for the others. Use --kl-control none "
            f"with several steps per batch (ratio clipping bounds them), or one step per batch")
    if steps > 1 and rl.sync.transport == "sketch-delta":
        raise ValueError(f"--weight-sync sketch-delta sends one LoGRA step's factors per push; "
                         f"with {steps} optimizer steps per rollout batch use --weight-sync "
                         f"sparse-delta or full")
    batch = rl.prompts_per_step * rl.responses_per_prompt
    per_step = training.micro_batch_size * dp
    if batch % rl.ppo_minibatches or (batch // rl.ppo_minibatches) % per_step:
        raise ValueError(f"--ppo-minibatches {rl.ppo_minibatches} must split the rollout batch "
                         f"of {batch} responses into minibatches that are multiples of "
                         f"--micro-batch-size x data-parallel size = {per_step}")
    if rl.clip_ratio_high is not None and rl.clip_ratio_low is None:
        raise ValueError("--clip-ratio-high needs --clip-ratio-low (clipping is off without "
                         "it); DAPO's clip-higher: --clip-ratio-low 0.2 --clip-ratio-high 0.28")
    if rl.clip_ratio_low is not None and rl.clip_ratio_low >= 1:
        raise ValueError(f"--clip-ratio-low {rl.clip_ratio_low} must be in (0, 1): the ratio "
                         f"is clipped below at 1 - eps_low")
    if rl.algorithm != "grpo" and (rl.dynamic_sampling or not rl.grpo_std_norm):
        raise ValueError("--dynamic-sampling and --no-grpo-std-norm act on GRPO's groups: use "
                         "them with --algorithm grpo (the running baseline gives zero-variance "
                         "groups a non-zero advantage)")


def _check_server_engine(rl: RLConfig) -> None:
    from urllib.parse import urlparse

    url = urlparse(rl.rollout_engine_url)
    if url.scheme not in ("http", "https") or not url.hostname or not url.port:
        raise ValueError(f"--rollout-engine-url {rl.rollout_engine_url!r}: give the vLLM "
                         f"server's address as http://HOST:PORT")
    if rl.rollout_placement != "inherit":
        raise ValueError("--rollout-placement places an engine the trainer starts; the server "
                         "at --rollout-engine-url runs where you started it: drop it")


def check_rl(rl: RLConfig, training: TrainingConfig, opt: OptimizerConfig, dp: int) -> None:
    """Raise ValueError naming the flags and the fix (single-flag ranges are checked by
    ``flags`` already)."""
    if rl.temperature <= 0:
        raise ValueError(f"--temperature {rl.temperature} must be > 0 (greedy RL has no "
                         f"gradient)")
    if rl.algorithm == "grpo" and rl.responses_per_prompt < 2:
        raise ValueError("--algorithm grpo needs --responses-per-prompt >= 2 (advantages are "
                         "relative to the prompt's group)")
    if not 0 <= rl.baseline_decay < 1:
        raise ValueError("--baseline-decay must lie in [0, 1)")
    if rl.verifier_timeout_s <= 0 or rl.rollout_kv_cache_gib <= 0:
        raise ValueError("--verifier-timeout and --rollout-kv-cache-gib must be > 0")
    check_placement_flags(rl.rollout_placement, rl.rollout_devices)
    if rl.rollout_engine_url:
        _check_server_engine(rl)
    kl = rl.kl
    if not 0 < kl.budget_end <= kl.budget_start:
        raise ValueError("need 0 < --kl-budget-final <= --kl-budget")
    if kl.alpha_max <= 0:
        raise ValueError("--kl-alpha-max must be > 0")
    if rl.sync.transport == "sketch-delta":
        _check_sketch_delta(opt, training, rl)
    if rl.sync.transport == "lora-adapter" and opt.peft != "lora":
        raise ValueError("--weight-sync lora-adapter sends a LoRA adapter to vLLM: it needs "
                         "--peft lora (use --weight-sync full otherwise)")
    if not 0 < rl.eval_top_p <= 1 or rl.eval_temperature <= 0:
        raise ValueError("need 0 < --eval-top-p <= 1 and --eval-temperature > 0")
    if training.seq_length < rl.max_new_tokens + 8:
        raise ValueError(f"--seq-length {training.seq_length} leaves no room for prompts with "
                         f"--max-new-tokens {rl.max_new_tokens}; raise --seq-length")
    batch = rl.prompts_per_step * rl.responses_per_prompt
    if batch % (training.micro_batch_size * dp):
        raise ValueError(f"the RL global batch, --prompts-per-step x --responses-per-prompt = "
                         f"{batch}, is not divisible by --micro-batch-size x data-parallel "
                         f"size = {training.micro_batch_size * dp}")
    _check_objective(rl, training, dp)
    if kl.mode == "predicted" and kl.probe_responses > batch // dp:
        raise ValueError(f"--kl-probe-responses {kl.probe_responses} exceeds the "
                         f"{batch // dp} responses each data-parallel rank trains on")
