"""Dense Adam vs LoGRA vs LoRA, side by side: RL of SmolLM2-135M-Instruct (the paper's Table 1/2).

    python benchmarks/quality.py            # the full comparison (hours on 2 CPU cores)
    python benchmarks/quality.py --quick    # a smoke test of the same pipeline (minutes)
    python benchmarks/quality.py --report-only   # redraw the table and plot, run nothing

Every method trains from the same start (SmolLM2 after a shared SFT warm start that
teaches the answer format) on the same task, prompts per update, rollout seeds and
predicted-KL budget per update; each (method, seed) is one ``launch/pretrain_rl.py
--stage rl`` run at PP2 on the 2 cores. The runs advance in
rounds of ``--round`` updates, method after method (so machine noise hits all alike),
each round resuming the run's own checkpoint: an interrupted benchmark continues where
it stopped when started again, and finished runs are not rerun.

Written to ``--results`` (default ``benchmarks/results``, ``quality-quick*`` with
``--quick``): ``quality.json`` (every figure per run and the summary per method),
``quality.png`` (train reward and held-out pass@1 per update, mean and range over seeds)
and ``quality.md`` (a table shaped like the paper's: memory per rank, seconds per update,
updates per hour, peak pass@1 and pass@k with the seed spread). All figures are CPU ones.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from megatron_logra.rl.stats import paired_gain
from megatron_logra.training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
SMOL, SMOL_CKPT = REPO / "models" / "smollm2-135m-instruct", REPO / "ckpts" / "smollm2"
PY = sys.executable

RECIPES = REPO / "recipes" / "quality"
# the paper's methods at this scale, each a recipe (recipes/quality/*.yaml say why their
# settings are what they are) plus extra flags: dense Adam and LoRA (Adam on the adapters)
# with the same predicted-KL control as LoGRA, so all three take steps of the same
# predicted size
METHODS = {
    "dense": ("dense", []),
    "logra": ("logra", []),
    "lora": ("lora", []),
    # variants (run with --methods; their flags come last on the command line, so they
    # override the recipe's): the reference's rank, r=256 (the demo's r=64 is the
    # default above), twice the KL budget per update, and alpha at most 1 (the controller
    # may shrink LoGRA's step, never stretch it: LoGRA's KL overshoots, 45x and 81x, came
    # from steps stretched by alpha 2.25 and 1.37 off a small K); what closes a gap to
    # dense Adam (docs/results.md)
    "logra-r256": ("logra", ["--logra-rank", "256"]),
    "logra-kl2x": ("logra", ["--kl-budget", "2e-2", "--kl-budget-final", "2e-2"]),
    "logra-amax1": ("logra", ["--kl-alpha-max", "1"]),
    # Figure 5(a), training against rank (with logra-r256 and the default r=64)
    "logra-r16": ("logra", ["--logra-rank", "16"]),
    # Figure 6, step controls (with the default, the paper's control): the budget without
    # the mismatch adjustment, and a fixed step: the norm-ratio step alone (6e-5: the
    # controlled runs' alpha is ~1 at this budget, 0.4-1.6 on seed 3's first updates)
    "logra-no-mismatch": ("logra", ["--no-kl-mismatch-adjust"]),
    # a fixed step (alpha = 1) whose predicted and realized KL are still measured (Figure 6)
    "logra-fixed-step": ("logra", ["--kl-control", "measure"]),
    # generation one step off, beside training (issue 39's learning curve against logra)
    "logra-async": ("logra", ["--async-rollouts"]),
}
DEFAULT_METHODS = ("dense", "logra", "lora")


def recipe_value(name: str, key: str):
    """A key of recipes/quality/NAME.yaml, following its ``defaults``."""
    import yaml

    data = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    if key not in data and "defaults" in data:
        return recipe_value(Path(data["defaults"]).stem, key)
    return data[key]


def _setup(quick: bool) -> dict:
    """The schedule (the same for every method) and the command-line overrides of
    ``--quick`` on top of the recipes."""
    s = dict(updates=24, round=8, seeds=[1, 2, 3],
             warm_start_iters=recipe_value("warm-start", "train-iters"), overrides=[],
             **{key.replace("-", "_"): recipe_value("_rl", key) for key in (
                 "task", "reward", "prompts-per-step", "responses-per-prompt",
                 "eval-samples")})
    if quick:
        s.update(updates=2, round=1, seeds=[1], warm_start_iters=0, eval_samples=2,
                 prompts_per_step=8,
                 overrides=["--prompts-per-step", "8", "--eval-prompts", "8",
                            "--eval-samples", "2", "--eval-interval", "1"])
    return s


def warm_start(s: dict, runs: Path) -> Path:
    """The shared SFT warm start (recipes/quality/warm-start.yaml): done once, reused by
    every method and seed; SmolLM2 itself with ``warm_start_iters`` 0."""
    if not s["warm_start_iters"]:
        return SMOL_CKPT
    ckpt = runs / "warm-start" / "ckpt"
    if _done(runs / "warm-start") < s["warm_start_iters"]:
        print(f"[quality] SFT warm start: {s['warm_start_iters']} updates", flush=True)
        _run([str(Path(PY).with_name("torchrun")), "--standalone", "--nproc-per-node", "2",
              "launch/pretrain_rl.py", "--config", str(RECIPES / "warm-start.yaml"),
              "--output-dir", str(runs / "warm-start"), "--save", str(ckpt)],
             runs / "warm-start" / "train.log")
    return ckpt


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


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return read_metrics(path) if path.is_file() else []


def _done(run_dir: Path) -> int:
    """Updates this run has finished and checkpointed (0: not started)."""
    latest = run_dir / "ckpt" / "latest"
    if not latest.is_file():
        return 0
    return int(latest.read_text().strip().removeprefix("iter_"))


def advance(method: str, seed: int, until: int, s: dict, runs: Path) -> None:
    """Run (method, seed) up to ``until`` updates, resuming its checkpoint if it has one."""
    run_dir = runs / f"{method}-s{seed}"
    done = _done(run_dir)
    if done >= until:
        return
    start = (["--load", str(run_dir / "ckpt")] if done else
             ["--load", str(s["start"]), "--finetune"])
    recipe, extra = METHODS[method]
    cmd = [str(Path(PY).with_name("torchrun")), "--standalone", "--nproc-per-node", "2",
           "launch/pretrain_rl.py", "--config", str(RECIPES / f"{recipe}.yaml"), *start,
           "--train-iters", str(until), "--seed", str(seed), "--rollout-seed", str(seed),
           "--output-dir", str(run_dir), "--save", str(run_dir / "ckpt"),
           "--save-interval", str(s["round"]), *s["overrides"], *extra]
    print(f"[quality] {method} seed {seed}: updates {done} -> {until}", flush=True)
    _run(cmd, run_dir / "train.log")


def _seeds_run(runs: Path, method: str) -> list[int]:
    """The seeds of ``method`` that have a run folder under ``runs``."""
    prefix = f"{method}-s"
    return sorted(int(d.name[len(prefix):]) for d in runs.glob(f"{prefix}*")
                  if d.name[len(prefix):].isdigit())


def _mean_of(records: list[dict], key: str) -> float:
    """Mean of ``key`` over the records that have it (NaN if none: older runs)."""
    values = [r[key] for r in records if key in r]
    return sum(values) / len(values) if values else float("nan")


def _spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (n - 1; NaN for one run), min and max over the runs
    that have the figure (NaN: a run without it)."""
    known = [v for v in values if not math.isnan(v)] or [float("nan")]
    mean = sum(known) / len(known)
    sd = (math.sqrt(sum((v - mean) ** 2 for v in known) / (len(known) - 1))
          if len(known) > 1 else float("nan"))
    return {"mean": mean, "sd": sd, "min": min(known), "max": max(known)}


