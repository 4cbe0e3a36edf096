"""The launcher's command line (``cli.py``) -> frozen ``RunConfig``.

The flag set is frozen (``EXPECTED_FLAGS``: adding or renaming a flag must update it)
and every flag has help. Valid command lines give the expected config slices, and the
defaults of ``--optimizer logra``, REINFORCE, evaluation and KL control are the paper's
recipe (the reference's settings, restated here). Every bad command line is refused
with a ``ConfigError`` naming the problem and the fix, before any model is built; the
launcher itself exits with status 2 in under a minute and writes nothing.
"""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_logra.cli import ConfigError, build_parser, parse_run_config
from megatron_logra.model.tiny_assets import write_tiny_model_dir

REPO = Path(__file__).resolve().parents[2]

# The CLI grows only on purpose: adding or renaming a flag must update this set.
EXPECTED_FLAGS = {
    "--adam-beta1", "--adam-beta2", "--adam-eps", "--bf16", "--clip-grad", "--data-seed",
    "--dataset-size", "--finetune", "--global-batch-size", "--load", "--log-interval", "--lr",
    "--lr-decay-iters", "--lr-decay-style", "--lr-warmup-iters", "--micro-batch-size",
    "--min-lr", "--model-dir", "--optimizer", "--output-dir", "--pipeline-model-parallel-size",
    "--recompute-activations", "--save", "--save-interval", "--seed", "--seq-length", "--stage",
    "--task", "--tensor-model-parallel-size", "--tokenizer-model", "--train-iters",
    "--use-distributed-optimizer", "--weight-decay", "-h", "--help",
    "--logra-rank", "--logra-projection", "--logra-refresh-interval", "--logra-targets",
    "--logra-beta2", "--logra-eps", "--logra-update-ratio", "--logra-master-weights",
    "--logra-norm-restoration", "--no-logra-norm-restoration", "--logra-untargeted",
    "--logra-update-factor-dtype", "--failure-reward", "--eval-temperature", "--eval-top-p",
    "--algorithm", "--prompts-per-step", "--responses-per-prompt", "--max-new-tokens",
    "--temperature", "--rollout-seed", "--tis-cap", "--baseline-decay", "--reward",
    "--verifier-timeout", "--eval-interval", "--eval-prompts", "--eval-samples",
    "--rollout-tensor-parallel-size", "--rollout-dtype", "--rollout-kv-cache-gib",
    "--rollout-placement", "--rollout-devices", "--rollout-engine-url",
    "--rollout-engine-url-wait-s",
    "--optimizer-cpu-offload", "--optimizer-offload-fraction",
    "--sync-bucket-mb", "--kl-control", "--kl-budget", "--kl-budget-final", "--kl-budget-steps",
    "--kl-alpha-max", "--kl-probe-responses", "--kl-probe-max-tokens", "--kl-mismatch-adjust",
    "--no-kl-mismatch-adjust", "--weight-sync", "--weight-sync-anchor-interval",
    "--weight-sync-verify-interval",
    "--peft", "--lora-rank", "--lora-alpha", "--lora-dropout", "--lora-targets",
    "--transformer-impl", "--config", "--tensorboard-dir", "--wandb-project",
    "--wandb-exp-name", "--wandb-save-dir", "--ppo-epochs", "--ppo-minibatches",
    "--clip-ratio-low", "--clip-ratio-high", "--importance-ratio-level", "--loss-agg-mode",
    "--grpo-std-norm", "--no-grpo-std-norm", "--dynamic-sampling",
    "--dynamic-sampling-max-rounds", "--save-keep", "--auto-resume",
    "--max-skipped-updates", "--rollout-replicas", "--async-rollouts", "--max-staleness",
    "--max-staleness-kl", "--stale-samples", "--distributed-timeout-minutes",
    "--log-adam-cosine", "--dry-run", "--dry-run-world-size", "--dry-run-ranks",
    "--dry-run-gpus-per-node", "--dry-run-gpu-gib",
}


def test_flag_set_is_frozen():
    flags = {opt for action in build_parser()._actions for opt in action.option_strings}
    assert flags == EXPECTED_FLAGS


def test_every_flag_has_help():
    for action in build_parser()._actions:
        assert action.help, action.option_strings


