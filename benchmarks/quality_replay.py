"""Replay the start of a recorded quality run at this commit and compare, update by update.

    python benchmarks/quality_replay.py --runs runs/q48 --method logra --seed 1 --updates 4

The comparison's runs take hours and accumulate across sittings, so they may have run at
an older commit than the one the docs are rendered at. A recorded run stays citable at a
later commit when that commit, run the same way, computes the same numbers: this reruns
(method, seed) from the recorded runs' own warm start for ``--updates`` updates, with the
benchmark's own command (``quality.advance``), into ``RUNS/replay-<commit>/``, and
compares with the recorded run every value both logged: per update the rollouts' reward
and length, the loss, the gradient norm, the predicted and realized KL, the step scale;
per evaluation held-out pass@1. Rollouts are seeded per sample, so a replay that
generates what the recorded run generated reproduces it to rounding; the JSON keeps the
largest difference per value. Written to ``--results`` (default benchmarks/results):
``quality_replay.json`` and ``.md``. CPU figures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from _results import write_json, write_text
from quality import METHODS, _setup, advance
from quality_report import _run_provenance

from megatron_logra.runtime.provenance import provenance, require_clean
from megatron_logra.training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
# values compared per update (training rows) and per evaluation
UPDATE_KEYS = ("reward_mean", "response_len", "loss", "grad_norm", "kl_pred", "kl_realized",
               "alpha")
EVAL_KEYS = ("eval_pass@1",)
SAME = 1e-6  # relative difference below which two logged values are the same number


def _rows(run_dir: Path, key: str) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if key in r}


def _rel_diff(recorded: float, replayed: float) -> float:
    return abs(replayed - recorded) / max(abs(recorded), 1e-12)


def compare(recorded: Path, replayed: Path, updates: int) -> dict:
    """Per value, the largest relative difference between the two runs over the replayed
    updates (and evaluations), with the pairs behind it."""
    values = {}
    for keys, marker in ((UPDATE_KEYS, "reward_mean"), (EVAL_KEYS, "eval_pass@1")):
        old, new = _rows(recorded, marker), _rows(replayed, marker)
        steps = sorted(s for s in set(old) & set(new) if s <= updates)
        for key in keys:
            pairs = [(s, old[s][key], new[s][key]) for s in steps
                     if old[s].get(key) is not None and new[s].get(key) is not None]
            worst = max((_rel_diff(a, b) for _, a, b in pairs), default=None)
            values[key] = {"steps": [s for s, _, _ in pairs], "recorded": [a for _, a, _ in pairs],
                           "replayed": [b for _, _, b in pairs], "max_rel_diff": worst}
    compared = [v for v in values.values() if v["max_rel_diff"] is not None]
    same = bool(compared) and all(v["max_rel_diff"] <= SAME for v in compared)
    differing = [s for v in compared for s, a, b in zip(v["steps"], v["recorded"], v["replayed"])
                 if _rel_diff(a, b) > SAME]
    return {"values": values, "same": same, "first_differing_step": min(differing, default=None)}


def _differs(report: dict) -> str:
    """The verdict of a replay that did not reproduce: from which update, and the two
    explanations it cannot tell apart."""
    first = report.get("first_differing_step")
    load = report["provenance"].get("load_avg")
    where = f" from update {first} on (the updates before it: the same)" if first else ""
    return (f"**not the same numbers**{where}. This replay does not show that the recorded "
            f"runs are this commit's: either this commit computes differently, or the "
            f"rollouts did not reproduce (load average at the replay's start: {load}).")


def markdown(report: dict) -> str:
    """The replay's verdict and, per value, the largest difference from the recorded run."""
    head = (f"{report['method']} seed {report['seed']}, updates 1-{report['updates']}, "
            f"recorded at {report['recorded_commit'][:10]}, replayed at "
            f"{report['provenance']['commit'][:10]}: "
            + ("the same numbers (every value within a relative 1e-6)." if report["same"] else
               _differs(report)))
    lines = [head, "", "| value | steps compared | largest relative difference |",
             "|---|---|---|"]
    for key, v in report["values"].items():
        worst = "-" if v["max_rel_diff"] is None else f"{v['max_rel_diff']:.1e}"
        lines.append(f"| {key} | {len(v['steps'])} | {worst} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", required=True, help="the recorded runs' folder (quality.py --runs)")
    p.add_argument("--method", default="logra", choices=sorted(METHODS))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--updates", type=int, default=4, help="updates replayed (default 4)")
    p.add_argument("--results", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--allow-dirty", action="store_true",
                   help="replay from a tree with uncommitted changes (not citable)")
    args = p.parse_args(argv)
    runs = Path(args.runs).resolve()
    recorded = runs / f"{args.method}-s{args.seed}"
    if not (recorded / "metrics.jsonl").is_file():
        p.error(f"{recorded} has no metrics.jsonl: name the runs folder quality.py wrote "
                f"(--runs) and a method and seed it ran")
    require_clean(args.allow_dirty, "benchmarks/quality_replay.py")
    here = provenance()
    s = _setup(quick=False)
    s["updates"], s["start"] = args.updates, runs / "warm-start" / "ckpt"
    replay_runs = runs / f"replay-{here['commit'][:10]}"
    advance(args.method, args.seed, s, replay_runs)
    report = {"method": args.method, "seed": args.seed, "updates": args.updates,
              "recorded": str(recorded), "replayed": str(replay_runs / recorded.name),
              "recorded_commit": _run_provenance(recorded).get("commit") or "?",
              **compare(recorded, replay_runs / recorded.name, args.updates),
              "provenance": here}
    results = Path(args.results)
    write_json(results / "quality_replay.json", report)
    write_text(results / "quality_replay.md", markdown(report) + "\n")
    print(markdown(report))
    return 0 if report["same"] else 1


if __name__ == "__main__":
    sys.exit(main())