def summarize(runs: Path, s: dict, archived: dict | None = None) -> dict:
    """Per run: curves and figures; per method: mean and range over seeds.

    ``archived``: the ``runs`` of an earlier results JSON; a run found there whose folder
    is gone (another machine, a fresh clone) is reported from it, so new seeds add to
    the old ones instead of replacing them."""
    # the seeds are each method's own (the run folders found), not the setup's
    out = {"setup": {k: v for k, v in s.items() if k not in ("start", "seeds")}, "runs": {},
           "methods": {}}
    k = s["eval_samples"]
    archived = archived or {}
    for method in METHODS:
        rows = []
        kept = [name for name, run in archived.items() if run["method"] == method
                and not (runs / name).is_dir()]
        for name in kept:
            run = dict(archived[name], in_summary=False)
            out["runs"][name] = run
            rows.append(run)
        for seed in _seeds_run(runs, method):
            recs = _records(runs / f"{method}-s{seed}")
            train = [r for r in recs if "reward_mean" in r]
            evals = [r for r in recs if "eval_pass@1" in r]
            if not train:
                continue
            run = {"reward": [(r["step"], r["reward_mean"]) for r in train],
                   "pass@1": [(r["step"], r["eval_pass@1"]) for r in evals],
                   f"pass@{k}": [(r["step"], r[f"eval_pass@{k}"]) for r in evals],
                   "seconds_per_update": sum(r["step_time_s"] for r in train) / len(train),
                   # its parts (the KL probe is inside train; evaluations are not counted)
                   **{f"{part}_s": sum(r[f"{part}_time_s"] for r in train) / len(train)
                      for part in ("rollout", "train", "sync")},
                   "kl_probe_s": _mean_of(train, "kl_probe_time_s"),
                   "updates_per_hour": 3600 * len(train) / sum(r["step_time_s"] for r in train),
                   "peak_mem_gib": max(r["peak_mem_bytes"] for r in train) / 2**30,
                   "avg_mem_gib": sum(r["peak_mem_bytes"] for r in train) / len(train) / 2**30,
                   "sync_mb_per_update": sum(r["sync_bytes"] for r in train) / len(train) / 1e6,
                   "updates": train[-1]["step"]}
            # KL: per update predicted and realized (where the control measured it), and
            # the held-out gain per unit of realized KL (the "where LoGRA trails" figure)
            run["kl"] = [(r["step"], r.get("kl_pred"), r.get("kl_realized")) for r in train
                         if "kl_realized" in r]
            run["kl_realized_sum"] = sum(x for _, _, x in run["kl"]) if run["kl"] else \
                float("nan")
            run["response_len"] = [(r["step"], r["response_len"]) for r in train
                                   if "response_len" in r]
            run["peak_pass@1"] = max(v for _, v in run["pass@1"])
            run[f"peak_pass@{k}"] = max(v for _, v in run[f"pass@{k}"])
            run["start_pass@1"] = run["pass@1"][0][1]
            # held-out pass@1, last evaluation minus the first, paired over the eval prompts
            if "eval_prompt_pass" in evals[0]:
                run["gain_pass@1"], run["gain_se"] = paired_gain(evals[0]["eval_prompt_pass"],
                                                                 evals[-1]["eval_prompt_pass"])
            else:  # runs from before per-prompt pass rates were logged
                run["gain_pass@1"] = evals[-1]["eval_pass@1"] - evals[0]["eval_pass@1"]
                run["gain_se"] = float("nan")
            run["gain_per_kl"] = run["gain_pass@1"] / run["kl_realized_sum"] \
                if run["kl"] and run["kl_realized_sum"] > 0 else float("nan")
            run["method"], run["in_summary"] = method, False
            out["runs"][f"{method}-s{seed}"] = run
            rows.append(run)
        # a method's figures come from its finished runs (while none is, from its longest)
        if rows:
            longest = max(r["updates"] for r in rows)
            rows = [r for r in rows if r["updates"] >= min(longest, s["updates"])]
        for run in rows:
            run["in_summary"] = True
        if rows:
            for run in rows:  # runs archived before these were figures of their own
                run.setdefault("updates_per_hour", 3600 / run["seconds_per_update"])
                run.setdefault("kl_realized_sum", float("nan"))
                run.setdefault("gain_per_kl", float("nan"))
            keys = ("seconds_per_update", "updates_per_hour", "rollout_s", "train_s",
                    "kl_probe_s", "sync_s",
                    "peak_mem_gib", "avg_mem_gib", "sync_mb_per_update", "peak_pass@1",
                    f"peak_pass@{k}", "start_pass@1", "gain_pass@1", "gain_se",
                    "kl_realized_sum", "gain_per_kl")
            out["methods"][method] = {key: _spread([r[key] for r in rows]) for key in keys}
            out["methods"][method]["seeds"] = len(rows)
            out["methods"][method]["updates"] = min(r["updates"] for r in rows)
    return out


