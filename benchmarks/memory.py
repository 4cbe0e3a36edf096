"""Dense Adam (megatron distributed optimizer) vs LoGRA: model-state bytes and peak memory.

    .venv/bin/python benchmarks/memory.py [--shape smollm2-135m] [--device cpu|cuda]
        [--rank 256] [--seq-length 256] [--micro-batch-size 1] [--microbatches 2]

Same model (bf16 params, random init), same layout (one process, TP1), same batch.
LoGRA as the paper runs it by default: qkv/proj/fc1/fc2 sketched, everything else
frozen (``--untargeted adam`` trains those with megatron's Adam instead).
Per variant: model-state bytes by category (params, DDP grad buffers, dense
optimizer state and fp32 mains, LoGRA sketches/row states/masters), counted by
enumerating every tensor held, and the measured peak memory of train steps.
Ratios LoGRA / dense per precision mode. Targets: model-state ratio <= 0.35
(fp32 master), <= 0.15 (none); peak ratio <= 0.6. Last stdout line: the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _train_probe import SHAPES, VARIANTS, measure  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--rank", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--recompute", action="store_true", help="full activation recompute")
    p.add_argument("--targets", default="qkv,proj,fc1,fc2",
                   help="LoGRA's sketched weights (--logra-targets; the paper's four)")
    p.add_argument("--untargeted", choices=("frozen", "adam"), default="frozen",
                   help="LoGRA's unsketched parameters (--logra-untargeted; the paper freezes)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    spec = {"shape": args.shape, "device": args.device, "rank": args.rank,
            "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size,
            "microbatches": args.microbatches, "steps": args.steps, "recompute": args.recompute,
            "targets": args.targets, "untargeted": args.untargeted}
    runs = {}
    for variant in VARIANTS:
        runs[variant] = measure(dict(spec, variant=variant))
        print(f"[memory] {variant}: state {runs[variant]['model_state_bytes']}, peak "
              f"{runs[variant]['peak_mem_bytes'] / 2**20:.0f} MiB", file=sys.stderr)
    dense = runs["dense_adam"]
    report = {"benchmark": "memory", **spec, "params": dense["params"], "runs": runs}
    for variant in ("logra_fp32_master", "logra_none"):
        report[variant] = {
            "model_state_bytes_ratio": round(runs[variant]["model_state_bytes"]["total"]
                                             / dense["model_state_bytes"]["total"], 4),
            "peak_mem_ratio": round(runs[variant]["peak_mem_bytes"] / dense["peak_mem_bytes"], 4)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
