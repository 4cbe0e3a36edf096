"""Dense Adam vs LoGRA train-step time on the same model and batch, with a breakdown.

    .venv/bin/python benchmarks/step_time.py [--shape smollm2-135m] [--device cpu|cuda]
        [--ranks 64,256] [--modes fp32,none] [--steps 8] ...

Each LoGRA variant (each rank in each precision mode) is paired with dense Adam
(megatron's distributed optimizer): the two run in their own processes, built once,
and take their steps in turn, one step each per round, so machine noise hits both
alike; each ratio is to the dense Adam steps of its own pair. Same layer
spec (megatron's local spec for all; ``--transformer-engine`` gives dense Adam TE's only
when asked), same bf16 model, same batches. Per variant: the median of the timed steps
(the first round is a warm-up) and the median seconds of each phase
(``runtime.phase_times``): forward+backward (LoGRA's sketch accumulation in the
backward included, the reduction below not), sketch_reduce (the TP/DP all-reduce of the sketches), row_adam (D,
its norms and the step size), low_rank_apply (W -= c D A, SR included), projection
(generating the next A), and the rest of optimizer_step (dense Adam's whole step).
``step_time_ratio`` = LoGRA / dense per rank and mode; targets <= 0.85 at r=256 and
<= 0.7 at r=64. Last stdout line: the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from _results import save
from _train_probe import Server, add_setup_args

from megatron_logra.memory.shapes import SHAPES

TARGETS = {256: 0.85, 64: 0.7}
MODES = {"fp32": "logra_fp32_master", "none": "logra_none"}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--ranks", default="64,256", help="LoGRA ranks, comma-separated")
    p.add_argument("--modes", default="fp32,none", help="LoGRA precision modes: fp32, none")
    add_setup_args(p, 8, "rounds (the first is a warm-up)")
    p.add_argument("--transformer-engine", action="store_true",
                   help="dense Adam on TE's layer spec (CUDA; LoGRA stays on the local spec)")
    p.add_argument("--save", metavar="NAME",
                   help="also write benchmarks/results/NAME.json and NAME.md")
    return p.parse_args(argv)


def _median_phases(steps: list[dict]) -> dict[str, float]:
    names = sorted({name for s in steps for name in s["phases"]})
    out = {name: statistics.median(s["phases"].get(name, 0.0) for s in steps) for name in names}
    if "sketch_reduce" in out:  # nested in forward_backward (megatron's grad finalisation)
        out["forward_backward"] -= out["sketch_reduce"]
    if "optimizer_step" in out:  # what the named optimizer phases leave of the step
        named = sum(out.get(k, 0.0) for k in ("row_adam", "low_rank_apply", "projection"))
        out["optimizer_other"] = max(out.pop("optimizer_step") - named, 0.0)
    return {k: round(v, 4) for k, v in out.items()}


def alternate(specs: dict[str, dict], rounds: int) -> dict[str, dict]:
    """Each spec in its own process, built once; one step each per round, in turn. Pairs
    only: with more resident processes this machine slowed the largest one 2-3x."""
    servers = {}
    for name, spec in specs.items():
        print(f"[step_time] building {name}", file=sys.stderr)
        servers[name] = Server(spec)
    steps = {name: [] for name in specs}
    for round_ in range(rounds):
        for name, server in servers.items():
            steps[name].append(server.ask("step"))
        print(f"[step_time] round {round_ + 1}/{rounds}: " + ", ".join(
            f"{n} {steps[n][-1]['seconds']:.2f}s" for n in servers), file=sys.stderr)
    for server in servers.values():
        server.close()
    runs = {}
    for name, taken in steps.items():
        timed = taken[1:] or taken
        runs[name] = {"step_time_s": round(statistics.median(s["seconds"] for s in timed), 4),
                      "step_times_s": [round(s["seconds"], 4) for s in taken],
                      "phases_s": _median_phases(timed)}
    return runs


def main(argv=None) -> None:
    args = parse(argv)
    ranks = [int(r) for r in args.ranks.split(",")]
    modes = args.modes.split(",")
    base = {"shape": args.shape, "device": args.device, "seq_length": args.seq_length,
            "micro_batch_size": args.micro_batch_size, "microbatches": args.microbatches,
            "steps": args.steps, "recompute": args.recompute, "targets": args.targets,
            "untargeted": args.untargeted, "rank": ranks[0]}
    variants = {"dense_adam": dict(base, variant="dense_adam",
                                   transformer_engine=args.transformer_engine)}
    for r in ranks:
        for mode in modes:
            variants[f"logra_r{r}_{mode}"] = dict(base, variant=MODES[mode], rank=r)
    runs, ratios, met = {}, {}, {}
    for name, spec in variants.items():
        if name == "dense_adam":
            continue
        pair = {f"dense_adam_vs_{name}": variants["dense_adam"], name: spec}
        runs.update(alternate(pair, args.steps))
        dense = runs[f"dense_adam_vs_{name}"]["step_time_s"]
        ratios[name] = round(runs[name]["step_time_s"] / dense, 4)
        met[name] = ratios[name] <= TARGETS.get(spec["rank"], 1.0)
    report = {"benchmark": "step_time", **{k: v for k, v in base.items() if k != "rank"},
              "ranks": ranks, "modes": modes, "runs": runs, "step_time_ratio": ratios,
              "ratio_targets": {str(k): v for k, v in TARGETS.items()}, "target_met": met}
    if args.save:
        save(args.save, report, markdown(report))
    print(json.dumps(report))


PHASES = ("forward_backward", "sketch_reduce", "row_adam", "low_rank_apply", "projection",
          "optimizer_other")


def _range(run: dict) -> str:
    """The timed steps' (after the warm-up) fastest - slowest: how noisy the median is."""
    timed = run["step_times_s"][1:] or run["step_times_s"]
    return f"{min(timed):.2f} - {max(timed):.2f}"


