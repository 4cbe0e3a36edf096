"""Dense Adam vs LoGRA train-step time on the same model and batch.

    .venv/bin/python benchmarks/step_time.py [--shape smollm2-135m] [--device cpu|cuda] ...

The dense weight-gradient GEMM (dY^T X, out x in) is replaced by two thin ones
(X A^T and dY^T (X A^T), rank r), plus the low-rank update. Key
``step_time_ratio`` = LoGRA / dense (best of the timed steps, first step
excluded), target <= 1.0. Last stdout line: the JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _train_probe import measure  # noqa: E402
from memory import parse  # noqa: E402


def main(argv=None) -> None:
    args = parse(argv)
    spec = {"shape": args.shape, "device": args.device, "rank": args.rank,
            "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size,
            "microbatches": args.microbatches, "steps": max(args.steps, 6),
            "recompute": args.recompute, "targets": args.targets,
            "untargeted": args.untargeted}
    runs = {v: measure(dict(spec, variant=v)) for v in ("dense_adam", "logra_fp32_master")}
    report = {"benchmark": "step_time", **spec,
              "dense_step_time_s": runs["dense_adam"]["step_time_s"],
              "logra_step_time_s": runs["logra_fp32_master"]["step_time_s"],
              "step_times_s": {v: r["step_times_s"] for v, r in runs.items()}}
    report["step_time_ratio"] = round(report["logra_step_time_s"] / report["dense_step_time_s"], 4)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
