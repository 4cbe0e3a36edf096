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
``--quick``): ``quality.json`` (per run: every curve, the KL check, the gains and the
provenance of the code that ran it; per method: mean and SD over seeds; per pair of
methods: the paired difference over seeds with its SE), ``quality.md`` and
``quality.png``. Speed and memory are not figures of this benchmark: the diagnostic
hooks cost time and memory, and the runs share the machine (benchmarks/async_rollouts.py
and memory.py measure those). All figures are CPU ones.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _results import write_json, write_text

from megatron_logra.rl.stats import paired_gain
from megatron_logra.training.metrics import read_metrics

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
LABELS = {"dense": "dense Adam", "logra": "LoGRA r=64", "lora": "LoRA r=16",
          "logra-r16": "LoGRA r=16", "logra-r256": "LoGRA r=256",
          "logra-no-mismatch": "LoGRA, budget without the mismatch term",
          "logra-fixed-step": "LoGRA, fixed step (alpha = 1)",
          "logra-async": "LoGRA, generation one step off"}
# the paired differences the report computes (a - b), where both have seeds in common
PAIRS = (("logra", "dense"), ("lora", "dense"), ("logra", "lora"),
         ("logra-r16", "logra"), ("logra-r256", "logra"), ("logra-no-mismatch", "logra"))
# two-sided 95% t quantiles by degrees of freedom (a difference is called only past them)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228}
BUDGET_TOLERANCE = 1e-3  # |predicted / budget - 1| above this: the update missed its budget
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


