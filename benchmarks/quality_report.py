"""The quality benchmark's report: per run, per method, paired differences, tables and plots.

``report(runs_dir, setup, results, stem)`` reads every run folder's metrics.jsonl and
config.json (the provenance of the code that ran it) and writes STEM.json (with the
report's own provenance), STEM.md and the plots; the docs render their tables from
STEM.json with the ``markdown*`` functions here (benchmarks/render_docs.py).

Three groups of runs, each compared on the seeds all its methods finished:
- ``comparison``: dense Adam, LoGRA, LoRA (the controlled comparison);
- ``rank``: LoGRA at r = 16, 64, 256 (Figure 5(a));
- ``controls``: LoGRA with the paper's control, without its mismatch term, with a
  fixed step (Figure 6).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from _results import write_json, write_text

from megatron_logra.rl.stats import paired_gain
from megatron_logra.training.metrics import read_metrics

LABELS = {"dense": "dense Adam", "logra": "LoGRA r=64", "lora": "LoRA r=16",
          "logra-r16": "LoGRA r=16", "logra-r256": "LoGRA r=256",
          "logra-no-mismatch": "LoGRA, budget without the mismatch term",
          "logra-fixed-step": "LoGRA, fixed step (alpha = 1)",
          "logra-async": "LoGRA, generation one step off"}
# group -> (its methods, the reference the others are paired against, pairs besides)
GROUPS = {
    "comparison": (("dense", "logra", "lora"),
                   (("logra", "dense"), ("lora", "dense"), ("logra", "lora"))),
    "rank": (("logra-r16", "logra", "logra-r256"),
             (("logra-r16", "logra"), ("logra-r256", "logra"))),
    "controls": (("logra", "logra-no-mismatch", "logra-fixed-step"),
                 (("logra-no-mismatch", "logra"), ("logra-fixed-step", "logra"))),
}
# two-sided 95% t quantiles by degrees of freedom (a difference is called only past them)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228}
BUDGET_TOLERANCE = 1e-3  # |predicted / budget - 1| above this: the update missed its budget
KINDS = ("qkv", "proj", "fc1", "fc2")


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


def _seed(name: str) -> int:
    return int(name.rpartition("-s")[2])


def summarize_run(run_dir: Path, method: str, k: int) -> dict | None:
    """One run's curves and figures from its metrics.jsonl (None: no update yet)."""
    path = run_dir / "metrics.jsonl"
    recs = read_metrics(path) if path.is_file() else []
    train = [r for r in recs if "reward_mean" in r]
    evals = [r for r in recs if "eval_pass@1" in r]
    if not train or not evals:
        return None
    # the cosine's shadow Adam state is not checkpointed: after a resume it restarts empty
    # (adam_cosine_history < step); only updates whose shadow saw every gradient count
    whole_shadow = [r for r in train if "adam_cosine" in r
                    and r.get("adam_cosine_history") == r["step"]]
    run = {"method": method, "seed": _seed(run_dir.name), "updates": train[-1]["step"],
           "provenance": _run_provenance(run_dir),
           "reward": [(r["step"], r["reward_mean"]) for r in train],
           "response_len": [(r["step"], r["response_len"]) for r in train],
           "pass@1": [(r["step"], r["eval_pass@1"]) for r in evals],
           f"pass@{k}": [(r["step"], r[f"eval_pass@{k}"]) for r in evals],
           "eval_se": [(r["step"], _eval_se(r["eval_prompt_pass"])) for r in evals],
           # per update: budget, predicted and realized KL, alpha, K (predicted-KL control)
           "kl": [(r["step"], r.get("kl_budget"), r.get("kl_pred"), r.get("kl_realized"),
                   r.get("alpha"), r.get("kl_quadratic")) for r in train if "kl_pred" in r],
           "kl_mismatch_avg": [(r["step"], r["kl_mismatch_avg"]) for r in train
                               if "kl_mismatch_avg" in r],
           "logprob_mismatch": statistics.fmean(r["logprob_mismatch"] for r in train),
           "adam_cosine": [(r["step"], r["adam_cosine"]) for r in whole_shadow]}
    run["adam_cosine_by_kind"] = {
        kind: statistics.fmean(vals) for kind in KINDS
        if (vals := [r[f"adam_cosine_{kind}"] for r in whole_shadow
                     if f"adam_cosine_{kind}" in r])}
    run["adam_cosine_mean"] = (statistics.fmean(c for _, c in run["adam_cosine"])
                               if run["adam_cosine"] else float("nan"))
    # the control's check: every update's predicted KL equals its budget
    run["budget_misses"] = [
        {"update": u, "predicted_over_budget": p / b, "alpha": a, "K": q}
        for u, b, p, _, a, q in run["kl"]
        if b and p is not None and abs(p / b - 1) > BUDGET_TOLERANCE]
    budgets = [b for _, b, _, _, _, _ in run["kl"] if b is not None]
    run["kl_budget_mean"] = statistics.fmean(budgets) if budgets else float("nan")
    realized = [x for _, _, _, x, _, _ in run["kl"] if x is not None]
    run["kl_realized_sum"] = sum(realized) if realized else float("nan")
    run["kl_realized_over_pred_max"] = max(
        (x / p for _, _, p, x, _, _ in run["kl"] if p and x is not None), default=float("nan"))
    run["start_pass@1"], run["final_pass@1"] = evals[0]["eval_pass@1"], evals[-1]["eval_pass@1"]
    run[f"final_pass@{k}"] = evals[-1][f"eval_pass@{k}"]
    run["gain_pass@1"], run["gain_se"] = paired_gain(evals[0]["eval_prompt_pass"],
                                                     evals[-1]["eval_prompt_pass"])
    quarter = max(len(train) // 4, 1)
    run["reward_gain"] = (statistics.fmean(r["reward_mean"] for r in train[-quarter:])
                          - statistics.fmean(r["reward_mean"] for r in train[:quarter]))
    run["final_response_len"] = statistics.fmean(r["response_len"] for r in train[-quarter:])
    for key in ("gain_pass@1", "reward_gain"):
        run[f"{key}_per_kl"] = (run[key] / run["kl_realized_sum"]
                                if run["kl_realized_sum"] > 0 else float("nan"))
    return run


def paired_difference(by_seed: dict, a: str, b: str, seeds: list[int],
                      key: str = "gain_pass@1") -> dict:
    """``a`` minus ``b`` on ``key`` over ``seeds``: mean, SE (the per-seed differences' SD /
    sqrt(n)), the 95% t bound and whether the difference is called."""
    diffs = [by_seed[a][s][key] - by_seed[b][s][key] for s in seeds]
    mean, se = statistics.fmean(diffs), _sd(diffs) / math.sqrt(len(diffs))
    bound = T95.get(len(diffs) - 1, 1.96) * se
    verdict = ("within noise" if abs(mean) <= bound else "ahead" if mean > 0 else "behind")
    return {"a": a, "b": b, "key": key, "seeds": seeds, "differences": diffs, "mean": mean,
            "se": se, "t95_bound": bound, "verdict": verdict}


STATS = ("gain_pass@1", "gain_se", "start_pass@1", "final_pass@1", "reward_gain",
         "kl_realized_sum", "kl_realized_over_pred_max", "kl_budget_mean",
         "gain_pass@1_per_kl", "reward_gain_per_kl", "adam_cosine_mean", "logprob_mismatch",
         "final_response_len")


def summarize_group(runs: dict, methods: tuple[str, ...], pairs: tuple, k: int) -> dict | None:
    """The group's methods on the seeds every method with runs has finished (None: fewer
    than two methods or no seed in common)."""
    by_seed = {m: {r["seed"]: r for r in runs.values() if r["method"] == m and r["in_summary"]}
               for m in methods}
    present = [m for m in methods if by_seed[m]]
    seeds = sorted(set.intersection(*(set(by_seed[m]) for m in present))) if present else []
    if len(present) < 2 or not seeds:
        return None
    out = {"seeds": seeds, "methods": {}, "pairs": []}
    for m in present:
        rows = [by_seed[m][s] for s in seeds]
        out["methods"][m] = {key: _spread([r[key] for r in rows])
                             for key in (*STATS, f"final_pass@{k}")}
        out["methods"][m]["budget_misses"] = sum(len(r["budget_misses"]) for r in rows)
        out["methods"][m]["updates_checked"] = sum(len(r["kl"]) for r in rows)
    if len(seeds) > 1:
        out["pairs"] = [paired_difference(by_seed, a, b, seeds) for a, b in pairs
                        if a in present and b in present]
    return out


def summarize(runs_dir: Path, setup: dict, methods: tuple[str, ...],
              archived: dict | None = None) -> dict:
    """Per run, and per group of runs (``GROUPS``) on the seeds its methods share.

    ``archived``: the ``runs`` of an earlier results JSON; a run whose folder is gone (a
    fresh clone, another machine) is reported from it, so seeds add up across sittings."""
    k = setup["eval_samples"]
    out = {"setup": {key: v for key, v in setup.items() if key != "start"}, "runs": {},
           "groups": {}}
    for name, run in (archived or {}).items():
        if not (runs_dir / name).is_dir() and run.get("method") in methods:
            out["runs"][name] = dict(run)
    for run_dir in sorted(runs_dir.glob("*-s*")):
        method, _, seed = run_dir.name.rpartition("-s")
        if method in methods and seed.isdigit():
            run = summarize_run(run_dir, method, k)
            if run is not None:
                out["runs"][run_dir.name] = run
    for run in out["runs"].values():
        run["in_summary"] = run["updates"] >= setup["updates"]  # finished runs only
    for name, (group_methods, pairs) in GROUPS.items():
        group = summarize_group(out["runs"], group_methods, pairs, k)
        if group is not None:
            out["groups"][name] = group
    return out


# --- tables -------------------------------------------------------------------------------
def _pm(v: dict, fmt: str = ".3f") -> str:
    """mean +- SD (the SD left out for one run)."""
    if math.isnan(v["mean"]):
        return "-"
    sd = "" if math.isnan(v["sd"]) else f" +- {v['sd']:{fmt.lstrip('+')}}"
    return f"{v['mean']:{fmt}}{sd}"


def _pairs_table(pairs: list[dict]) -> list[str]:
    lines = ["| difference in held-out pass@1 gain | seeds | per seed | mean +- SE | "
             "95% bound (t) | reading |", "|---|---|---|---|---|---|"]
    for p in pairs:
        per_seed = ", ".join(f"{d:+.3f}" for d in p["differences"])
        reading = ("within noise" if p["verdict"] == "within noise" else
                   f"{LABELS[p['a']]} {p['verdict']}")
        lines.append(f"| {LABELS[p['a']]} - {LABELS[p['b']]} | "
                     f"{','.join(map(str, p['seeds']))} | {per_seed} | "
                     f"{p['mean']:+.3f} +- {p['se']:.3f} | {p['t95_bound']:.3f} | {reading} |")
    return lines


def _group_table(summary: dict, name: str) -> str:
    group = summary["groups"].get(name)
    if group is None:
        return f"(no finished runs of this group yet: {', '.join(GROUPS[name][0])})"
    k = summary["setup"]["eval_samples"]
    seeds = group["seeds"]
    head = (f"Seeds {', '.join(map(str, seeds))}; mean +- SD over them." if len(seeds) > 1 else
            f"One seed ({seeds[0]}) so far: no SD and no paired differences across seeds; a "
            f"gain's SE (in the runs' table) is its evaluation's alone, not the spread between "
            f"seeds, so nothing here is called a win or a loss.")
    lines = [head, "",
             f"| method | pass@1 at start | final pass@1 | pass@1 gain | final pass@{k} | "
             f"train reward gain | realized KL, sum of updates | pass@1 gain per unit KL | "
             f"cosine to dense Adam's step | updates off budget |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for method, m in group["methods"].items():
        lines.append(
            f"| {LABELS[method]} | {_pm(m['start_pass@1'])} | {_pm(m['final_pass@1'])} | "
            f"{_pm(m['gain_pass@1'], '+.3f')} | {_pm(m[f'final_pass@{k}'])} | "
            f"{_pm(m['reward_gain'], '+.3f')} | {_pm(m['kl_realized_sum'])} | "
            f"{_pm(m['gain_pass@1_per_kl'], '+.2f')} | {_pm(m['adam_cosine_mean'])} | "
            f"{m['budget_misses']} of {m['updates_checked']} |")
    if group["pairs"]:
        lines += ["", *_pairs_table(group["pairs"])]
    return "\n".join(lines)


FIGURES = {  # group -> (the plot report() writes when the group has runs, its caption)
    "comparison": ("quality.png", "dense Adam vs LoGRA vs LoRA: train reward and held-out "
                   "pass@1 per update, mean +- SD over seeds"),
    "rank": ("quality-rank.png", "Figure 5(a): held-out pass@1 gain per update and after "
             "24 updates against the rank, mean +- SD over seeds"),
    "controls": ("quality-controls.png", "Figure 6: held-out pass@1, response length, "
                 "realized against predicted KL per step control"),
}


def _with_figure(summary: dict, name: str, text: str) -> str:
    """``text`` and, when the group has runs (so the plot exists), its figure's link."""
    if summary["groups"].get(name) is None:
        return text
    file, caption = FIGURES[name]
    return f"{text}\n\n![{caption}](../benchmarks/results/{file})"


def markdown(summary: dict) -> str:
    """The comparison: the three methods, and their paired differences."""
    return _with_figure(summary, "comparison", _group_table(summary, "comparison"))


def markdown_account(summary: dict) -> str:
    """Where LoGRA's gain is below another method's in the comparison: the measured account
    (issue 48's item 5) of each such method against LoGRA: gain per unit of realized KL
    (the same budget bought less) and the cosine of the update to dense Adam's step (the
    direction the sketch keeps), with the paired difference when there are seeds for one."""
    group = summary["groups"].get("comparison")
    if group is None or "logra" not in group["methods"]:
        return "(no finished comparison runs with LoGRA yet)"
    ms, seeds = group["methods"], group["seeds"]
    ahead = [m for m in ms if m != "logra" and ms[m]["gain_pass@1"]["mean"]
             > ms["logra"]["gain_pass@1"]["mean"]]
    if not ahead:
        return (f"On seeds {', '.join(map(str, seeds))}, LoGRA's mean held-out gain is not "
                f"below any other method's.")
    pairs = {(p["a"], p["b"]): p for p in group["pairs"]}
    lines = ["| method ahead of LoGRA r=64 | its gain - LoGRA's (seeds) | its pass@1 gain per "
             "unit KL / LoGRA's | its cosine to dense Adam's step / LoGRA's |",
             "|---|---|---|---|"]
    for m in ahead:
        pair = pairs.get(("logra", m)) or pairs.get((m, "logra"))
        diff = ms[m]["gain_pass@1"]["mean"] - ms["logra"]["gain_pass@1"]["mean"]
        reading = pair and (pair["verdict"] if pair["verdict"] == "within noise" else
                            f"LoGRA {pair['verdict']}")
        called = (f" +- {pair['se']:.3f} (SE; {reading})" if pair else
                  " (one seed: no SE across seeds)")
        lines.append(f"| {LABELS[m]} | {diff:+.3f}{called} | "
                     f"{ms[m]['gain_pass@1_per_kl']['mean']:+.2f} / "
                     f"{ms['logra']['gain_pass@1_per_kl']['mean']:+.2f} | "
                     f"{ms[m]['adam_cosine_mean']['mean']:.3f} / "
                     f"{ms['logra']['adam_cosine_mean']['mean']:.3f} |")
    return "\n".join(lines)


def markdown_rank(summary: dict) -> str:
    """Figure 5(a)'s table: LoGRA at r = 16, 64, 256 on the same seeds."""
    return _with_figure(summary, "rank", _group_table(summary, "rank"))


def markdown_controls(summary: dict) -> str:
    """Figure 6's table: the step controls on the same seeds, with the budgets they used."""
    text = _group_table(summary, "controls")
    group = summary["groups"].get("controls")
    if group is None:
        return text
    lines = ["", "| control | mean budget per update (after the mismatch term) | "
             "realized / predicted KL, worst update | response length, last quarter |",
             "|---|---|---|---|"]
    for method, m in group["methods"].items():
        lines.append(f"| {LABELS[method]} | {_pm(m['kl_budget_mean'], '.2e')} | "
                     f"{_pm(m['kl_realized_over_pred_max'], '.2f')} | "
                     f"{_pm(m['final_response_len'], '.2f')} |")
    return _with_figure(summary, "controls", text + "\n" + "\n".join(lines))


def markdown_runs(summary: dict) -> str:
    """Every run: held-out pass@1 at each evaluation, the gain with its paired SE, its
    evaluations' largest SE, the KL check, the cosine to dense Adam (over the updates whose
    shadow Adam state saw every gradient: a resumed run's restarts), the commit that ran it."""
    lines = ["| run | seed | updates | held-out pass@1 per evaluation | gain (paired SE) | "
             "largest eval SE | updates off budget | realized KL, sum | cosine to dense "
             "Adam (qkv / proj / fc1 / fc2) | commit |", "|---|---|---|---|---|---|---|---|---|---|"]
    order = {m: i for i, m in enumerate(LABELS)}
    for name, r in sorted(summary["runs"].items(),
                          key=lambda kv: (order[kv[1]["method"]], kv[1]["seed"])):
        curve = " / ".join(f"{v:.3f}" for _, v in r["pass@1"])
        kinds = " / ".join(f"{r['adam_cosine_by_kind'][k]:.2f}" for k in KINDS
                           if k in r["adam_cosine_by_kind"])
        commit = (r["provenance"].get("commit") or "?")[:10]
        lines.append(f"| {LABELS[r['method']]} | {r['seed']} | {r['updates']} | {curve} | "
                     f"{r['gain_pass@1']:+.3f} ({r['gain_se']:.3f}) | "
                     f"{max(se for _, se in r['eval_se']):.3f} | {len(r['budget_misses'])} | "
                     f"{r['kl_realized_sum']:.3f} | {r['adam_cosine_mean']:.3f} ({kinds}; "
                     f"{len(r['adam_cosine'])} updates) | "
                     f"{commit}{'' if r['provenance'].get('clean') else ' (unclean)'} |")
    return "\n".join(lines)


# --- plots --------------------------------------------------------------------------------
def _curves(summary: dict, method: str, key: str, seeds: list[int] | None = None) -> list[dict]:
    return [dict(r[key]) for r in summary["runs"].values()
            if r["method"] == method and r["in_summary"] and (seeds is None or r["seed"] in seeds)]


def _mean_sd_band(ax, curves: list[dict], color: str, label: str, **kw) -> None:
    """Mean over the curves at the steps all have, shaded +- one SD."""
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    values = [[c[x] for c in curves] for x in steps]
    mean = [statistics.fmean(v) for v in values]
    sd = [_sd(v) if len(v) > 1 else 0.0 for v in values]
    ax.plot(steps, mean, color=color, label=f"{label} (n = {len(curves)})", **kw)
    ax.fill_between(steps, [m - d for m, d in zip(mean, sd)], [m + d for m, d in zip(mean, sd)],
                    color=color, alpha=0.15)


def _figure(ncols: int, width: float):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width, 4))
    return plt, fig, axes


