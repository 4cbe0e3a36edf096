"""Dense Adam vs LoGRA vs LoRA under one control: RL of SmolLM2-135M-Instruct.

    python benchmarks/quality.py                        # the comparison: 3 methods x seeds 1-5
    python benchmarks/quality.py --methods logra-r16,logra-r256 --seeds 1,2,3   # Figure 5(a)
    python benchmarks/quality.py --methods logra-no-mismatch --seeds 1,2        # Figure 6
    python benchmarks/quality.py --quick                # a smoke test of the pipeline (minutes)
    python benchmarks/quality.py --report-only          # the JSON, table and plot again

The control (recipes/quality/_rl.yaml says why each setting is what it is): every method
starts from one shared SFT warm start (SmolLM2 answers no gcd item in the verifier's
format without it), and for one seed every method gets the same prompts, rollout and
evaluation seeds and the same predicted-KL budget per update, with the step scale alpha
never capped below it (``--kl-alpha-max`` far above the alphas taken: every update's
predicted KL equals its budget, which the report checks per update). Rollouts are
generated in bf16, as on GPUs, so the budget's train/rollout mismatch term is live.
Every run logs per update its predicted and realized KL, its cosine to dense Adam's
step from the same gradients (``--log-adam-cosine``), reward and response length.

Each (method, seed) is one ``launch/pretrain_rl.py --stage rl`` run at PP2 on the 2 cores,
from the warm start to ``--updates``, checkpointed every 8 updates: an interrupted
benchmark resumes its runs where they stopped and never reruns a finished one. Seeds run
one after another (so finished runs accumulate), the methods of a seed in turns, in an
order rotated by seed. ``touch RUNS/PAUSE`` holds the benchmark at the next run's start
(to time something else on a quiet machine); removing it lets it go on.

Written to ``--results`` (default ``benchmarks/results``; ``quality-quick*`` with
``--quick``) by ``quality_report.report``: ``quality.json`` (per run: every curve, the KL
check, the gains and the provenance of the code that ran it; per group of methods (the
comparison, rank, step controls): mean and SD over the seeds they share and the paired
differences with their SE), ``quality.md``, ``quality.png`` (the comparison),
``quality-rank.png`` (Figure 5(a)) and ``quality-controls.png`` (Figure 6). Speed and memory are not figures of this benchmark: the diagnostic
hooks cost time and memory, and the runs share the machine (benchmarks/async_rollouts.py
and memory.py measure those). All figures are CPU ones.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from quality_report import report

REPO = Path(__file__).resolve().parents[1]
SMOL, SMOL_CKPT = REPO / "models" / "smollm2-135m-instruct", REPO / "ckpts" / "smollm2"
PY = sys.executable
RECIPES = REPO / "recipes" / "quality"

# method -> (recipe, extra flags; the flags come last, so they override the recipe's)
METHODS = {
    "dense": ("dense", []),
    "logra": ("logra", []),
    "lora": ("lora", []),
    # Figure 5(a), training against rank (with the default r=64)
    "logra-r16": ("logra", ["--logra-rank", "16"]),
    "logra-r256": ("logra", ["--logra-rank", "256"]),
    # Figure 6, step controls (with the default, the paper's control): the budget without
    # the mismatch term, and a fixed step (alpha = 1) whose predicted and realized KL are
    # still measured
    "logra-no-mismatch": ("logra", ["--no-kl-mismatch-adjust"]),
    "logra-fixed-step": ("logra", ["--kl-control", "measure"]),
    # generation one step off, beside training
    "logra-async": ("logra", ["--async-rollouts"]),
}
DEFAULT_METHODS = ("dense", "logra", "lora")
CHECKPOINT_INTERVAL = 8


def recipe_value(name: str, key: str):
    """A key of recipes/quality/NAME.yaml, following its ``defaults``."""
    import yaml

    data = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    if key not in data and "defaults" in data:
        return recipe_value(Path(data["defaults"]).stem, key)
    return data[key]


def _setup(quick: bool) -> dict:
    """The schedule (the same for every method) and ``--quick``'s overrides of the recipes."""
    s = dict(updates=24, seeds=[1, 2, 3, 4, 5], overrides=[],
             warm_start_iters=recipe_value("warm-start", "train-iters"),
             **{key.replace("-", "_"): recipe_value("_rl", key) for key in (
                 "task", "reward", "prompts-per-step", "responses-per-prompt",
                 "eval-prompts", "eval-samples", "eval-interval", "kl-budget",
                 "rollout-dtype", "kl-alpha-max", "kl-probe-responses")})
    if quick:
        s.update(updates=2, seeds=[1], warm_start_iters=0, eval_samples=2, eval_prompts=8,
                 prompts_per_step=8, eval_interval=1,
                 overrides=["--prompts-per-step", "8", "--eval-prompts", "8",
                            "--eval-samples", "2", "--eval-interval", "1"])
    return s


def _torchrun() -> list[str]:
    return [str(Path(PY).with_name("torchrun")), "--standalone", "--nproc-per-node", "2",
            "launch/pretrain_rl.py"]


def _run(cmd: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"failed (exit {proc.returncode}): {' '.join(cmd)}; see {log}")


