"""Dense Adam vs LoGRA vs LoRA: per-rank model state and step peak, at several layouts.

    .venv/bin/python benchmarks/memory.py [--shape smollm2-135m] [--device cpu|cuda]
        [--layouts DP4,DP2,DP1,TP3,PP2] [--variants dense_adam,logra_fp32_master,...]
        [--rank 256] [--seq-length 256] [--micro-batch-size 1] [--microbatches 2]

Same model (bf16 params, random init), same layer spec (megatron's local spec), same
per-rank batch, for every variant at every layout; a layout runs as that many gloo
processes (torchrun) on this machine, each variant in fresh processes. Variants: dense
Adam with megatron's distributed optimizer (fp32 grads; fp32 main + Adam moments
sharded over DP); LoGRA as the paper runs it (q/k/v/o/gate/up/down sketched, the rest
frozen; row states and fp32 masters sharded over DP by whole rows) with an fp32 master
or bf16 only (SR); LoRA (r=16 adapters on the same four linears, base frozen, Adam on
the adapters through the same distributed optimizer).

Per layout and variant: every rank's model-state bytes by category (enumerated
tensors) and step peak (CUDA max allocated; on CPU the live tensor bytes,
``_train_probe.py``), the busiest rank's figures, and each method's ratio to dense Adam
at the same layout. DP4 comes first: it is where dense Adam's optimizer is sharded,
the comparison users run. Last stdout line: the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys

from _results import mib, save
from _train_probe import VARIANTS, add_setup_args, measure

from megatron_logra.memory.shapes import SHAPES, shape_dir

LAYOUTS = {"DP4": (1, 1, 4), "DP2": (1, 1, 2), "DP1": (1, 1, 1), "TP2": (2, 1, 1),
           "TP3": (3, 1, 1), "PP2": (1, 2, 1)}  # name -> (TP, PP, DP)
DEFAULT_LAYOUTS = "DP4,DP2,DP1,TP3,PP2"  # SmolLM2's 9 heads do not split over TP2


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS,
                   help=f"comma list of {list(LAYOUTS)}")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma list of {list(VARIANTS)}")
    p.add_argument("--rank", type=int, default=256, help="LoGRA's sketch rank")
    p.add_argument("--lora-rank", type=int, default=16)
    add_setup_args(p, 2, "the last one measures the peak")
    p.add_argument("--save", action="store_true",
                   help="also write benchmarks/results/memory.json and memory.md")
    args = p.parse_args(argv)
    for name, allowed in ((args.layouts, LAYOUTS), (args.variants, VARIANTS)):
        unknown = [x for x in name.split(",") if x not in allowed]
        if unknown:
            p.error(f"unknown {unknown}: choose from {list(allowed)}")
    if "dense_adam" not in args.variants.split(","):
        p.error("--variants must include dense_adam (every ratio is to it)")
    from megatron_logra.model.arch import load_arch

    arch = load_arch(shape_dir(args.shape))
    for layout in args.layouts.split(","):
        tp, pp, _ = LAYOUTS[layout]
        try:
            arch.check_parallel(tp, pp)
        except ValueError as exc:
            p.error(f"--layouts {layout} at --shape {args.shape}: {exc}")
    return args


def busiest(run: dict) -> dict:
    """The largest per-rank model state and peak of a multi-rank run (and which ranks)."""
    ranks = run["ranks"]
    state = max(ranks, key=lambda r: r["model_state_bytes"]["total"])
    peak = max(ranks, key=lambda r: r["peak_mem_bytes"])
    return {"model_state_bytes": state["model_state_bytes"]["total"],
            "model_state_rank": state["rank"], "peak_mem_bytes": peak["peak_mem_bytes"],
            "peak_rank": peak["rank"]}


def main(argv=None) -> None:
    args = parse(argv)
    spec = {"shape": args.shape, "device": args.device, "rank": args.rank,
            "lora_rank": args.lora_rank, "seq_length": args.seq_length,
            "micro_batch_size": args.micro_batch_size, "microbatches": args.microbatches,
            "steps": args.steps, "recompute": args.recompute, "targets": args.targets,
            "untargeted": args.untargeted}
    layouts = {}
    for layout in args.layouts.split(","):
        tp, pp, dp = LAYOUTS[layout]
        runs = {}
        for variant in args.variants.split(","):
            run = measure(dict(spec, variant=variant, tp=tp, pp=pp, dp=dp))
            runs[variant] = dict(run, busiest=busiest(run))
            top = runs[variant]["busiest"]
            print(f"[memory] {layout} {variant}: model state {top['model_state_bytes'] / 2**20:.0f}"
                  f" MiB, peak {top['peak_mem_bytes'] / 2**20:.0f} MiB (busiest rank)",
                  file=sys.stderr)
        dense = runs["dense_adam"]["busiest"]
        ratios = {variant: {
            "model_state_ratio": round(run["busiest"]["model_state_bytes"]
                                       / dense["model_state_bytes"], 4),
            "peak_ratio": round(run["busiest"]["peak_mem_bytes"] / dense["peak_mem_bytes"], 4)}
            for variant, run in runs.items() if variant != "dense_adam"}
        layouts[layout] = {"tp": tp, "pp": pp, "dp": dp, "runs": runs, "ratios": ratios}
    params = layouts[next(iter(layouts))]["runs"]["dense_adam"]["params"]
    report = {"benchmark": "memory", **spec, "params_rank0": params, "layouts": layouts}
    if args.save:
        save("memory", report, markdown(report))
    print(json.dumps(report))


def markdown(report: dict) -> str:
    """Markdown: per layout and method, the busiest rank's model state and peak (MiB) and
    their ratios to dense Adam at the same layout."""
    lines = ["| layout | method | model state (MiB) | / dense Adam | peak (MiB) | / dense Adam |",
             "|---|---|---|---|---|---|"]
    for layout, entry in report["layouts"].items():
        for variant, run in entry["runs"].items():
            top = run["busiest"]
            ratio = entry["ratios"].get(variant, {"model_state_ratio": 1, "peak_ratio": 1})
            lines.append(f"| {layout} | {variant} | {mib(top['model_state_bytes'])} | "
                         f"{ratio['model_state_ratio']:.2f} | {mib(top['peak_mem_bytes'])} | "
                         f"{ratio['peak_ratio']:.2f} |")
    return "\n".join(lines) + (
        f"\n\n{report['shape']} shape, random init, bf16, {report['microbatches']} microbatches "
        f"of {report['micro_batch_size']} x {report['seq_length']} tokens per rank, LoGRA "
        f"r={report['rank']} ({report['targets']} sketched, the rest {report['untargeted']}), "
        f"LoRA r={report['lora_rank']}; the busiest rank of each layout; peak: the live "
        f"tensor bytes of a train step (CUDA max allocated on a GPU). Measured by "
        f"`benchmarks/memory.py` on {report['device'].upper()}.\n")


if __name__ == "__main__":
    main()
