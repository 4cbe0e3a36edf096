"""The RL stage's flags (``--stage rl``) and their checks; ``megatron_logra.cli`` calls these."""

from __future__ import annotations

import argparse

from megatron_logra.config import KLControlConfig, RLConfig


class _Error(ValueError):
    pass


def add_rl_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("RL (--stage rl): rollouts, rewards, evaluation")
    g.add_argument("--algorithm", choices=("grpo", "reinforce"), default="grpo",
                   help="group-normalised advantages, or REINFORCE with a running baseline")
    g.add_argument("--prompts-per-step", type=int, default=8, help="prompts per update")
    g.add_argument("--responses-per-prompt", type=int, default=4,
                   help="samples per prompt (global batch = prompts x responses)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="response length limit")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    g.add_argument("--rollout-seed", type=int, default=0, help="sampling seed")
    g.add_argument("--tis-cap", type=float, default=2.0,
                   help="truncated importance sampling cap on pi_train/pi_rollout (0: off)")
    g.add_argument("--baseline-decay", type=float, default=RLConfig.baseline_decay,
                   help="reinforce: b <- decay b + (1 - decay) mean(outcomes of this batch), "
                        "after its advantages (past batches only; b starts at 0)")
    g.add_argument("--failure-reward", type=float, default=RLConfig.failure_reward,
                   help="reinforce with binary rewards: the outcome of an answer scoring below "
                        "1 (a correct one is 1), as the paper's running-baseline REINFORCE")
    g.add_argument("--reward", choices=("binary", "partial"), default="binary",
                   help="binary correctness (score == 1) or the scorer's partial credit")
    g.add_argument("--verifier-timeout", type=float, default=10.0,
                   help="seconds per scored answer (a timeout scores 0)")
    g.add_argument("--eval-interval", type=int, default=0,
                   help="updates between evaluations (0: only before and after training)")
    g.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts per evaluation")
    g.add_argument("--eval-samples", type=int, default=4, help="samples per eval prompt (pass@k)")
    g.add_argument("--eval-temperature", type=float, default=RLConfig.eval_temperature,
                   help="sampling temperature of evaluations (the paper: 0.7)")
    g.add_argument("--eval-top-p", type=float, default=RLConfig.eval_top_p,
                   help="nucleus sampling of evaluations (the paper: 0.7; 1 turns it off)")
    g.add_argument("--rollout-tensor-parallel-size", type=int, default=1,
                   help="vLLM tensor-parallel size of the rollout engine")
    g.add_argument("--rollout-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="vLLM weights dtype (float32: trainer/engine logprobs agree to ~1e-6)")
    g.add_argument("--rollout-kv-cache-gib", type=float, default=1.0, help="vLLM KV cache size")
    g.add_argument("--sync-bucket-mb", type=int, default=64, help="weight-push bucket size")
    g.add_argument("--weight-sync", choices=("full", "sparse-delta", "sketch-delta"),
                   default="full",
                   help="full: HF tensors; sparse-delta: the engine-dtype elements that changed "
                        "(exact); sketch-delta (LoGRA): per sketched weight D and its seed, the "
                        "engine regenerates A and applies the update")
    g.add_argument("--weight-sync-anchor-interval", type=int, default=0,
                   help="a full push every N updates (0: only when a delta cannot be used)")
    g.add_argument("--weight-sync-verify-interval", type=int, default=1,
                   help="compare per-tensor fingerprints every N delta pushes (0: never); a "
                        "mismatch resyncs that tensor")
    g = p.add_argument_group("predicted-KL step control")
    g.add_argument("--kl-control", choices=("none", "predicted"), default="none",
                   help="scale every update so its predicted KL meets the budget")
    g.add_argument("--kl-budget", type=float, default=2e-4, help="KL budget at the first update")
    g.add_argument("--kl-budget-final", type=float, default=2e-5, help="budget after the decay")
    g.add_argument("--kl-budget-steps", type=int, default=300, help="cosine decay length")
    g.add_argument("--kl-alpha-max", type=float, default=3.0, help="largest step scale")
    g.add_argument("--kl-probe-responses", type=int, default=2,
                   help="responses per DP rank the KL prediction uses")
    g.add_argument("--kl-probe-max-tokens", type=int, default=4096,
                   help="each probe response is cut at this many tokens, prompt included "
                        "(the reference's cap; the forward-mode pass's cost grows with it)")


def _check_sketch_delta(args: argparse.Namespace) -> None:
    """sketch-delta keeps the engine bit-identical to the trainer only when both apply the
    same bf16 update with the same rounding bits; anything else drifts (every fingerprint
    fails, or silently without verification), so it is refused before any work."""
    if args.optimizer != "logra":
        raise _Error("--weight-sync sketch-delta sends LoGRA's low-rank updates: it needs "
                     "--optimizer logra (use --weight-sync full with Adam)")
    inexact = [flag for flag, bad in (
        ("--bf16 (the trainer's weights are fp32)", not args.bf16),
        ("--logra-master-weights none (an fp32 master rounds differently from the engine)",
         args.logra_master_weights != "none"),
        ("--rollout-dtype bfloat16 (an fp32 engine cannot hold the trainer's bf16 result)",
         args.rollout_dtype != "bfloat16"),
        ("--logra-projection rademacher (Gaussian entries are not exact in fp64 products)",
         args.logra_projection != "rademacher")) if bad]
    if inexact:
        raise _Error("--weight-sync sketch-delta keeps the engine bit-exact only with "
                     "--bf16 --logra-master-weights none --rollout-dtype bfloat16 and "
                     "Rademacher projections; missing: " + "; ".join(inexact) +
                     ". Add them, or use --weight-sync sparse-delta or full")


def rl_config(args: argparse.Namespace, dp: int) -> RLConfig:
    """Checked RLConfig; raises ValueError with the flag's name and the fix."""
    for flag in ("prompts_per_step", "responses_per_prompt", "max_new_tokens", "eval_prompts",
                 "eval_samples", "rollout_tensor_parallel_size", "sync_bucket_mb",
                 "kl_budget_steps", "kl_probe_responses", "kl_probe_max_tokens"):
        if getattr(args, flag) < 1:
            raise _Error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.temperature <= 0:
        raise _Error(f"--temperature {args.temperature} must be > 0 (greedy RL has no gradient)")
    if args.tis_cap < 0:
        raise _Error("--tis-cap must be >= 0 (0 turns truncated importance sampling off)")
    if args.algorithm == "grpo" and args.responses_per_prompt < 2:
        raise _Error("--algorithm grpo needs --responses-per-prompt >= 2 (advantages are "
                     "relative to the prompt's group)")
    if not 0 <= args.baseline_decay < 1:
        raise _Error("--baseline-decay must lie in [0, 1)")
    if args.eval_interval < 0 or args.verifier_timeout <= 0 or args.rollout_kv_cache_gib <= 0:
        raise _Error("--eval-interval must be >= 0, --verifier-timeout and "
                     "--rollout-kv-cache-gib > 0")
    if not 0 < args.kl_budget_final <= args.kl_budget:
        raise _Error("need 0 < --kl-budget-final <= --kl-budget")
    if args.kl_alpha_max <= 0:
        raise _Error("--kl-alpha-max must be > 0")
    if args.weight_sync == "sketch-delta":
        _check_sketch_delta(args)
    if not 0 < args.eval_top_p <= 1 or args.eval_temperature <= 0:
        raise _Error("need 0 < --eval-top-p <= 1 and --eval-temperature > 0")
    if args.weight_sync_anchor_interval < 0 or args.weight_sync_verify_interval < 0:
        raise _Error("--weight-sync-anchor-interval and --weight-sync-verify-interval must "
                     "be >= 0")
    if args.seq_length < args.max_new_tokens + 8:
        raise _Error(f"--seq-length {args.seq_length} leaves no room for prompts with "
                     f"--max-new-tokens {args.max_new_tokens}; raise --seq-length")
    batch = args.prompts_per_step * args.responses_per_prompt
    if batch % (args.micro_batch_size * dp):
        raise _Error(f"the RL global batch, --prompts-per-step x --responses-per-prompt = "
                     f"{batch}, is not divisible by --micro-batch-size x data-parallel size = "
                     f"{args.micro_batch_size * dp}")
    if args.kl_control == "predicted" and args.kl_probe_responses > batch // dp:
        raise _Error(f"--kl-probe-responses {args.kl_probe_responses} exceeds the "
                     f"{batch // dp} responses each data-parallel rank trains on")
    kl = KLControlConfig(mode=args.kl_control, budget_start=args.kl_budget,
                         budget_end=args.kl_budget_final, budget_steps=args.kl_budget_steps,
                         alpha_max=args.kl_alpha_max, probe_responses=args.kl_probe_responses,
                         probe_max_tokens=args.kl_probe_max_tokens)
    return RLConfig(algorithm=args.algorithm, prompts_per_step=args.prompts_per_step,
                    responses_per_prompt=args.responses_per_prompt,
                    max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    rollout_seed=args.rollout_seed, tis_cap=args.tis_cap or None,
                    baseline_decay=args.baseline_decay, failure_reward=args.failure_reward,
                    reward=args.reward, eval_temperature=args.eval_temperature,
                    eval_top_p=args.eval_top_p,
                    verifier_timeout_s=args.verifier_timeout, eval_interval=args.eval_interval,
                    eval_prompts=args.eval_prompts, eval_samples=args.eval_samples,
                    rollout_tensor_parallel_size=args.rollout_tensor_parallel_size,
                    rollout_dtype=args.rollout_dtype,
                    rollout_kv_cache_gib=args.rollout_kv_cache_gib,
                    sync_bucket_mb=args.sync_bucket_mb, weight_sync=args.weight_sync,
                    weight_sync_anchor_interval=args.weight_sync_anchor_interval,
                    weight_sync_verify_interval=args.weight_sync_verify_interval, kl=kl)