def markdown(report: dict) -> str:
    """Markdown: each LoGRA variant against the dense Adam steps of its pair, with phases."""
    head = ("| LoGRA | dense Adam (s) | LoGRA (s) | ratio | target | "
            + " | ".join(PHASES) + " | steps' range, dense Adam / LoGRA (s) |")
    lines = [head, "|" + "---|" * (6 + len(PHASES))]
    for name, ratio in report["step_time_ratio"].items():
        run, dense = report["runs"][name], report["runs"][f"dense_adam_vs_{name}"]
        rank = int(name.split("_")[1][1:])
        target = report["ratio_targets"].get(str(rank), "-")
        met = "met" if report["target_met"][name] else "not met"
        phases = " | ".join(f"{run['phases_s'].get(k, 0):.2f}" for k in PHASES)
        lines.append(f"| {name} | {dense['step_time_s']:.2f} | {run['step_time_s']:.2f} | "
                     f"{ratio:.2f} | {target} ({met}) | {phases} | {_range(dense)} / "
                     f"{_range(run)} |")
    dense_phases = ", ".join(
        f"{n.removeprefix('dense_adam_vs_')}: fwd+bwd {r['phases_s'].get('forward_backward', 0):.2f}"
        f" + step {r['phases_s'].get('optimizer_other', 0):.2f}"
        for n, r in report["runs"].items() if n.startswith("dense_adam_vs_"))
    return "\n".join(lines) + (
        f"\n\nDense Adam's phases in each pair (s): {dense_phases}.\n\n{report['shape']} "
        f"shape, bf16, {report['microbatches']} microbatches of {report['micro_batch_size']} x "
        f"{report['seq_length']} tokens, one process each, megatron's local layer spec for "
        f"both; LoGRA's targets {report['targets']}, the rest {report['untargeted']}; medians "
        f"of {report['steps'] - 1} steps after a warm-up, the two optimizers' steps "
        f"alternating (the steps' range shows how noisy each median is). Measured by "
        f"`benchmarks/step_time.py` on {report['device'].upper()}.\n")


if __name__ == "__main__":
    main()
