"""Did a run learn? Train reward and held-out pass@1, each gain with its standard error.

    python -m megatron_logra.rl.learning_report RUN_DIR [--require]

Reads the run's metrics.jsonl (``--output-dir``) and prints one JSON object:

- ``train_reward``: mean reward of the last quarter of updates minus the first quarter,
  with the standard error of that difference (Welch, per-update means as the samples);
- ``eval_pass@1``: held-out pass@1 at the last evaluation minus the first, with the
  standard error of the paired per-prompt gain (the same prompts and sampling seeds are
  evaluated every time, so pairing removes the prompts' own difficulty from the noise);
- ``learned``: the train-reward gain is over ``z`` (2) standard errors and pass@1 rose.

``--require`` exits 1 when ``learned`` is false (``make demo`` prints the report only).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_logra.rl.stats import mean_gain, paired_gain
from megatron_logra.training.metrics import read_metrics


def learning_report(records: list[dict], z: float = 2.0) -> dict:
    """The report above from a run's metrics records (an RL run: reward_mean per update,
    eval_pass@1 and eval_prompt_pass at two or more evaluations)."""
    rewards = [r["reward_mean"] for r in records if "reward_mean" in r]
    evals = [r for r in records if "eval_prompt_pass" in r]
    if len(rewards) < 8 or len(evals) < 2:
        raise ValueError(f"{len(rewards)} updates and {len(evals)} evaluations: the report "
                         f"needs at least 8 updates and 2 evaluations (set --eval-interval)")
    quarter = len(rewards) // 4
    gain, se = mean_gain(rewards[:quarter], rewards[-quarter:])
    first, last = evals[0], evals[-1]
    p_gain, p_se = paired_gain(first["eval_prompt_pass"], last["eval_prompt_pass"])
    return {
        "updates": len(rewards),
        "train_reward": {"first_quarter": sum(rewards[:quarter]) / quarter,
                         "last_quarter": sum(rewards[-quarter:]) / quarter,
                         "gain": gain, "se": se},
        "eval_pass@1": {"start": first["eval_pass@1"], "end": last["eval_pass@1"],
                        "start_step": first["step"], "end_step": last["step"],
                        "gain": p_gain, "se": p_se},
        "learned": gain > z * se and last["eval_pass@1"] > first["eval_pass@1"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="the run's --output-dir (holds metrics.jsonl)")
    p.add_argument("--z", type=float, default=2.0,
                   help="standard errors the train-reward gain must exceed")
    p.add_argument("--require", action="store_true", help="exit 1 unless the run learned")
    args = p.parse_args(argv)
    path = args.run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: no metrics.jsonl (pass an RL run's --output-dir)")
    report = learning_report(read_metrics(path), args.z)
    r, e = report["train_reward"], report["eval_pass@1"]
    print(f"train reward: first quarter {r['first_quarter']:.3f} -> last quarter "
          f"{r['last_quarter']:.3f} (gain {r['gain']:+.3f} +- {r['se']:.3f} SE)\n"
          f"held-out pass@1: {e['start']:.3f} (update {e['start_step']}) -> {e['end']:.3f} "
          f"(update {e['end_step']}) (paired gain {e['gain']:+.3f} +- {e['se']:.3f} SE)\n"
          f"learned: {report['learned']}")
    print(json.dumps(report))
    return 0 if report["learned"] or not args.require else 1


if __name__ == "__main__":
    sys.exit(main())
