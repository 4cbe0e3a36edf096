"""RL learning on the tiny model: dense Adam, LoGRA and LoRA, two seeds, one protocol.

    .venv/bin/python benchmarks/learning.py [--methods adam,logra,lora] [--seeds "seed 1,seed 2"] [--save learning]

The protocol of tests/integration/test_rl_learning.py (``megatron_logra.testing.learning``:
the embedded tiny model after 60 SFT updates on gcd, 30 GRPO updates of 32 x 8 with real
vLLM rollouts, held-out pass@1 on 512 prompts x 2 samples, paired before/after). The
suite runs LoGRA on seed 1; this runs the comparison, resumable (a finished run is read
back, not rerun). Each run passes when it gains at least ``MIN_GAIN`` and more than 3
SE. CPU figures. Last stdout line: the JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _results import save

from megatron_logra.testing.learning import (MIN_GAIN, OPTIMIZERS, SEEDS, UPDATES,
                                             held_out_gain, rl_run, warm_start)

RUNS = Path(__file__).resolve().parents[1] / "runs" / "bench_learning"


def _run(method: str, seed: str) -> dict:
    out = RUNS / f"{method}-{seed.replace(' ', '')}"
    metrics = out / "metrics.jsonl"
    records = ([json.loads(line) for line in metrics.read_text().splitlines()]
               if metrics.is_file() else [])
    if not records or records[-1]["step"] != UPDATES:
        warm = RUNS / "warm-start"  # the test's, for every seed of the RL runs
        if not (warm / "ckpt" / "latest").is_file():
            print("[learning] warm start", flush=True)
            warm_start(warm)
        print(f"[learning] {method} ({seed})", flush=True)
        out.mkdir(parents=True, exist_ok=True)
        records = rl_run(method, warm / "ckpt", out, SEEDS[seed])
    got = held_out_gain(records)
    got["passes"] = got["gain"] >= MIN_GAIN and got["gain"] > 3 * got["se"]
    return got


def markdown(report: dict) -> str:
    """Markdown: per method (its flags) and seed, pass@1 before -> after and the paired
    gain +- one SE."""
    seeds = list(next(iter(report["runs"].values())))
    seed_flags = report.get("seed_flags", {})
    head = [f"{s} (`{' '.join(seed_flags[s])}`)" if seed_flags.get(s) else s for s in seeds]
    rows = ["| method | " + " | ".join(head) + " |", "|---|" + "---|" * len(seeds)]
    for method, by_seed in report["runs"].items():
        flags = report.get("method_flags", {}).get(method)
        cells = [f"{g['before']:.3f} -> {g['after']:.3f}: **{g['gain']:+.3f} +- {g['se']:.3f}** "
                 f"({g['gain'] / g['se']:.1f} SE){'' if g['passes'] else ', below the margin'}"
                 for g in by_seed.values()]
        label = f"{method} (`{' '.join(flags)}`)" if flags else method
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n\n" + report["setup"] + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default=",".join(OPTIMIZERS))
    p.add_argument("--seeds", default=",".join(SEEDS))
    p.add_argument("--save", metavar="NAME", help="write benchmarks/results/NAME.{json,md}")
    args = p.parse_args(argv)
    runs = {m: {s: _run(m, s) for s in args.seeds.split(",")} for m in args.methods.split(",")}
    report = {"benchmark": "learning", "runs": runs, "min_gain": MIN_GAIN,
              "method_flags": {m: OPTIMIZERS[m] for m in runs},
              "seed_flags": {s: SEEDS[s] for s in args.seeds.split(",")}, "setup": (
        "The tiny model (hidden 128, 4 layers, byte vocabulary) after 60 SFT updates on gcd, "
        "30 GRPO updates of 32 prompts x 8 responses, real vLLM rollouts and gcd verifier; "
        "held-out pass@1 on 512 prompts x 2 samples at temperature 1.0, paired gain +- one "
        f"SE; a run passes at >= {MIN_GAIN} and > 3 SE. Every seed starts from the same warm start. "
        "CPU figures, benchmarks/learning.py.")}
    if args.save:
        save(args.save, report, markdown(report))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
