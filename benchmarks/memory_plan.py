"""Per-rank memory of dense Adam, LoGRA and LoRA: a model, validated by measurement, projected.

    .venv/bin/python benchmarks/memory_plan.py [--measured memory.json] [--gpu-gib 80,141]

The model is ``megatron_logra.memory`` (every tensor a rank holds, from the model megatron
builds; activations op by op; the optimizer step's transient). This script prints, as one
JSON line (``--save``: also results/memory_plan.json and a table in memory_plan.md):

1. Validation against ``benchmarks/memory.py`` at every layout it measured (DP1, DP2,
   DP4, TP2, PP2): the busiest rank's model state within 2% and its peak within 10%.
2. Projection: 1.5B, 7B and a Qwen3-style 27B (``megatron_logra/assets/qwen3-27b``, which
   ``model/arch.py`` loads) on 8 GPUs of each ``--gpu-gib``, at the paper's sequence
   length (4096), microbatch 1 and activation checkpointing, for the TP/PP/DP layouts
   the trainer's CLI accepts for each method (LoGRA cannot sketch qkv when TP exceeds
   the kv heads: that layout is not listed for it).
3. The rollout engine's share for each placement: the engine's GPUs (weights, the
   rollout batch's KV cache, an assumed overhead) beside the trainer's on the rest of the
   8 (dedicated), or on the same GPUs in turns (colocated).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from _results import save

from megatron_logra.memory.forecast import (ENGINE_ASLEEP_GIB, ENGINE_OVERHEAD_GIB, METHODS,
                                              ROLLOUT_SEQS, ROLLOUT_TOKENS, placements,
                                              project, validate)
from megatron_logra.memory.shapes import CONFIG_SHAPES

HERE = Path(__file__).resolve().parent


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--measured", help="benchmarks/memory.py's JSON: its stdout or its --save "
                   "file (default: run it)")
    p.add_argument("--gpu-gib", default="80,141", help="GPU sizes to project on, comma list")
    p.add_argument("--save", action="store_true",
                   help="also write benchmarks/results/memory_plan.json and memory_plan.md")
    args = p.parse_args(argv)
    if args.measured:
        text = Path(args.measured).read_text().strip()
        try:  # benchmarks/results/memory.json (indented), or memory.py's stdout
            measured = json.loads(text)
        except json.JSONDecodeError:
            measured = json.loads(text.splitlines()[-1])
    else:
        proc = subprocess.run([sys.executable, str(HERE / "memory.py")],
                              capture_output=True, text=True, check=True)
        measured = json.loads(proc.stdout.strip().splitlines()[-1])
    gibs = [float(g) for g in args.gpu_gib.split(",")]
    report = {"benchmark": "memory_plan", "gpu_gib": gibs, "validation": validate(measured),
              "projection": project(gibs), "engine_placements": placements(gibs)}
    if args.save:
        save("memory_plan", report, table(report, measured))
    print(json.dumps(report))


def table(report: dict, measured: dict) -> str:
    """Markdown: the validation, then per projected model the busiest rank's peak (GiB) per
    layout and method, marked where it fits 90% of each GPU size."""
    lines = [f"Validation against `benchmarks/memory.py` ({measured['shape']} shape, "
             f"{measured['device'].upper()}), busiest rank:", "",
             "| layout and method | model state: predicted / measured (MiB) | error | "
             "peak: predicted / measured (MiB) | error |", "|---|---|---|---|---|"]
    for key, v in report["validation"].items():
        if key == "ok":
            continue
        lines.append(f"| {key} | {v['predicted_state_bytes'] / 2**20:.0f} / "
                     f"{v['measured_state_bytes'] / 2**20:.0f} | {v['state_rel_error']:.1%} | "
                     f"{v['predicted_peak_bytes'] / 2**20:.0f} / "
                     f"{v['measured_peak_bytes'] / 2**20:.0f} | {v['peak_rel_error']:.1%} |")
    gibs = report["gpu_gib"]
    sizes = " / ".join(f"{g:g}" for g in gibs)
    lines += ["", "**Projection** (not measured): 8 GPUs, seq 4096, microbatch 1, full "
              "recompute, LoGRA r=256 (q/k/v/o/gate/up/down, the rest frozen), LoRA r=16; "
              f"peak GiB of the busiest rank; fits: under 90% of {sizes} GiB; - : the CLI "
              "refuses the layout for that method.", ""]
    for name, entry in report["projection"].items():
        where = ("megatron_logra/assets/" if entry["config"] in CONFIG_SHAPES
                 else "memory.shapes.SHAPES, ") + entry["config"]
        paper = entry["paper_table1_avg_gib"]
        lines += [f"{name} ({where}, {entry['params'] / 1e9:.2f}B parameters; the paper's "
                  f"Table 1, average GiB per GPU: dense Adam {paper['dense_adam']}, LoGRA "
                  f"{paper['logra']}):", "",
                  "| layout | " + " | ".join(METHODS) + " |", "|---|" + "---|" * len(METHODS)]
        for row in entry["layouts"]:
            cells = []
            for variant in METHODS:
                got = row.get(variant)
                if got is None:
                    cells.append("-")
                    continue
                fits = "/".join("fits" if got[f"fits_{g:g}gib"] else "no" for g in gibs)
                cells.append(f"{got['peak_gib']} ({fits})")
            lines.append(f"| {row['layout']} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += engine_table(report)
    return "\n".join(lines)


def engine_table(report: dict) -> list[str]:
    """Markdown: per model and method, how many (engine TP, trainer layout) pairs fit with
    the engine dedicated and colocated, on 8 GPUs of each size, and the engine's share."""
    gibs = report["gpu_gib"]
    lines = ["**The rollout engine's share** (projection, not measured; "
             "`--rollout-placement`): per engine GPU, bf16 weights over the engine's TP, the "
             f"KV cache of the paper's rollout batch ({ROLLOUT_SEQS} x {ROLLOUT_TOKENS} "
             "tokens, all of it at once: the upper bound; a smaller --rollout-kv-cache-gib "
             "generates the batch in waves) and an assumed "
             f"{ENGINE_OVERHEAD_GIB:g} GiB of vLLM overhead. "
             "Dedicated: the engine on GPUs of its own, the trainer on the other 8 - TP. "
             "Colocated: the same 8 GPUs in turns, the trainer's model state kept while the "
             f"engine generates, an assumed {ENGINE_ASLEEP_GIB:g} GiB left by the sleeping "
             "engine while the trainer trains (dense Adam's optimizer state is not "
             "offloaded). Cells: the number of (engine TP, trainer layout) pairs that fit "
             "under 90% of the GPU, and the first of them.", ""]
    for name, entry in report["engine_placements"].items():
        share = ", ".join(f"{k} {v} GiB" for k, v in entry["engine_gib"].items())
        lines += [f"{name}, engine per GPU: {share}", "",
                  "| method | " + " | ".join(f"{mode} on {g:g} GiB" for g in gibs
                                             for mode in ("dedicated", "colocated")) + " |",
                  "|---|" + "---|" * (2 * len(gibs))]
        for variant in METHODS:
            cells = []
            for g in gibs:
                for mode in ("dedicated", "colocated"):
                    fits = entry[variant][f"{g:g}gib"][mode]
                    cells.append(f"{len(fits)}: {fits[0]}" if fits else "0")
            lines.append(f"| {variant} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


if __name__ == "__main__":
    main()
