"""The tiny model's RL-learning protocol, shared by tests/integration/test_rl_learning.py
(LoGRA, in the suite) and benchmarks/learning.py (dense Adam, LoGRA and LoRA, two seeds,
results committed).

The embedded tiny model, warm-started by ``recipes/paper/cpu-sft.yaml`` (60 SFT updates on
gcd), then 30 GRPO updates of 32 prompts x 8 responses with real vLLM rollouts and the
real gcd verifier. Held-out pass@1 on 512 prompts of another data seed x 2 samples at
the rollouts' temperature 1.0, the same prompts and sampling seeds before and after, so
the gain is paired per prompt (``rl.stats.paired_gain``; SE ~0.013-0.021).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from megatron_logra.rl.stats import paired_gain

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch" / "pretrain_rl.py"
COMMON = ["--task", "gcd", "--seq-length", "160"]
UPDATES = 30  # RL updates per run
RL = ["--stage", "rl", "--train-iters", str(UPDATES), "--prompts-per-step", "32",
      "--responses-per-prompt", "8", "--micro-batch-size", "64", "--max-new-tokens", "8",
      "--lr-decay-style", "constant", "--dataset-size", "1500", "--data-seed", "101",
      "--eval-prompts", "512",
      "--eval-samples", "2", "--eval-temperature", "1.0", "--eval-top-p", "1.0",
      "--eval-interval", "0", "--log-interval", "10"]
OPTIMIZERS = {
    "adam": ["--lr", "1e-3"],
    # LoGRA as the paper (q/k/v/o/gate/up/down sketched, the rest frozen, restoration);
    # (norm ratio 6e-2: at 3e-2 one of two seeds gained only 2.6 SE on 256 eval prompts)
    "logra": ["--optimizer", "logra", "--logra-rank", "32", "--logra-update-ratio", "6e-2"],
    # LoRA on the same targets, Adam on the adapters (merged weights pushed to vLLM)
    "lora": ["--peft", "lora", "--lora-rank", "16", "--lora-alpha", "32", "--lr", "3e-3"],
}
SEEDS = {"seed 1": [], "seed 2": ["--seed", "7", "--rollout-seed", "3"]}
# held-out pass@1, paired over the 512 prompts; and more than 3 SE. An unchanged policy
# gains 0; the methods' measured gains are benchmarks/learning.py's (--save learning).
MIN_GAIN = 0.04


def launch(argv: list[str], tmp: Path, timeout: int = 1800) -> None:
    """``launch/pretrain_rl.py ARGV`` in one process; AssertionError with its output tail."""
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1", WANDB_MODE="offline")
    proc = subprocess.run([sys.executable, str(LAUNCH), *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def warm_start(tmp: Path, extra: list[str] = ()) -> Path:
    """The SFT warm start's checkpoint folder (``recipes/paper/cpu-sft.yaml``)."""
    launch(["--config", "recipes/paper/cpu-sft.yaml", "--output-dir", str(tmp / "out"),
            "--save", str(tmp / "ckpt"), *extra], tmp)
    return tmp / "ckpt"


def rl_run(method: str, warm: Path, out: Path, extra: list[str] = ()) -> list[dict]:
    """``UPDATES`` RL updates of ``method`` from ``warm``; the run's metrics records."""
    launch([*COMMON, *RL, *OPTIMIZERS[method], "--load", str(warm), "--finetune",
            "--output-dir", str(out), *extra], out.parent)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def held_out_gain(records: list[dict]) -> dict:
    """pass@1 before and after, and the paired gain with its SE."""
    first, last = records[0], records[-1]
    gain, se = paired_gain(first["eval_prompt_pass"], last["eval_prompt_pass"])
    return {"before": first["eval_pass@1"], "after": last["eval_pass@1"], "gain": gain,
            "se": se, "updates": last["step"]}