def _save(plt, fig, path: Path, title: str) -> None:
    """Title, lay out, write and close a figure ``_figure`` made."""
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(summary: dict, path: Path) -> None:
    """Train reward and held-out pass@1 per update: each method of the comparison on its
    seeds, mean shaded +- one SD (the paper's), n in the legend."""
    group = summary["groups"].get("comparison")
    if group is None:
        return
    plt, fig, axes = _figure(2, 11)
    for ax, key, ylabel in ((axes[0], "reward", "train reward (batch mean)"),
                            (axes[1], "pass@1", "held-out pass@1 (400 prompts x 4)")):
        for i, method in enumerate(group["methods"]):
            _mean_sd_band(ax, _curves(summary, method, key, group["seeds"]), f"C{i}",
                          LABELS[method], marker="o" if key == "pass@1" else None, ms=3)
        ax.set_xlabel("RL update")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    _save(plt, fig, path, "mean over seeds, shaded +- 1 SD")


def plot_rank(summary: dict, path: Path) -> None:
    """Figure 5(a): held-out pass@1 gain over each run's start per evaluation (mean +- SD
    over the group's seeds) and the final gain against the rank (each seed, mean +- SD),
    dense Adam on the same seeds for reference."""
    group = summary["groups"].get("rank")
    if group is None:
        return
    ranks = {"logra-r16": 16, "logra": 64, "logra-r256": 256}
    plt, fig, (left, right) = _figure(2, 11)
    for i, method in enumerate([*group["methods"], "dense"]):
        curves = _curves(summary, method, "pass@1", group["seeds"])
        if not curves:
            continue
        gains = [{u: v - c[0] for u, v in c.items()} for c in curves]
        _mean_sd_band(left, gains, f"C{i}", LABELS[method], marker="o", ms=3,
                      ls="--" if method == "dense" else "-")
        finals = [g[max(g)] for g in gains]
        if method in ranks:
            right.scatter([ranks[method]] * len(finals), finals, color=f"C{i}", s=16)
            right.errorbar([ranks[method]], [statistics.fmean(finals)],
                           yerr=[_sd(finals) if len(finals) > 1 else 0], color=f"C{i}",
                           marker="_", ms=20, capsize=4, label=f"{LABELS[method]} "
                           f"(n = {len(finals)})")
        else:
            mean, sd = statistics.fmean(finals), _sd(finals) if len(finals) > 1 else 0.0
            right.axhspan(mean - sd, mean + sd, color=f"C{i}", alpha=0.15)
            right.axhline(mean, color=f"C{i}", ls="--",
                          label=f"{LABELS[method]}, mean +- SD (n = {len(finals)})")
    left.axhline(0, color="k", lw=0.5)
    left.set_xlabel("RL update")
    left.set_ylabel("held-out pass@1 gain over the start")
    left.legend(fontsize=8)
    right.set_xscale("log", base=2)
    right.set_xticks([16, 64, 256], ["16", "64", "256"])
    right.set_xlabel("LoGRA rank r")
    right.set_ylabel(f"pass@1 gain after {summary['setup']['updates']} updates")
    right.axhline(0, color="k", lw=0.5)
    right.legend(fontsize=8)
    _save(plt, fig, path, f"Figure 5(a): rank, seeds {', '.join(map(str, group['seeds']))}")