def test_valid_command_line_gives_frozen_config():
    cfg = parse_run_config(["--tensor-model-parallel-size", "2", "--global-batch-size", "8",
                            "--micro-batch-size", "2", "--task", "basic_arithmetic:2,chain_sum",
                            "--use-distributed-optimizer"], world_size=4)
    assert cfg.parallel.data_parallel_size(4) == 2
    assert cfg.data.tasks == (("basic_arithmetic", 2.0), ("chain_sum", 1.0))
    assert cfg.optimizer.use_distributed_optimizer
    with pytest.raises(Exception):
        cfg.training.seed = 3  # frozen


@pytest.mark.parametrize("argv,world,match", [
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 2,
     r"world size 2 is not divisible by TP x PP = 2 x 2"),
    (["--tensor-model-parallel-size", "8"], 8, "num_attention_heads=4 is not divisible"),
    (["--pipeline-model-parallel-size", "3"], 3, "num_hidden_layers=4 is not divisible"),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], 1, "not divisible by --micro-batch"),
    (["--global-batch-size", "4", "--micro-batch-size", "1"], 8, "data-parallel size 8"),
    (["--task", "basic_arithmetik"], 1, r"unknown task 'basic_arithmetik' \(did you mean basic_arithmetic"),
    (["--task", "math"], 1, "'math' has no SFT targets"),
    (["--task", "chain_sum:-1"], 1, "must be > 0"),
    (["--stage", "rl", "--prompts-per-step", "3", "--micro-batch-size", "8"], 1,
     "RL global batch, --prompts-per-step x --responses-per-prompt = 12, is not divisible"),
    (["--stage", "rl", "--kl-control", "predicted", "--kl-probe-responses", "64"], 1,
     "--kl-probe-responses 64 exceeds"),
    (["--stage", "rl", "--kl-probe-max-tokens", "0"], 1, "--kl-probe-max-tokens must be >= 1"),
    (["--stage", "rl", "--responses-per-prompt", "1"], 1, "grpo needs --responses-per-prompt >= 2"),
    (["--stage", "rl", "--weight-sync", "sketch-delta"], 1, "it needs --optimizer logra"),
    # sketch-delta is exact only in bf16 SR mode into a bf16 engine with Rademacher A
    (["--stage", "rl", "--optimizer", "logra", "--weight-sync", "sketch-delta",
      "--rollout-dtype", "bfloat16", "--logra-master-weights", "none"], 1,
     r"missing: --bf16 \(the trainer's weights are fp32\)\. Add them"),
    (["--stage", "rl", "--optimizer", "logra", "--weight-sync", "sketch-delta", "--bf16",
      "--rollout-dtype", "bfloat16"], 1, r"missing: --logra-master-weights none \(an fp32 master"),
    (["--stage", "rl", "--optimizer", "logra", "--weight-sync", "sketch-delta", "--bf16",
      "--logra-master-weights", "none"], 1, r"missing: --rollout-dtype bfloat16 \(an fp32 engine"),
    (["--stage", "rl", "--optimizer", "logra", "--weight-sync", "sketch-delta", "--bf16",
      "--logra-master-weights", "none", "--rollout-dtype", "bfloat16", "--logra-projection",
      "gaussian"], 1, r"missing: --logra-projection rademacher"),
    (["--stage", "rl", "--eval-top-p", "0"], 1, "--eval-top-p"),
    (["--optimizer", "logra", "--bf16", "--logra-master-weights", "none",
      "--logra-update-factor-dtype", "float32"], 1, "applies bf16 factors"),
    (["--stage", "rl", "--weight-sync-anchor-interval", "-1"], 1, "must be >= 0"),
    (["--stage", "rl", "--temperature", "0"], 1, "--temperature 0.0 must be > 0"),
    (["--stage", "rl", "--max-new-tokens", "300", "--seq-length", "256"], 1, "raise --seq-length"),
    (["--stage", "rl", "--kl-budget", "1e-5", "--kl-budget-final", "1e-4"], 1,
     "--kl-budget-final <= --kl-budget"),
    (["--model-dir", "/nonexistent/model"], 1, "no config.json"),
    (["--tokenizer-model", "/nonexistent/sp.model"], 1, "file not found"),
    (["--load", "/nonexistent/ckpt"], 1, "does not exist"),
    (["--finetune"], 1, "--finetune needs --load"),
    (["--train-iters", "0"], 1, "--train-iters must be >= 1"),
    (["--min-lr", "1", "--lr", "0.1"], 1, "--min-lr"),
    (["--seq-length", "4096"], 1, "exceeds the model's max_position_embeddings=1024"),
    (["--optimizer", "logra", "--logra-targets", "qkv,lm_head"], 1, "--logra-targets"),
    (["--optimizer", "logra", "--logra-rank", "0"], 1, "--logra-rank 0 must be >= 1"),
    (["--optimizer", "logra", "--logra-refresh-interval", "0"], 1, "refresh-interval 0"),
    (["--optimizer", "logra", "--logra-beta2", "1.0"], 1, r"--logra-beta2 1.0 must be in \[0, 1\)"),
    (["--optimizer", "logra", "--logra-update-ratio", "-1"], 1, "must be > 0"),
    (["--optimizer", "logra", "--logra-master-weights", "none"], 1, "add --bf16"),
    (["--peft", "lora", "--optimizer", "logra"], 1, "use --optimizer adam"),
    (["--stage", "rl", "--weight-sync", "lora-adapter"], 1, "it needs --peft lora"),
    (["--peft", "lora", "--lora-targets", "qkv,embedding"], 1, "--lora-targets"),
    (["--peft", "lora", "--lora-rank", "0"], 1, "--lora-rank must be >= 1"),
    (["--peft", "lora", "--lora-dropout", "1"], 1, r"--lora-dropout 1.0 must be in \[0, 1\)"),
    (["--optimizer", "logra", "--transformer-impl", "transformer_engine"], 1,
     "LoGRA's sketched linears .* use --transformer-impl local"),
    (["--peft", "lora", "--transformer-impl", "transformer_engine"], 1, "LoRA's adapted"),
    (["--stage", "rl", "--max-staleness", "2"], 1, "bound the samples of --async-rollouts"),
    (["--stage", "rl", "--async-rollouts", "--max-staleness-kl", "0.01", "--kl-control",
      "none"], 1, "--kl-control none does not estimate"),
    (["--stage", "rl", "--async-rollouts", "--rollout-placement", "colocated"], 1,
     "takes turns on the same devices"),
    (["--stage", "rl", "--rollout-replicas", "2", "--weight-sync", "sparse-delta"], 1,
     "one engine's view"),
    (["--stage", "rl", "--rollout-replicas", "2", "--rollout-engine-url",
      "http://127.0.0.1:8000"], 1, "--rollout-replicas > 1 starts engines here: drop it"),
    (["--stage", "rl", "--rollout-engine-url", "http://a:1,http://b:2,http://a:1"], 1,
     "names http://a:1 twice"),
    (["--stage", "rl", "--rollout-engine-url", "http://a:1,b:2"], 1,
     "'b:2': give each vLLM server's address as http://HOST:PORT"),
    (["--stage", "rl", "--rollout-engine-url", "http://a:1,http://b:2", "--weight-sync",
      "sparse-delta"], 1, "several --rollout-engine-url"),
    (["--stage", "rl", "--rollout-engine-url", "http://a:1", "--rollout-engine-url-wait-s",
      "0"], 1, "--rollout-engine-url-wait-s must be >= 1"),
    (["--stage", "rl", "--rollout-replicas", "0"], 1, "--rollout-replicas must be >= 1"),
])
def test_bad_command_lines_name_problem_and_fix(argv, world, match):
    with pytest.raises(ConfigError, match=match):
        parse_run_config(argv, world_size=world)


