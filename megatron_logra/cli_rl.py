"""The RL stage's cross-setting checks (``--stage rl``); ``megatron_logra.cli`` calls them."""

from __future__ import annotations

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
    if kl.mode == "predicted" and kl.probe_responses > batch // dp:
        raise ValueError(f"--kl-probe-responses {kl.probe_responses} exceeds the "
                         f"{batch // dp} responses each data-parallel rank trains on")