# --- the report ---------------------------------------------------------------------------
def _sd(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else float("nan")


def _spread(values: list[float]) -> dict:
    """Mean and sample SD (n - 1; NaN for one run) of the runs' values (NaN ones left out)."""
    known = [v for v in values if not math.isnan(v)]
    if not known:
        return {"mean": float("nan"), "sd": float("nan"), "n": 0}
    return {"mean": statistics.fmean(known), "sd": _sd(known), "n": len(known)}


def _eval_se(prompt_pass: list[float]) -> float:
    """One evaluation's standard error: the per-prompt pass rates' SD / sqrt(prompts)."""
    return _sd(prompt_pass) / math.sqrt(len(prompt_pass))


def _run_provenance(run_dir: Path) -> dict:
    """The code that ran this run (its config.json's provenance: commit, clean tree)."""
    path = run_dir / "config.json"
    prov = json.loads(path.read_text()).get("provenance", {}) if path.is_file() else {}
    return {k: prov.get(k) for k in ("commit", "clean", "date")}


def summarize_run(run_dir: Path, method: str, k: int) -> dict | None:
    """One run's curves and figures from its metrics.jsonl (None: no update yet)."""
    path = run_dir / "metrics.jsonl"
    recs = read_metrics(path) if path.is_file() else []
    train = [r for r in recs if "reward_mean" in r]
    evals = [r for r in recs if "eval_pass@1" in r]
    if not train or not evals:
        return None
    run = {"method": method, "updates": train[-1]["step"],
           "provenance": _run_provenance(run_dir),
           "reward": [(r["step"], r["reward_mean"]) for r in train],
           "response_len": [(r["step"], r["response_len"]) for r in train],
           "pass@1": [(r["step"], r["eval_pass@1"]) for r in evals],
           f"pass@{k}": [(r["step"], r[f"eval_pass@{k}"]) for r in evals],
           "eval_se": [(r["step"], _eval_se(r["eval_prompt_pass"])) for r in evals],
           # per update: budget, predicted and realized KL, alpha, K (predicted-KL control)
           "kl": [(r["step"], r.get("kl_budget"), r.get("kl_pred"), r.get("kl_realized"),
                   r.get("alpha"), r.get("kl_quadratic")) for r in train if "kl_pred" in r],
           "adam_cosine": [(r["step"], r["adam_cosine"]) for r in train
                           if "adam_cosine" in r],
           "logprob_mismatch": statistics.fmean(r["logprob_mismatch"] for r in train),
           "kl_mismatch_avg": [(r["step"], r["kl_mismatch_avg"]) for r in train
                               if "kl_mismatch_avg" in r]}
    run["adam_cosine_by_kind"] = {
        kind: statistics.fmean(vals) for kind in ("qkv", "proj", "fc1", "fc2")
        if (vals := [r[f"adam_cosine_{kind}"] for r in train if f"adam_cosine_{kind}" in r])}
    run["adam_cosine_mean"] = (statistics.fmean(c for _, c in run["adam_cosine"])
                               if run["adam_cosine"] else float("nan"))
    # the control's check: every update's predicted KL equals its budget
    run["budget_misses"] = [
        {"update": u, "predicted_over_budget": p / b, "alpha": a, "K": q}
        for u, b, p, _, a, q in run["kl"]
        if b and p is not None and abs(p / b - 1) > BUDGET_TOLERANCE]
    realized = [x for _, _, _, x, _, _ in run["kl"] if x is not None]
    run["kl_realized_sum"] = sum(realized) if realized else float("nan")
    run["start_pass@1"], run["final_pass@1"] = evals[0]["eval_pass@1"], evals[-1]["eval_pass@1"]
    run[f"final_pass@{k}"] = evals[-1][f"eval_pass@{k}"]
    run["gain_pass@1"], run["gain_se"] = paired_gain(evals[0]["eval_prompt_pass"],
                                                     evals[-1]["eval_prompt_pass"])
    quarter = max(len(train) // 4, 1)
    run["reward_gain"] = (statistics.fmean(r["reward_mean"] for r in train[-quarter:])
                          - statistics.fmean(r["reward_mean"] for r in train[:quarter]))
    for key in ("gain_pass@1", "reward_gain"):
        run[f"{key}_per_kl"] = (run[key] / run["kl_realized_sum"]
                                if run["kl_realized_sum"] > 0 else float("nan"))
    return run


def paired_difference(runs: dict, a: str, b: str, key: str = "gain_pass@1") -> dict | None:
    """``a`` minus ``b`` on ``key`` over the seeds both finished: mean, SE (the per-seed
    differences' SD / sqrt(n)), the 95% t bound and whether the difference is called."""
    by_seed = {m: {int(name.rsplit("-s", 1)[1]): r for name, r in runs.items()
                   if r["method"] == m and r["in_summary"]} for m in (a, b)}
    seeds = sorted(set(by_seed[a]) & set(by_seed[b]))
    if len(seeds) < 2:
        return None
    diffs = [by_seed[a][s][key] - by_seed[b][s][key] for s in seeds]
    mean, se = statistics.fmean(diffs), _sd(diffs) / math.sqrt(len(diffs))
    bound = T95.get(len(diffs) - 1, 1.96) * se
    verdict = ("within noise" if abs(mean) <= bound else
               f"{a} ahead" if mean > 0 else f"{a} behind")
    return {"a": a, "b": b, "key": key, "seeds": seeds, "differences": diffs, "mean": mean,
            "se": se, "t95_bound": bound, "verdict": verdict}


def summarize(runs_dir: Path, s: dict, archived: dict | None = None) -> dict:
    """Per run, per method (mean and SD over its finished seeds), per pair of methods.

    ``archived``: the ``runs`` of an earlier results JSON; a run whose folder is gone (a
    fresh clone, another machine) is reported from it, so seeds add up across sittings."""
    k = s["eval_samples"]
    out = {"setup": {key: v for key, v in s.items() if key != "start"}, "runs": {},
           "methods": {}, "pairs": []}
    for name, run in (archived or {}).items():
        if not (runs_dir / name).is_dir() and run.get("method") in METHODS:
            out["runs"][name] = dict(run)
    for run_dir in sorted(runs_dir.glob("*-s*")):
        method, _, seed = run_dir.name.rpartition("-s")
        if method in METHODS and seed.isdigit():
            run = summarize_run(run_dir, method, k)
            if run is not None:
                out["runs"][run_dir.name] = run
    for run in out["runs"].values():
        run["in_summary"] = run["updates"] >= s["updates"]  # finished runs only
    keys = ("gain_pass@1", "gain_se", "start_pass@1", "final_pass@1", f"final_pass@{k}",
            "reward_gain", "kl_realized_sum", "gain_pass@1_per_kl", "reward_gain_per_kl",
            "adam_cosine_mean", "logprob_mismatch")
    for method in METHODS:
        rows = [r for r in out["runs"].values() if r["method"] == method and r["in_summary"]]
        if rows:
            out["methods"][method] = {key: _spread([r[key] for r in rows]) for key in keys}
            out["methods"][method]["seeds"] = len(rows)
            out["methods"][method]["budget_misses"] = sum(len(r["budget_misses"])
                                                          for r in rows)
            out["methods"][method]["updates_checked"] = sum(len(r["kl"]) for r in rows)
    out["pairs"] = [p for a, b in PAIRS if (p := paired_difference(out["runs"], a, b))]
    return out


def write_table(summary: dict, path: Path) -> None:
    write_text(path, markdown(summary) + "\n")


def _pm(v: dict, fmt: str = ".3f") -> str:
    """mean +- SD (the SD left out for one run)."""
    sd = "" if math.isnan(v["sd"]) else f" +- {v['sd']:{fmt.lstrip('+')}}"
    return f"{v['mean']:{fmt}}{sd}"


def markdown(summary: dict) -> str:
    """The per-method table and the paired differences (docs/results.md renders these)."""
    k = summary["setup"]["eval_samples"]
    lines = [f"| method | seeds | pass@1 at start | final pass@1 | pass@1 gain | "
             f"final pass@{k} | train reward gain | realized KL, sum | pass@1 gain per "
             f"unit KL | cosine to dense Adam's step | updates off budget |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for method, m in summary["methods"].items():
        lines.append(
            f"| {LABELS[method]} | {m['seeds']} | {_pm(m['start_pass@1'])} | "
            f"{_pm(m['final_pass@1'])} | {_pm(m['gain_pass@1'], '+.3f')} | "
            f"{_pm(m[f'final_pass@{k}'])} | {_pm(m['reward_gain'], '+.3f')} | "
            f"{_pm(m['kl_realized_sum'])} | {_pm(m['gain_pass@1_per_kl'], '+.2f')} | "
            f"{_pm(m['adam_cosine_mean'])} | {m['budget_misses']} of "
            f"{m['updates_checked']} |")
    if summary["pairs"]:
        lines += ["", "| difference in pass@1 gain | seeds | per seed | mean +- SE | "
                  "95% bound (t) | reading |", "|---|---|---|---|---|---|"]
        for p in summary["pairs"]:
            per_seed = ", ".join(f"{d:+.3f}" for d in p["differences"])
            lines.append(f"| {LABELS[p['a']]} - {LABELS[p['b']]} | "
                         f"{','.join(map(str, p['seeds']))} | {per_seed} | "
                         f"{p['mean']:+.3f} +- {p['se']:.3f} | {p['t95_bound']:.3f} | "
                         f"{p['verdict'].replace(p['a'], LABELS[p['a']])} |")
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    """Train reward and held-out pass@1 per update: each method's mean over its finished
    seeds, shaded +- one SD (the paper's), n in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, ylabel in ((axes[0], "reward", "train reward (mean over the batch)"),
                            (axes[1], "pass@1", "held-out pass@1")):
        for i, method in enumerate(summary["methods"]):
            curves = [dict(r[key]) for r in summary["runs"].values()
                      if r["method"] == method and r["in_summary"]]
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            values = [[c[x] for c in curves] for x in steps]
            mean = [statistics.fmean(v) for v in values]
            sd = [_sd(v) if len(v) > 1 else 0.0 for v in values]
            ax.plot(steps, mean, color=f"C{i}", marker="o" if key == "pass@1" else None,
                    ms=3, label=f"{LABELS[method]} (n = {len(curves)})")
            ax.fill_between(steps, [m - d for m, d in zip(mean, sd)],
                            [m + d for m, d in zip(mean, sd)], color=f"C{i}", alpha=0.15)
        ax.set_xlabel("RL update")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    fig.suptitle("mean over seeds, shaded +- 1 SD", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(runs_dir: Path, s: dict, results: Path, stem: str) -> dict:
    """Write the JSON (with its provenance), the table and the plot of the runs so far."""
    previous = results / f"{stem}.json"
    archived = json.loads(previous.read_text())["runs"] if previous.is_file() else {}
    summary = summarize(runs_dir, s, archived)
    write_json(results / f"{stem}.json", summary)
    write_table(summary, results / f"{stem}.md")
    if summary["methods"]:
        plot(summary, results / f"{stem}.png")
    return summary


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
        report(runs, s, results, stem)
        return 0
    from megatron_logra.runtime.provenance import require_clean

    require_clean(args.allow_dirty, "benchmarks/quality.py")
    ensure_model()
    s["start"] = warm_start(s, runs)
    for seed in s["seeds"]:
        for method in rotated(methods, seed):
            advance(method, seed, s, runs)
            summary = report(runs, s, results, stem)  # after every run: partial results
    print(json.dumps({m: {key: v["mean"] if isinstance(v, dict) else v
                          for key, v in f.items()} for m, f in summary["methods"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