def plot_controls(summary: dict, path: Path) -> None:
    """Figure 6: held-out pass@1 and response length per update, every run its own curve
    (color: control, line style and marker: seed), and realized against predicted KL."""
    group = summary["groups"].get("controls")
    if group is None:
        return
    plt, fig, axes = _figure(3, 15)
    styles = ("-", "--", ":", "-.")
    markers = ("o", "s", "^", "D")
    for i, method in enumerate(group["methods"]):
        runs = {r["seed"]: r for r in summary["runs"].values()
                if r["method"] == method and r["in_summary"] and r["seed"] in group["seeds"]}
        for j, (seed, r) in enumerate(sorted(runs.items())):
            label = f"{LABELS[method]}, seed {seed}"
            for ax, key in ((axes[0], "pass@1"), (axes[1], "response_len")):
                ax.plot(*zip(*r[key]), color=f"C{i}", ls=styles[j % 4],
                        marker=markers[j % 4], ms=3 if key == "pass@1" else 2, alpha=0.85,
                        label=label)
            points = [(p, x) for _, _, p, x, _, _ in r["kl"] if p and x]
            if points:
                axes[2].scatter(*zip(*points), s=14, color=f"C{i}", marker=markers[j % 4],
                                alpha=0.7, label=label)
    axes[0].set_ylabel("held-out pass@1")
    axes[1].set_ylabel("response length (tokens, batch mean)")
    for ax in axes[:2]:
        ax.set_xlabel("RL update")
    axes[2].set_xscale("log")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("predicted KL of the update")
    axes[2].set_ylabel("realized KL of the update")
    lims = axes[2].get_xlim()
    axes[2].plot(lims, lims, "k--", lw=0.8)
    for ax in axes:
        ax.legend(fontsize=7)
    _save(plt, fig, path,
          f"Figure 6: step controls, seeds {', '.join(map(str, group['seeds']))}")


def report(runs_dir: Path, setup: dict, methods: tuple[str, ...], results: Path,
           stem: str) -> dict:
    """Write STEM.json (with its provenance), STEM.md and the plots of the runs so far."""
    previous = results / f"{stem}.json"
    archived = json.loads(previous.read_text())["runs"] if previous.is_file() else {}
    summary = summarize(runs_dir, setup, methods, archived)
    write_json(results / f"{stem}.json", summary)
    write_text(results / f"{stem}.md", "\n\n".join(
        (markdown(summary), markdown_rank(summary), markdown_controls(summary),
         markdown_runs(summary))) + "\n")
    plot(summary, results / f"{stem}.png")
    plot_rank(summary, results / f"{stem}-rank.png")
    plot_controls(summary, results / f"{stem}-controls.png")
    return summary
