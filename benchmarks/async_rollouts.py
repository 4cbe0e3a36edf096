"""Updates per hour, synchronous vs asynchronous rollouts, one vs two engine replicas,
on the demo's setup (CPU figures).

    .venv/bin/python benchmarks/async_rollouts.py [--updates 6] [--repeats 2] [--save async_rollouts]
        [--warm-start runs/quality-long/warm-start/ckpt]

SmolLM2-135M-Instruct warm-started on gcd (the quality benchmark's warm start), LoGRA
r=64 with predicted-KL control and full-weight pushes, 16 prompts x 4 responses per
update: the demo's RL recipe (recipes/demo/rl.yaml) at trainer TP1 (one process, so
that one of the two cores can be the engine's). Variants, each a run of ``--updates``
updates, run in turns ``--repeats`` times (machine noise hits every variant alike):

- dedicated: the trainer on core 0, the engine on core 1 (--rollout-placement
  dedicated), synchronous vs --async-rollouts (one step off);
- shared: trainer and engines on both cores (inherit), one vs two engines (--rollout-
  replicas 2), synchronous vs asynchronous. Two replicas cannot each have a core of
  their own here: this shows their cost, not their gain (a GPU node's figures are
  modelled in benchmarks/throughput_model.py).

Per variant, over every update but each run's first (vLLM's warm-up): seconds per update
(``step_time_s``: rollout + train + push), updates per hour, tokens per second per trainer
process (per GPU on CUDA: ``training.throughput``), and the share of each update
the trainer waits for generation (synchronous: the rollout; asynchronous:
``rollout_wait_s``) and the engines are idle (1 - generation / update). Last stdout line:
the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _results import save

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "runs" / "bench_async"
WARM_START = REPO / "runs" / "quality-long" / "warm-start" / "ckpt"
DEMO = ["--config", str(REPO / "recipes" / "demo" / "rl.yaml"),
        "--pipeline-model-parallel-size", "1",
        "--eval-prompts", "8", "--eval-samples", "1", "--eval-interval", "0"]
ENGINE_CORE = max(os.sched_getaffinity(0))
VARIANTS = {
    "dedicated sync": ["--rollout-placement", "dedicated", "--rollout-devices", str(ENGINE_CORE)],
    "dedicated async": ["--rollout-placement", "dedicated", "--rollout-devices",
                        str(ENGINE_CORE), "--async-rollouts"],
    "shared sync 1 engine": [],
    "shared async 1 engine": ["--async-rollouts"],
    "shared sync 2 engines": ["--rollout-replicas", "2"],
    "shared async 2 engines": ["--rollout-replicas", "2", "--async-rollouts"],
}


def run_variant(name: str, repeat: int, updates: int, warm_start: Path = WARM_START) -> Path:
    """One run (skipped when its metrics are complete); its metrics.jsonl."""
    out = RUNS / f"{name.replace(' ', '-').replace(',', '')}-{repeat}"
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and len(_updates(metrics)) == updates:
        return metrics
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(REPO / "launch" / "pretrain_rl.py"), *DEMO, "--load", str(warm_start),
           "--train-iters", str(updates), "--output-dir", str(out), "--save", str(out / "ckpt"),
           *VARIANTS[name]]
    print(f"[async_rollouts] {name} (repeat {repeat + 1})", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "train.log").open("w") as log:
        subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True)
    return metrics


def _updates(metrics: Path) -> list[dict]:
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if r["step"] > 0]


def summarize(records: list[dict]) -> dict:
    """Figures of one variant's updates (each run's first left out)."""
    steps = [r["step_time_s"] for r in records]
    busy = [r["rollout_time_s"] for r in records]
    waits = [r.get("rollout_wait_s", r["rollout_time_s"]) for r in records]
    mean = statistics.mean(steps)
    return {"updates": len(records), "s_per_update": mean, "updates_per_h": 3600 / mean,
            **tokens_per_gpu(records),
            "rollout_s": statistics.mean(busy),
            "train_s": statistics.mean(r["train_time_s"] for r in records),
            "push_s": statistics.mean(r["sync_time_s"] for r in records),
            "trainer_waits": sum(waits) / sum(steps),
            "engines_idle": max(0.0, 1 - sum(busy) / sum(steps)),
            "stale_dropped": sum(r.get("stale_dropped_kl", 0) + r.get("stale_dropped_versions", 0)
                                 for r in records)}


def tokens_per_gpu(records: list[dict]) -> dict:
    """Tokens per second per trainer process (per GPU on CUDA; ``training.throughput``)
    over the variant's updates: each update's tokens per process summed, over all their
    seconds; None from runs older than these figures."""
    seconds = sum(r["step_time_s"] for r in records)
    out = {}
    for kind in ("generated", "trained"):
        key = f"{kind}_tokens_per_s_per_gpu"
        out[key] = sum(r[key] * r["step_time_s"] for r in records) / seconds \
            if all(key in r for r in records) else None
    return out


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(report: dict) -> str:
    rows = ["| variant | updates | s / update | rollout s | train s | push s | updates / h | "
            "tokens/s/GPU generated / trained | trainer waits | engines idle |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in report["variants"].items():
        rows.append(f"| {name} | {v['updates']} | {v['s_per_update']:.1f} | {v['rollout_s']:.1f} "
                    f"| {v['train_s']:.1f} | {v['push_s']:.2f} | **{v['updates_per_h']:.0f}** | "
                    f"{_rate(v.get('generated_tokens_per_s_per_gpu'))} / "
                    f"{_rate(v.get('trained_tokens_per_s_per_gpu'))} | "
                    f"{v['trainer_waits']:.0%} | {v['engines_idle']:.0%} |")
    said = {"dedicated": "asynchronous / synchronous, dedicated cores",
            "shared_1": "asynchronous / synchronous, one engine on shared cores",
            "shared_2": "asynchronous / synchronous, two engines on shared cores",
            "replicas_sync": "two engines / one, synchronous, shared cores"}
    ratios = "; ".join(f"{said[k]} {v:.2f}x" for k, v in report["ratios"].items()
                       if v == v)  # NaN: a variant not run
    return ("\n".join(rows) + "\n\nUpdates per hour, " + ratios + ".\n\n" + report["setup"]
            + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--updates", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--warm-start", type=Path, default=WARM_START,
                   help="the SmolLM2 gcd warm start (benchmarks/quality.py makes one)")
    p.add_argument("--save", metavar="NAME", help="write benchmarks/results/NAME.{json,md}")
    args = p.parse_args(argv)
    if not (args.warm_start / "latest").is_file():
        raise SystemExit(f"needs {args.warm_start}: run benchmarks/quality.py once (it makes "
                         f"the warm start), or pass --warm-start")
    names = args.variants.split(",")
    records: dict[str, list[dict]] = {n: [] for n in names}
    for repeat in range(args.repeats):
        for name in names:
            records[name] += _updates(run_variant(name, repeat, args.updates,
                                                  args.warm_start))[1:]
    variants = {n: summarize(r) for n, r in records.items()}
    per_h = {n: v["updates_per_h"] for n, v in variants.items()}
    ratio = lambda a, b: per_h[a] / per_h[b] if a in per_h and b in per_h else float("nan")  # noqa: E731
    report = {"variants": variants, "ratios": {
        "dedicated": ratio("dedicated async", "dedicated sync"),
        "shared_1": ratio("shared async 1 engine", "shared sync 1 engine"),
        "shared_2": ratio("shared async 2 engines", "shared sync 2 engines"),
        "replicas_sync": ratio("shared sync 2 engines", "shared sync 1 engine")},
        "setup": f"CPU figures, 2 cores: SmolLM2-135M-Instruct, the demo's RL recipe at trainer "
                 f"TP1 (LoGRA r=64, predicted-KL control, full pushes, 16 x 4 samples "
                 f"per update), {args.updates} updates per run, {args.repeats} runs per "
                 f"variant in turns, each run's first update left out; measured by "
                 f"benchmarks/async_rollouts.py."}
    if args.save:
        save(args.save, report, markdown(report))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
