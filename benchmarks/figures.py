"""The paper's diagnostics on this project's runs: what LoGRA's sketches keep (Figure 5b/c)
and how LoGRA's update compares with dense Adam's from the same gradients. (Figures 5(a)
and 6, rank and step controls, are drawn from the quality benchmark's runs by
benchmarks/quality_report.py.)

    python benchmarks/figures.py collect --model smollm2   # real RL gradients (minutes)
    python benchmarks/figures.py collect --model tiny      # the same on the tiny model
    python benchmarks/figures.py sketches                  # cosines -> JSON (+ PNGs)
    python benchmarks/figures.py draw                      # every PNG again, from the JSON

``collect`` runs dense Adam RL in one process from the quality setup's SFT warm start
(SmolLM2-135M-Instruct: ``runs/quality/warm-start/ckpt``, made by benchmarks/quality.py;
the tiny model: a warm start of its own, as tests/integration/test_rl_learning.py), with
real vLLM rollouts and the gcd verifier, and saves the gradient G of every sketched
weight (q/k/v/o/gate/up/down: megatron's fused qkv and fc1, proj, fc2) of each update,
as the optimizer is about to step.

``sketches`` computes, per layer (its four weights together) and rank r:

- Figure 5(b): cos(sum_t G_t A_t^T A_t, sum_t G_t) over the collected updates with A_t
  refreshed every update (LoGRA) against one fixed A, Rademacher (+-1/sqrt(r)); and the
  single-update cos(G A^T A, G) (the same for both, averaged over updates);
- Figure 5(c): the same with refreshed Rademacher against refreshed Gaussian A;
- where LoGRA trails: cos(D_t A_t, U_t) between LoGRA's direction (RowAdam on the sketch,
  beta2 0.95, relative eps, norm restoration per fused weight) and dense Adam's step U_t
  (beta1 0.9, beta2 0.95, the recipes' defaults) driven by the same gradient sequence
  from the same (empty) state, per layer and rank, with the rank as a share of the layer
  width (tiny model vs SmolLM2).

Projections are the project's own (``logra.projection``: counter-based, seeded per
update and weight). Written to ``benchmarks/results/figures/``: ``sketch_cosines.json``,
``fig5b.png``, ``fig5c.png``, ``update_cosine.png``. Every figure is a CPU one.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "runs" / "figures"
RESULTS = REPO / "benchmarks" / "results" / "figures"
RANKS = (16, 64, 256)
SKETCHED = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight",
            "linear_fc2.weight")
# the quality setup's dense Adam run (recipes/quality/dense.yaml) in one process
SMOLLM2 = ["--config", "recipes/quality/dense.yaml", "--pipeline-model-parallel-size", "1"]
# the tiny model's RL learning test (tests/integration/test_rl_learning.py): its SFT warm
# start (recipes/paper/cpu-sft.yaml) and its dense Adam RL settings
TINY_SFT = ["--config", "recipes/paper/cpu-sft.yaml"]
TINY_RL = ["--stage", "rl", "--task", "gcd", "--seq-length", "160", "--prompts-per-step",
           "32", "--responses-per-prompt", "8", "--micro-batch-size", "64",
           "--max-new-tokens", "8", "--lr", "1e-3", "--lr-decay-style", "constant",
           "--dataset-size", "1500", "--data-seed", "101", "--eval-prompts", "16",
           "--eval-interval", "0", "--finetune"]


# --- collect ------------------------------------------------------------------------------
def _sketched_params(model) -> dict[str, torch.nn.Parameter]:
    from megatron_logra.model.provider import unwrap

    return {n: p for n, p in unwrap(model[0]).named_parameters() if n.endswith(SKETCHED)}


def collect(model: str, updates: int) -> Path:
    """Run ``updates`` dense Adam RL updates and save each one's sketched-weight gradients
    (fp32, megatron's layout) to runs/figures/grads-MODEL/update_NNN.pt."""
    from megatron_logra.cli import parse_run_config
    from megatron_logra.rl.stage import RLStage

    out = RUNS / f"grads-{model}"
    out.mkdir(parents=True, exist_ok=True)
    argv = (SMOLLM2 + ["--load", str(REPO / "runs/quality/warm-start/ckpt"), "--finetune"]
            if model == "smollm2" else TINY_RL + ["--load", str(_tiny_warm_start())])
    run = RLStage(parse_run_config([*argv, "--train-iters", str(updates), "--output-dir",
                                  str(out / "run"), "--seed", "1", "--rollout-seed", "1"]))
    params = _sketched_params(run.objs.model)
    optimizer, step = run.objs.optimizer, run.objs.optimizer.step
    current = {"update": 0}

    def step_and_save(*args, **kwargs):
        # the gradients the step is about to take: DDP's reduced main_grad
        grads = {n: p.main_grad.detach().float().clone() for n, p in params.items()}
        torch.save(grads, out / f"update_{current['update']:03d}.pt")
        return step(*args, **kwargs)

    optimizer.step = step_and_save
    for update in range(updates):
        current["update"] = update
        record = run.step(update)
        print(f"[figures] {model} update {update + 1}/{updates}: reward "
              f"{record['reward_mean']:.3f}", flush=True)
    run.close()
    return out


def _tiny_warm_start() -> Path:
    """The tiny model after SFT on gcd (as tests/integration/test_rl_learning.py)."""
    import subprocess

    ckpt = RUNS / "tiny-sft" / "ckpt"
    if not (ckpt / "latest").is_file():
        subprocess.run([sys.executable, str(REPO / "launch" / "pretrain_rl.py"), *TINY_SFT,
                        "--output-dir", str(RUNS / "tiny-sft"), "--save", str(ckpt)],
                       cwd=REPO, check=True)
    return ckpt


# --- sketches ------------------------------------------------------------------------------
def _layers(names: list[str]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name in names:
        layer = int(name.split("layers.")[1].split(".")[0])
        out.setdefault(layer, []).append(name)
    return dict(sorted(out.items()))


def projection(seed: int, update: int, name: str, rank: int, width: int,
               kind: str) -> torch.Tensor:
    """A [rank, width] of weight ``name`` at ``update`` (LoGRA's own generator)."""
    from megatron_logra.logra.projection import parameter_seed, projection_block

    return projection_block(parameter_seed(seed, update, name), rank, (0, width), kind=kind)


def _cos(dot: float, a_sq: float, b_sq: float) -> float:
    return dot / math.sqrt(a_sq * b_sq) if a_sq > 0 and b_sq > 0 else float("nan")


class AdamDirection:
    """Dense Adam's step direction m_hat / (sqrt(v_hat) + eps) for one weight [out, in]."""

    def __init__(self, beta1: float = 0.9, beta2: float = 0.95, eps: float = 1e-8):
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.m = self.v = None
        self.t = 0

    def __call__(self, g: torch.Tensor) -> torch.Tensor:
        self.t += 1
        self.m = (1 - self.beta1) * g if self.m is None else self.beta1 * self.m + (
            1 - self.beta1) * g
        self.v = (1 - self.beta2) * g * g if self.v is None else self.beta2 * self.v + (
            1 - self.beta2) * g * g
        m_hat = self.m / (1 - self.beta1 ** self.t)
        v_hat = self.v / (1 - self.beta2 ** self.t)
        return m_hat / (v_hat.sqrt() + self.eps)


class LograDirection:
    """LoGRA's direction D A for one weight: RowAdam on S = G A^T (``logra.row_adam``),
    restored to the sketch's norm (the whole fused weight as one module)."""

    def __init__(self, rows: int, beta2: float = 0.95, eps: float = 1e-8):
        self.v = torch.zeros(rows)
        self.beta2, self.eps, self.t = beta2, eps, 0

    def __call__(self, g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        from megatron_logra.logra import row_adam

        self.t += 1
        sketch = g @ a.t()
        row_adam.update_row_moments(self.v, sketch, self.beta2)
        rho = row_adam.row_scale(self.v, self.t, self.beta2)
        d = row_adam.direction(sketch, rho, rho.mean(), self.eps)
        d_sq = float(d.pow(2).sum())
        if d_sq > 0:
            d *= math.sqrt(float(sketch.pow(2).sum()) / d_sq)
        return d @ a


def sketch_cosines(model: str, seed: int = 1) -> dict:
    """Per layer and rank: the Figure 5 cosines and LoGRA-vs-Adam update cosines."""
    files = sorted((RUNS / f"grads-{model}").glob("update_*.pt"))
    if not files:
        raise SystemExit(f"no gradients in {RUNS / f'grads-{model}'}: run collect first")
    grads = [torch.load(f) for f in files]
    names = list(grads[0])
    out = {"updates": len(grads), "ranks": list(RANKS), "layers": {}}
    variants = {"fixed-rademacher": ("rademacher", False),
                "refreshed-rademacher": ("rademacher", True),
                "refreshed-gaussian": ("gaussian", True)}
    for layer, members in _layers(names).items():
        row: dict = {"width": {n.split(".")[-2]: grads[0][n].shape[1] for n in members}}
        for r in RANKS:
            acc_dot, acc_sq, single = {}, {}, {}
            total_sq = 0.0
            sums = {v: {n: torch.zeros_like(grads[0][n]) for n in members} for v in variants}
            g_sum = {n: torch.zeros_like(grads[0][n]) for n in members}
            adam = {n: AdamDirection() for n in members}
            logra = {n: LograDirection(grads[0][n].shape[0]) for n in members}
            full = {n: LograDirection(grads[0][n].shape[0]) for n in members}
            upd, upd_full = [], []
            for t, g in enumerate(grads):
                dots = {v: [0.0, 0.0, 0.0] for v in variants}  # <G^,G>, |G^|^2, |G|^2
                u_dot = u_a = u_b = f_dot = f_b = 0.0
                for n in members:
                    width = g[n].shape[1]
                    g_sum[n] += g[n]
                    drawn = {}  # each variant's A at this update (LoGRA's is reused below)
                    for v, (kind, refreshed) in variants.items():
                        a = drawn[v] = projection(seed, t if refreshed else 0, n, r, width,
                                                  kind)
                        approx = (g[n] @ a.t()) @ a
                        sums[v][n] += approx
                        dots[v][0] += float((approx * g[n]).sum())
                        dots[v][1] += float(approx.pow(2).sum())
                        dots[v][2] += float(g[n].pow(2).sum())
                    dense = adam[n](g[n])
                    low = logra[n](g[n], drawn["refreshed-rademacher"])
                    u_dot += float((dense * low).sum())
                    u_a += float(dense.pow(2).sum())
                    u_b += float(low.pow(2).sum())
                    # RowAdam on G itself (A = I): the preconditioner's share of the gap
                    whole = full[n](g[n], torch.eye(width))
                    f_dot += float((dense * whole).sum())
                    f_b += float(whole.pow(2).sum())
                for v in variants:
                    single.setdefault(v, []).append(_cos(*dots[v]))
                upd.append(_cos(u_dot, u_a, u_b))
                upd_full.append(_cos(f_dot, u_a, f_b))
            total_sq = sum(float(g_sum[n].pow(2).sum()) for n in members)
            for v in variants:
                acc_dot[v] = sum(float((sums[v][n] * g_sum[n]).sum()) for n in members)
                acc_sq[v] = sum(float(sums[v][n].pow(2).sum()) for n in members)
            row[f"r{r}"] = {
                "accumulated": {v: _cos(acc_dot[v], acc_sq[v], total_sq) for v in variants},
                "single": {v: sum(single[v]) / len(single[v]) for v in variants},
                "update_cosine": sum(upd) / len(upd), "update_cosine_per_update": upd,
                # the same RowAdam with no sketch (A = I): what the row-wise second moment
                # alone gives up against Adam's per-element one
                "update_cosine_unsketched": sum(upd_full) / len(upd_full)}
        out["layers"][str(layer)] = row
        print(f"[figures] {model} layer {layer}: " + ", ".join(
            f"r{r} acc {row[f'r{r}']['accumulated']['refreshed-rademacher']:.3f} / fixed "
            f"{row[f'r{r}']['accumulated']['fixed-rademacher']:.3f}, update cos "
            f"{row[f'r{r}']['update_cosine']:.3f}" for r in RANKS), flush=True)
    return out


# --- draw ----------------------------------------------------------------------------------
def _heatmaps(data: dict, pairs: list[tuple[str, str, str]], title: str, path: Path) -> None:
    """Rows: layers; columns: ranks; one shared colour scale over every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(data)
    heights = [len(data[m]["layers"]) for m in models]
    fig, axes = plt.subplots(len(models), len(pairs), figsize=(3.2 * len(pairs) + 1.2,
                                                              1.4 + 0.13 * sum(heights) +
                                                              0.6 * len(models)),
                             squeeze=False, gridspec_kw={"height_ratios": heights})
    grids = {(m, p): [[data[m]["layers"][layer][f"r{r}"][p[1]][p[0]] for r in RANKS]
                      for layer in data[m]["layers"]] for m in models for p in pairs}
    values = [v for g in grids.values() for row in g for v in row if not math.isnan(v)]
    lo, hi = min(values), max(values)
    for i, m in enumerate(models):
        for j, p in enumerate(pairs):
            ax = axes[i][j]
            im = ax.imshow(grids[(m, p)], vmin=lo, vmax=hi, aspect="auto", cmap="viridis")
            ax.set_xticks(range(len(RANKS)), [f"r={r}" for r in RANKS])
            layers = list(data[m]["layers"])
            step = max(1, len(layers) // 6)
            ax.set_yticks(range(0, len(layers), step), layers[::step])
            if j == 0:
                ax.set_ylabel(f"{m}: layer")
            if i == 0:
                ax.set_title(p[2], fontsize=9)
    fig.colorbar(im, ax=axes, shrink=0.8, label="cosine")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _update_cosine_plot(data: dict, path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for m, d in data.items():
        widths = [min(d["layers"]["0"]["width"].values())]
        mean = [sum(d["layers"][layer][f"r{r}"]["update_cosine"] for layer in d["layers"])
                / len(d["layers"]) for r in RANKS]
        line, = ax.plot([r / widths[0] for r in RANKS], mean, marker="o", label=m)
        unsketched = sum(d["layers"][layer][f"r{RANKS[0]}"]["update_cosine_unsketched"]
                         for layer in d["layers"]) / len(d["layers"])
        ax.axhline(unsketched, color=line.get_color(), ls="--", lw=0.8,
                   label=f"{m}: RowAdam without a sketch")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("rank / layer width (hidden size)")
    ax.set_ylabel("cos(LoGRA update, dense Adam update)")
    ax.legend()
    ax.set_title("same gradients, same (empty) state; mean over layers and updates",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw() -> list[str]:
    """Every figure from its JSON (those whose data exist)."""
    drawn = []
    data_path = RESULTS / "sketch_cosines.json"
    if data_path.is_file():
        data = json.loads(data_path.read_text())
        _heatmaps(data, [("fixed-rademacher", "accumulated", "fixed A, accumulated"),
                         ("refreshed-rademacher", "accumulated", "refreshed A, accumulated"),
                         ("refreshed-rademacher", "single", "one update")],
                  "Figure 5(b): cos(sum G A^T A, sum G), Rademacher", RESULTS / "fig5b.png")
        _heatmaps(data, [("refreshed-rademacher", "accumulated", "Rademacher, accumulated"),
                         ("refreshed-gaussian", "accumulated", "Gaussian, accumulated"),
                         ("refreshed-gaussian", "single", "Gaussian, one update")],
                  "Figure 5(c): refreshed Rademacher vs Gaussian", RESULTS / "fig5c.png")
        _update_cosine_plot(data, RESULTS / "update_cosine.png")
        drawn += ["fig5b.png", "fig5c.png", "update_cosine.png"]
    return drawn


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect", help="real RL gradients of a dense Adam run")
    c.add_argument("--model", choices=("smollm2", "tiny"), required=True)
    c.add_argument("--updates", type=int, default=8)
    s = sub.add_parser("sketches", help="the cosines of every collected model -> JSON, PNGs")
    s.add_argument("--models", default="smollm2,tiny")
    sub.add_parser("draw", help="every PNG again from the JSON files")
    args = p.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.command == "collect":
        if args.updates < 1:
            p.error("--updates must be >= 1")
        print(f"[figures] gradients in {collect(args.model, args.updates)}", flush=True)
        return 0
    if args.command == "sketches":
        fresh = {m: sketch_cosines(m) for m in args.models.split(",")
                 if (RUNS / f"grads-{m}").is_dir()}
        if not fresh:
            p.error(f"no collected gradients under {RUNS}: run collect first")
        path = RESULTS / "sketch_cosines.json"  # other models' entries are kept
        data = json.loads(path.read_text()) if path.is_file() else {}
        path.write_text(json.dumps({**data, **fresh}, indent=1) + "\n")
    print(json.dumps({"drawn": draw()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
