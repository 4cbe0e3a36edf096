"""Learning curves of one or more runs to one PNG: reward, pass@k, KL, memory, times.

    python -m megatron_logra.plot RUN_DIR [RUN_DIR ...] [--out curves.png] [--labels a,b]

Each RUN_DIR holds the metrics.jsonl a run wrote (``--output-dir``); runs are drawn on
the same axes (e.g. dense Adam vs LoGRA). Panels without data in any run are left out.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from megatron_logra.training.metrics import read_metrics

PANELS = [  # (title, [metric keys], log scale)
    ("train reward (mean)", ["reward_mean"], False),
    ("held-out pass@1 / pass@k", ["eval_pass@1", "eval_pass@k"], False),
    ("KL per update", ["kl_pred", "kl_realized"], True),
    ("step scale alpha", ["alpha"], False),
    ("trainer vs engine |logprob diff|", ["logprob_mismatch"], True),
    ("response length (tokens)", ["response_len"], False),
    ("peak memory (GiB)", ["peak_mem_bytes"], False),
    ("seconds per update", ["rollout_time_s", "train_time_s", "sync_time_s"], False),
    ("loss", ["loss"], False),
]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    if key == "eval_pass@k":  # whichever k the run used
        key = next((k for r in records for k in r if k.startswith("eval_pass@")
                    and k != "eval_pass@1"), key)
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)):
            xs.append(r["step"])
            ys.append(v / 2**30 if key == "peak_mem_bytes" else v)
    return xs, ys


def plot_runs(run_dirs: list[Path], out: Path, labels: list[str] | None = None) -> list[str]:
    """Draw the panels that have data; returns their titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for i, d in enumerate(run_dirs):
        path = d / "metrics.jsonl" if d.is_dir() else d
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no metrics.jsonl (pass a run's --output-dir)")
        runs.append((labels[i] if labels else d.name, read_metrics(path)))
    panels = [(t, keys, log) for t, keys, log in PANELS
              if any(_series(recs, k)[0] for _, recs in runs for k in keys)]
    if not panels:
        raise ValueError("no plottable metrics in " + ", ".join(map(str, run_dirs)))
    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    for ax, (title, keys, log) in zip(axes.flat, panels):
        for label, recs in runs:
            for key in keys:
                xs, ys = _series(recs, key)
                if xs:
                    name = label if len(keys) == 1 else f"{label}: {key.removeprefix('eval_')}"
                    ax.plot(xs, ys, marker="o" if len(xs) < 15 else None, ms=3, label=name)
        ax.set_title(title)
        ax.set_xlabel("update")
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [t for t, _, _ in panels]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_logra.plot", description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run output dirs (or metrics.jsonl files)")
    p.add_argument("--out", type=Path, default=Path("curves.png"), help="PNG to write")
    p.add_argument("--labels", default=None, help="comma list, one label per run")
    args = p.parse_args(argv)
    labels = args.labels.split(",") if args.labels else None
    if labels and len(labels) != len(args.runs):
        print(f"error: --labels has {len(labels)} names for {len(args.runs)} runs", file=sys.stderr)
        return 2
    try:
        titles = plot_runs(args.runs, args.out, labels)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({', '.join(titles)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