def ensure_model() -> None:
    """SmolLM2 as an HF folder and a megatron checkpoint (what ``make demo`` makes)."""
    if not (SMOL / "model.safetensors").is_file():
        _run([PY, "-m", "checkpoints_tools.smollm2_from_gguf", "--out", str(SMOL)],
             REPO / "runs" / "quality-setup.log")
    if not (SMOL_CKPT / "latest").exists():
        _run([PY, "-m", "checkpoints_tools.hf_to_megatron", "--hf-dir", str(SMOL), "--out",
              str(SMOL_CKPT), "--dtype", "fp32"], REPO / "runs" / "quality-setup.log")


def _done(run_dir: Path) -> int:
    """Updates this run has finished and checkpointed (0: not started)."""
    latest = run_dir / "ckpt" / "latest"
    if not latest.is_file():
        return 0
    return int(latest.read_text().strip().removeprefix("iter_"))


def warm_start(s: dict, runs: Path) -> Path:
    """The shared SFT warm start (recipes/quality/warm-start.yaml): done once, reused by
    every method and seed; SmolLM2 itself with ``warm_start_iters`` 0."""
    if not s["warm_start_iters"]:
        return SMOL_CKPT
    run_dir = runs / "warm-start"
    if _done(run_dir) < s["warm_start_iters"]:
        print(f"[quality] SFT warm start: {s['warm_start_iters']} updates", flush=True)
        _run([*_torchrun(), "--config", str(RECIPES / "warm-start.yaml"),
              "--output-dir", str(run_dir), "--save", str(run_dir / "ckpt")],
             run_dir / "train.log")
    return run_dir / "ckpt"


def wait_while_paused(runs: Path) -> None:
    """Between runs: wait while ``RUNS/PAUSE`` exists (``touch`` it to free the machine for
    a timed benchmark or the test suite without stopping a run halfway; remove it to go on)."""
    pause = runs / "PAUSE"
    if pause.exists():
        print(f"[quality] paused: waiting for {pause} to be removed", flush=True)
        while pause.exists():
            time.sleep(10)
        print("[quality] going on", flush=True)


def advance(method: str, seed: int, s: dict, runs: Path) -> None:
    """Run (method, seed) to ``s["updates"]``, resuming its checkpoint if it has one."""
    run_dir = runs / f"{method}-s{seed}"
    done = _done(run_dir)
    if done >= s["updates"]:
        return
    wait_while_paused(runs)
    start = (["--load", str(run_dir / "ckpt")] if done else
             ["--load", str(s["start"]), "--finetune"])
    recipe, extra = METHODS[method]
    cmd = [*_torchrun(), "--config", str(RECIPES / f"{recipe}.yaml"), *start,
           "--train-iters", str(s["updates"]), "--seed", str(seed), "--rollout-seed",
           str(seed), "--output-dir", str(run_dir), "--save", str(run_dir / "ckpt"),
           "--save-interval", str(min(CHECKPOINT_INTERVAL, s["updates"])), *s["overrides"],
           *extra]
    print(f"[quality] {method} seed {seed}: updates {done} -> {s['updates']}", flush=True)
    _run(cmd, run_dir / "train.log")


def rotated(methods: list[str], seed: int) -> list[str]:
    """The methods in the order seed ``seed`` runs them (rotated by seed: none always first)."""
    k = seed % len(methods)
    return methods[k:] + methods[:k]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke test: 2 updates, 1 seed")
    p.add_argument("--runs", default=None, help="where the runs go (default runs/quality[-quick])")
    p.add_argument("--results", default=None,
                   help="where the JSON, PNG and table go (default benchmarks/results)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma list of methods to run, from {', '.join(METHODS)} (default "
                        f"%(default)s); the report covers every method with runs")
    p.add_argument("--seeds", default=None, help="comma list of seeds (default 1,2,3,4,5)")
    p.add_argument("--updates", type=int, default=None,
                   help="RL updates per run (default 24); with a fresh --runs and --results")
    p.add_argument("--report-only", action="store_true",
                   help="write the JSON, table and plot from the runs there are (and those "
                        "archived in the results JSON); run nothing")
    p.add_argument("--allow-dirty", action="store_true",
                   help="run from a tree with uncommitted changes (its results record that "
                        "they are not from a commit; the docs do not cite them)")
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        p.error(f"--methods {args.methods!r}: choose from {', '.join(METHODS)}")
    s = _setup(args.quick)
    if args.seeds:
        try:
            s["seeds"] = [int(x) for x in args.seeds.split(",")]
        except ValueError:
            p.error(f"--seeds {args.seeds!r}: give integers, e.g. 1,2")
    if args.updates is not None:
        if args.updates < 1:
            p.error(f"--updates {args.updates} must be >= 1")
        s["updates"] = args.updates
    suffix = "-quick" if args.quick else ""
    runs = Path(args.runs or REPO / "runs" / f"quality{suffix}")
    results = Path(args.results or REPO / "benchmarks" / "results")
    stem = f"quality{suffix}"
    if args.report_only:
        report(runs, s, tuple(METHODS), results, stem)
        return 0
    from megatron_logra.runtime.provenance import require_clean

    require_clean(args.allow_dirty, "benchmarks/quality.py")
    ensure_model()
    s["start"] = warm_start(s, runs)
    for seed in s["seeds"]:
        for method in rotated(methods, seed):
            advance(method, seed, s, runs)
            summary = report(runs, s, tuple(METHODS), results, stem)  # partial results
    print(json.dumps({name: {m: f["gain_pass@1"]["mean"] for m, f in g["methods"].items()}
                      for name, g in summary["groups"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