def _seconds(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"  # NaN: runs from before it was timed


def write_table(summary: dict, path: Path) -> None:
    k = summary["setup"]["eval_samples"]
    lines = [f"| method | seeds | updates | avg / peak memory per rank (GiB) | s / update "
             f"(rollout + train + sync) | KL probe s (in train) | updates / h | sync MB / "
             f"update | peak pass@1 | peak pass@{k} | pass@1 at start | pass@1 gain (SE) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for method, m in summary["methods"].items():
        def spread(key: str, fmt: str = ".3f") -> str:
            """mean +- sample SD (as the paper's tables), one run: its value alone"""
            v = m[key]
            sd = ("" if math.isnan(v.get("sd", float("nan")))
                  else f" +- {v['sd']:{fmt.replace('+', '')}}")
            return f"{v['mean']:{fmt}}{sd}"
        lines.append(f"| {method} | {m['seeds']} | {m['updates']} | "
                     f"{spread('avg_mem_gib', '.2f')} / {spread('peak_mem_gib', '.2f')} | "
                     f"{m['seconds_per_update']['mean']:.1f} ({m['rollout_s']['mean']:.1f} + "
                     f"{m['train_s']['mean']:.1f} + {m['sync_s']['mean']:.1f}) | "
                     f"{_seconds(m['kl_probe_s']['mean'])} | "
                     f"{spread('updates_per_hour', '.0f')} | "
                     f"{m['sync_mb_per_update']['mean']:.1f} | {spread('peak_pass@1')} | "
                     f"{spread(f'peak_pass@{k}')} | {spread('start_pass@1')} | "
                     f"{spread('gain_pass@1', '+.3f')} ({m['gain_se']['mean']:.3f}) |")
    s = summary["setup"]
    lines += ["", f"SmolLM2-135M-Instruct, RL on `{s['task']}` ({s['reward']} reward), "
              f"{s['prompts_per_step']} prompts x {s['responses_per_prompt']} responses per update, PP2 on 2 "
              f"CPU cores; memory: the peak RSS of rank 0's trainer process (stage 0; the "
              f"rollout engine is another process), whatever held it (activations, "
              f"optimizer state, weight-sync buffers); seconds: the mean over all "
              f"updates; figures are the mean +- sample SD over the seeds whose runs "
              f"finished (as the paper's Tables 1 and 2; a variant with none finished: its "
              f"longest runs; one run: its value); pass@1 gain: last evaluation minus the "
              f"first, its SE from the paired per-prompt differences (mean over seeds). "
              f"CPU figures, measured by `benchmarks/quality.py`."]
    path.write_text("\n".join(lines) + "\n")


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "reward", "train reward (mean)"),
                           (axes[1], "pass@1", "held-out pass@1")):
        for method in summary["methods"]:
            curves = [r[key] for name, r in summary["runs"].items()
                      if r["method"] == method and r["in_summary"]]
            steps = sorted(set.intersection(*(set(x for x, _ in c) for c in curves)))
            values = [[dict(c)[x] for c in curves] for x in steps]
            mean = [sum(v) / len(v) for v in values]
            line, = ax.plot(steps, mean, label=method)
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values],
                            color=line.get_color(), alpha=0.2)
        ax.set_title(title)
        ax.set_xlabel("update")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke test: 2 updates, 1 seed")
    p.add_argument("--runs", default=None, help="where the runs go (default runs/quality[-quick])")
    p.add_argument("--results", default=None,
                   help="where the JSON, PNG and table go (default benchmarks/results)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma list of methods to run, from {', '.join(METHODS)} (default "
                        f"%(default)s); the report covers every method with runs")
    p.add_argument("--seeds", default=None,
                   help="comma list of seeds (default: the setup's, 1,2,3: the paper's n = 3)")
    p.add_argument("--updates", type=int, default=None,
                   help="RL updates per run (default: the setup's, 24); with a fresh --runs "
                        "and --results, e.g. a short throughput measurement")
    p.add_argument("--report-only", action="store_true",
                   help="write the JSON, table and plot from the runs there are (and those "
                        "archived in the results JSON); run nothing")
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
        s["round"] = min(s["round"], args.updates)
    suffix = "-quick" if args.quick else ""
    runs = Path(args.runs or REPO / "runs" / f"quality{suffix}")
    results = Path(args.results or REPO / "benchmarks" / "results")
    stem = f"quality{suffix}"
    if args.report_only:
        report(runs, s, results, stem)
        return 0
    ensure_model()
    s["start"] = warm_start(s, runs)
    for until in range(s["round"], s["updates"] + 1, s["round"]):
        for seed in s["seeds"]:
            for method in methods:
                advance(method, seed, until, s, runs)
        summary = report(runs, s, results, stem)  # after every round: partial results
    print(json.dumps({m: {k: v["mean"] if isinstance(v, dict) else v for k, v in f.items()}
                      for m, f in summary["methods"].items()}))
    return 0


def report(runs: Path, s: dict, results: Path, stem: str) -> dict:
    """Write the JSON, table and plot of the runs as they stand."""
    previous = results / f"{stem}.json"
    archived = json.loads(previous.read_text())["runs"] if previous.is_file() else {}
    summary = summarize(runs, s, archived)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{stem}.json").write_text(json.dumps(summary, indent=1) + "\n")
    write_table(summary, results / f"{stem}.md")
    plot(summary, results / f"{stem}.png")
    return summary


if __name__ == "__main__":
    sys.exit(main())