def test_rl_flags_give_their_config_and_the_global_batch():
    cfg = parse_run_config(["--stage", "rl", "--prompts-per-step", "4", "--responses-per-prompt",
                            "6", "--tis-cap", "0", "--algorithm",
                            "reinforce", "--micro-batch-size", "2"], world_size=2)
    assert cfg.training.global_batch_size == 24
    assert (cfg.rl.prompts_per_step, cfg.rl.responses_per_prompt,
            cfg.rl.objective.tis_cap) == (4, 6, None)
    assert cfg.rl.kl.control == "none" and cfg.rl.algorithm == "reinforce"


def test_defaults_are_the_papers_recipe():
    """--optimizer logra is the reference's method unless told otherwise; evaluations sample
    at 0.7 / 0.7; REINFORCE's failure outcome is -0.01; sketch-delta accepted when exact."""
    cfg = parse_run_config(["--stage", "rl", "--optimizer", "logra", "--algorithm",
                            "reinforce", "--responses-per-prompt", "1"], world_size=1)
    lg = cfg.optimizer.logra
    assert (lg.norm_restoration, lg.untargeted, lg.update_factor_dtype) == (
        True, "frozen", "bfloat16")
    assert lg.targets == ("qkv", "proj", "fc1", "fc2") and lg.rank == 256
    assert lg.update_ratio == 6e-5 and (lg.beta2, lg.eps) == (0.95, 1e-8)
    assert (cfg.rl.eval_temperature, cfg.rl.eval_top_p, cfg.rl.failure_reward) == (0.7, 0.7, -0.01)
    assert (cfg.rl.kl.budget, cfg.rl.kl.budget_final, cfg.rl.kl.budget_steps,
            cfg.rl.kl.alpha_max, cfg.rl.kl.probe_responses, cfg.rl.kl.probe_max_tokens) == (
        2e-4, 2e-5, 300, 3.0, 2, 4096)
    off = parse_run_config(["--optimizer", "logra", "--no-logra-norm-restoration",
                            "--logra-update-ratio", "0",
                            "--logra-untargeted", "adam", "--logra-update-factor-dtype",
                            "float32"], world_size=1).optimizer.logra
    assert (off.norm_restoration, off.untargeted, off.update_factor_dtype, off.update_ratio) == (
        False, "adam", "float32", None)
    exact = parse_run_config(["--stage", "rl", "--optimizer", "logra", "--weight-sync",
                              "sketch-delta", "--bf16", "--logra-master-weights", "none",
                              "--rollout-dtype", "bfloat16"], world_size=1)
    assert exact.rl.weight_sync.transport == "sketch-delta"


def test_logra_flags_give_its_config():
    cfg = parse_run_config(["--optimizer", "logra", "--logra-rank", "64", "--logra-targets",
                            "fc1,fc2", "--logra-update-ratio", "6e-5", "--logra-projection",
                            "gaussian", "--bf16", "--logra-master-weights", "none"], world_size=1)
    lg = cfg.optimizer.logra
    assert (lg.rank, lg.targets, lg.update_ratio, lg.projection, lg.master_weights) == (
        64, ("fc1", "fc2"), 6e-5, "gaussian", "none")


def test_logra_refuses_kv_heads_below_tp(tmp_path):
    from megatron_logra.model.tiny_assets import write_tiny_model_dir

    model = write_tiny_model_dir(tmp_path / "kv1", "llama", num_kv_heads=1)
    argv = ["--model-dir", str(model), "--optimizer", "logra", "--tensor-model-parallel-size", "2"]
    with pytest.raises(ConfigError, match=r"num_key_value_heads \(1\) < TP \(2\)"):
        parse_run_config(argv, world_size=2)
    parse_run_config(argv + ["--logra-targets", "proj,fc1,fc2"], world_size=2)


def test_unsupported_model_is_refused_before_training(tmp_path):
    import json

    folder = write_tiny_model_dir(tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_local_experts"] = 4
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        parse_run_config(["--model-dir", str(folder)], world_size=1)


def test_load_of_hf_folder_points_to_the_converter(tmp_path):
    folder = write_tiny_model_dir(tmp_path / "hf")
    with pytest.raises(ConfigError, match="checkpoints_tools.hf_to_megatron"):
        parse_run_config(["--load", str(folder)], world_size=1)


def test_launcher_fails_fast_with_exit_code_2(tmp_path):
    start = time.time()
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "pretrain_rl.py"),
                           "--tensor-model-parallel-size", "2"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={"WORLD_SIZE": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr
    assert "world size 1 is not divisible by TP x PP = 2 x 1" in proc.stderr
    assert "--nproc-per-node" in proc.stderr  # the fix
    assert time.time() - start < 60
    assert not (tmp_path / "runs").exists()  # nothing written


def test_lora_flags_give_its_config():
    cfg = parse_run_config(["--peft", "lora", "--lora-rank", "32", "--lora-alpha", "64",
                            "--lora-dropout", "0.05", "--lora-targets", "qkv,fc2"], world_size=1)
    lo = cfg.optimizer.lora
    assert (cfg.optimizer.peft, lo.rank, lo.alpha, lo.dropout, lo.targets) == (
        "lora", 32, 64.0, 0.05, ("qkv", "fc2"))
    plain = parse_run_config([], world_size=1).optimizer
    assert plain.peft == "none" and plain.lora.rank == 16  # the default, unused

