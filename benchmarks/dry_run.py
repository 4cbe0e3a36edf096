"""The dry run (``launch/pretrain_rl.py --dry-run``) at full size: checked against what is
measured and planned, and the 27B recipe's scaling over GPU counts.

    nice -n 5 .venv/bin/python benchmarks/dry_run.py [--parts measured,analytic,gpu_check,
        scaling] [--cache DIR] [--save] [--scaling-gpus 8,16,32,64] [--scaling-methods ...]
        [--measured-layouts DP4,DP2,DP1,TP3,PP2]

Every trace is the launcher's own ``--dry-run`` of one rank, in a process of its own (its
CPU time, wall time and peak RSS recorded: what a dry run costs). Parts:

1. ``measured``: at the SmolLM2 shape, the layouts and methods ``benchmarks/memory.py``
   measured (``results/memory.json``: DP4, DP2, DP1, TP3, PP2; dense Adam, LoGRA with an
   fp32 master or bf16 only, LoRA), the same train step (SFT stage: 2 microbatches of
   1 x 256 tokens per rank, r=256, LoRA r=16), every rank the dry run would trace: the
   busiest rank's model state and peak against the measured busiest rank's.
2. ``analytic``: the paper's recipes (``recipes/paper/{dense,logra}-{1.5b,7b,27b}.yaml``)
   on 8 GPUs, their whole RL update (128 prompts, 4096 tokens, LoGRA's predicted-KL
   control), one rank per pipeline stage (TP and DP rank 0: the ranks of a stage hold
   the same shapes), against the memory plan (``memory.forecast.paper_plan``) of that
   stage: model state and peak.
3. ``gpu_check``: the 1.5B step ``benchmarks/gpu_check.py`` measures on one GPU (dense
   Adam, LoGRA fp32 master, LoRA; 1 x 4096 tokens, recompute): the figures it compares
   its measured peaks with.
4. ``scaling``: the 27B recipe at 8, 16, 32 and 64 GPUs as TP4 x PP2 x DP (the paper's
   layout, data parallel grown), dense Adam, LoGRA (fp32 master; bf16 only) and LoRA
   (the dense recipe with r=16 adapters): per-rank model state and peak. One rank per
   GPU count and method: TP and DP rank 0 of the busier pipeline stage (the other ranks
   of a stage hold the same shapes, their data-parallel shard of the same size, and send
   no weights); at the first GPU count every stage is traced and the row is the stage
   the trace finds busier, at the others the stage the memory plan puts the higher peak
   on (at 8 GPUs the plan and the trace disagree for dense Adam: 1.3 GiB).

``--cache DIR`` keeps each trace's report (a rerun skips what is there; instances sharing
it split the traces: one waits for a trace another is running). Last stdout line:
the JSON; ``--save`` writes ``results/dry_run.json``, ``dry_run.md`` (``markdown``) and
``dry_run.png`` (the scaling plot).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import RESULTS, save

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
PARTS = ("measured", "analytic", "gpu_check", "scaling")
TOLERANCE = 0.10  # what the issue calls agreeing: within 10%

SMOLLM2_LAYOUTS = {"DP4": (1, 1, 4), "DP2": (1, 1, 2), "DP1": (1, 1, 1), "TP3": (3, 1, 1),
                   "PP2": (1, 2, 1)}
VARIANT_FLAGS = {  # benchmarks/_train_probe.VARIANTS as launcher flags
    "dense_adam": ["--optimizer", "adam"],
    "logra_fp32_master": ["--optimizer", "logra", "--logra-rank", "256",
                          "--logra-master-weights", "fp32", "--logra-update-ratio", "6e-5",
                          "--logra-targets", "qkv,proj,fc1,fc2", "--logra-untargeted",
                          "frozen"],
    "logra_none": ["--optimizer", "logra", "--logra-rank", "256", "--logra-master-weights",
                   "none", "--logra-update-ratio", "6e-5", "--logra-targets",
                   "qkv,proj,fc1,fc2", "--logra-untargeted", "frozen"],
    "lora": ["--optimizer", "adam", "--peft", "lora", "--lora-rank", "16"],
}
PAPER = {"1.5B": ("qwen2.5-1.5b", 1, 1), "7B": ("qwen2.5-7b", 2, 1), "27B": ("qwen3-27b", 4, 2)}
SCALING_GPUS = (8, 16, 32, 64)
SCALING_METHODS = {  # name -> (recipe, extra flags, memory plan method and master)
    "dense_adam": ("dense", [], ("dense_adam", "fp32")),
    "logra_fp32_master": ("logra", [], ("logra", "fp32")),
    "logra_none": ("logra", ["--logra-master-weights", "none"], ("logra", "none")),
    "lora": ("dense", ["--peft", "lora", "--lora-rank", "16"], ("lora", "fp32")),
}


def model_dir(shape: str) -> str:
    from megatron_logra.memory.shapes import ASSETS, CONFIG_SHAPES, shape_dir

    return str(ASSETS / shape) if shape in CONFIG_SHAPES else shape_dir(shape)


class Tracer:
    """Runs one rank's ``--dry-run`` in a process of its own (cached by its command)."""

    def __init__(self, cache: Path | None):
        self.cache = cache
        self.done: dict[str, dict] = {}  # this run's traces by key (parts share some)

    def __call__(self, flags: list[str], rank: int, world: int) -> dict:
        argv = [*flags, "--dry-run", "--dry-run-world-size", str(world),
                "--dry-run-ranks", str(rank)]
        key = hashlib.sha256(json.dumps(argv).encode()).hexdigest()[:16]
        if key in self.done:
            return self.done[key]
        cached = self.cache / f"{key}.json" if self.cache else None
        if cached is not None:
            self.cache.mkdir(parents=True, exist_ok=True)
            while not cached.is_file():
                try:
                    cached.with_suffix(".running").touch(exist_ok=False)  # ours to trace
                except FileExistsError:  # another instance sharing the cache traces it
                    time.sleep(5)
                    continue
                break
            else:
                self.done[key] = json.loads(cached.read_text())
                return self.done[key]
        try:
            result = self._trace(argv, rank, world)
        finally:
            if cached is not None:
                cached.with_suffix(".running").unlink(missing_ok=True)
        if cached is not None:
            tmp = cached.with_suffix(".tmp")
            tmp.write_text(json.dumps(result))
            tmp.replace(cached)
        self.done[key] = result
        return result

    def _trace(self, argv: list[str], rank: int, world: int) -> dict:
        with tempfile.TemporaryDirectory() as out:
            load_before, start = os.getloadavg(), time.perf_counter()
            with open(Path(out) / "stderr", "w+") as err:
                proc = subprocess.Popen(
                    [sys.executable, str(REPO / "launch/pretrain_rl.py"), *argv,
                     "--output-dir", out], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                    env=dict(os.environ, OMP_NUM_THREADS="1"))
                _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage
                proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
                wall = time.perf_counter() - start
                err.seek(0)
                stderr = err.read()
            report_file = Path(out) / "dry_run.json"
            if not report_file.is_file():
                raise SystemExit(f"dry run {argv} failed:\n{stderr[-4000:]}")
            report = json.loads(report_file.read_text())
        (rank_report,) = report["ranks"]
        cost = {"argv": argv, "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
                "wall_s": round(wall, 1), "max_rss_bytes": usage.ru_maxrss * 1024,
                "trace_cpu_s": rank_report.get("trace_cpu_seconds"),
                # the machine is shared: its load (1-min average) around the trace, its cores
                "loadavg_before": round(load_before[0], 2),
                "loadavg_after": round(os.getloadavg()[0], 2), "cores": os.cpu_count()}
        result = {"report": report, "rank": rank_report, "cost": cost}
        print(f"[dry_run] {' '.join(argv[:4])} ... rank {rank}/{world}: peak "
              f"{rank_report.get('peak_bytes', 0) / GIB:.2f} GiB, {cost['cpu_s']} s CPU, "
              f"errors {len(rank_report['errors'])}", file=sys.stderr, flush=True)
        return result


def _rel(got: float, ref: float) -> float:
    return round((got - ref) / ref, 4) if ref else float("nan")


def measured_part(trace: Tracer, layouts: tuple[str, ...] = tuple(SMOLLM2_LAYOUTS)) -> dict:
    """Dry run vs benchmarks/memory.py's measured busiest rank, per layout and method."""
    from megatron_logra.dry_run.run import representatives

    measured = json.loads((RESULTS / "memory.json").read_text())
    rows = []
    for layout, entry in measured["layouts"].items():
        if layout not in layouts:
            continue
        tp, pp, dp = SMOLLM2_LAYOUTS[layout]
        for variant, run in entry["runs"].items():
            flags = ["--stage", "sft", "--model-dir", model_dir(measured["shape"]), "--bf16",
                     "--use-distributed-optimizer", "--lr", "1e-5", "--seq-length",
                     str(measured["seq_length"]), "--micro-batch-size",
                     str(measured["micro_batch_size"]), "--global-batch-size",
                     str(measured["microbatches"] * dp), "--train-iters", "3",
                     "--transformer-impl", "local", "--tensor-model-parallel-size", str(tp),
                     "--pipeline-model-parallel-size", str(pp), *VARIANT_FLAGS[variant]]
            ranks = [trace(flags, r, tp * pp * dp)["rank"]
                     for r in representatives(tp, pp, dp)]
            state = max(r["model_state_bytes"]["total"] for r in ranks)
            peak = max(r["peak_bytes"] for r in ranks)
            got = run["busiest"]
            rows.append({"layout": layout, "variant": variant,
                         "measured_state_bytes": got["model_state_bytes"],
                         "dry_run_state_bytes": state,
                         "state_rel": _rel(state, got["model_state_bytes"]),
                         "measured_peak_bytes": got["peak_mem_bytes"],
                         "dry_run_peak_bytes": peak,
                         "peak_rel": _rel(peak, got["peak_mem_bytes"])})
    return {"shape": measured["shape"], "device": measured["device"], "rows": rows,
            "measured_commit": measured.get("provenance", {}).get("commit"),
            "within_10pc": all(abs(r["state_rel"]) <= TOLERANCE
                               and abs(r["peak_rel"]) <= TOLERANCE for r in rows)}


def paper_flags(size: str, recipe: str) -> list[str]:
    return ["--config", str(REPO / f"recipes/paper/{recipe}-{size.lower()}.yaml"),
            "--model-dir", model_dir(PAPER[size][0])]


def stage_ranks(tp: int, pp: int, dp: int) -> dict[int, int]:
    """{stage: its TP-0, DP-0 rank}."""
    from megatron_logra.dry_run.run import global_rank

    return {stage: global_rank(0, 0, stage, tp, dp) for stage in range(pp)}


def analytic_part(trace: Tracer) -> dict:
    """Dry run of the paper's recipes on 8 GPUs vs the memory plan, per pipeline stage."""
    from megatron_logra.memory.forecast import paper_plan

    rows = []
    for size, (shape, tp, pp) in PAPER.items():
        dp = 8 // (tp * pp)
        for recipe, (method, master) in (("dense", ("dense_adam", "fp32")),
                                         ("logra", ("logra", "fp32"))):
            stages = paper_plan(shape, tp, pp, dp, method, master)["stages"]
            for stage, rank in stage_ranks(tp, pp, dp).items():
                result = trace(paper_flags(size, recipe), rank, 8)
                r, planned = result["rank"], stages[stage]
                rows.append({"model": size, "recipe": recipe, "layout": f"TP{tp} PP{pp} DP{dp}",
                             "stage": stage, "rank": rank,
                             "dry_run_state_bytes": r["model_state_bytes"]["total"],
                             "plan_state_bytes": int(planned["model_state"]),
                             "state_rel": _rel(r["model_state_bytes"]["total"],
                                               planned["model_state"]),
                             "dry_run_peak_bytes": r["peak_bytes"],
                             "plan_peak_bytes": int(planned["peak"]),
                             "peak_rel": _rel(r["peak_bytes"], planned["peak"]),
                             "peak_site": r.get("update_peak_site", [])[-4:],
                             "cost": result["cost"], "errors": r["errors"]})
    return {"rows": rows, "within_10pc": all(abs(r["state_rel"]) <= TOLERANCE
                                             and abs(r["peak_rel"]) <= TOLERANCE
                                             for r in rows)}


GPU_CHECK_SPEC = {"shape": "qwen2.5-1.5b", "seq_length": 4096, "micro_batch_size": 1,
                  "microbatches": 1, "recompute": True, "rank": 256}  # gpu_check.GPU's probe


def gpu_check_part(trace: Tracer) -> dict:
    """The dry run of gpu_check.py's 1.5B step on one GPU, per method it measures."""
    spec = GPU_CHECK_SPEC
    out = {"spec": spec, "variants": {}}
    for variant in ("dense_adam", "logra_fp32_master", "lora"):
        flags = ["--stage", "sft", "--model-dir", model_dir(spec["shape"]), "--bf16",
                 "--use-distributed-optimizer", "--recompute-activations", "--lr", "1e-5",
                 "--seq-length", str(spec["seq_length"]), "--micro-batch-size", "1",
                 "--global-batch-size", "1", "--train-iters", "3", "--transformer-impl",
                 "local", *VARIANT_FLAGS[variant]]
        r = trace(flags, 0, 1)["rank"]
        out["variants"][variant] = {"peak_mem_bytes": r["peak_bytes"],
                                    "model_state_bytes": r["model_state_bytes"]["total"]}
    return out


def scaling_part(trace: Tracer, gpu_counts: tuple[int, ...] = SCALING_GPUS,
                 methods: tuple[str, ...] = tuple(SCALING_METHODS)) -> dict:
    """The 27B recipe at 8-64 GPUs, TP4 x PP2 x DP, per method (see the module doc)."""
    from megatron_logra.memory.forecast import paper_plan

    tp, pp = PAPER["27B"][1:]
    rows, busier = [], {}
    for gpus in gpu_counts:
        dp = gpus // (tp * pp)
        ranks = stage_ranks(tp, pp, dp)
        for name in methods:
            recipe, extra, (method, master) = SCALING_METHODS[name]
            planned = paper_plan("qwen3-27b", tp, pp, dp, method, master)["stages"]
            flags = [*paper_flags("27B", recipe), *extra]
            if gpus == gpu_counts[0]:
                # every stage traced: the row is the one the trace finds busier
                traced = {s: trace(flags, ranks[s], gpus)["rank"] for s in range(pp)}
                stage = max(reversed(range(pp)), key=lambda s: traced[s]["peak_bytes"])
            else:
                # the plan's busier stage (a tie: the last, which also computes the logits)
                stage = max(reversed(range(pp)), key=lambda s: planned[s]["peak"])
            busier.setdefault(name, {})[gpus] = stage
            r = trace(flags, ranks[stage], gpus)["rank"]
            rows.append({"gpus": gpus, "layout": f"TP{tp} PP{pp} DP{dp}", "method": name,
                         "stage": stage, "rank": r["rank"],
                         "stands_for": f"stage {stage}: {gpus // pp} ranks",
                         "model_state_bytes": r["model_state_bytes"]["total"],
                         "peak_bytes": r["peak_bytes"],
                         "peak_by_category": max(
                             (r.get("update_peak", {}), r.get("push_peak", {})),
                             key=lambda p: p.get("total", 0)),
                         "engine_bytes": r.get("engine_bytes", 0),
                         "plan_peak_bytes": int(planned[stage]["peak"]),
                         "trace_cpu_s": r.get("trace_cpu_seconds"),
                         "errors": r["errors"]})
    return {"layout": "TP4 PP2 DP=GPUs/8", "rows": rows, "busier_stage": busier}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {PARTS}")
    p.add_argument("--cache", help="keep each trace's report here (a rerun reuses them)")
    p.add_argument("--save", action="store_true",
                   help="write results/dry_run.json, dry_run.md and dry_run.png")
    p.add_argument("--scaling-gpus", default=",".join(map(str, SCALING_GPUS)),
                   help="the scaling part's GPU counts (the first: both stages traced)")
    p.add_argument("--scaling-methods", default=",".join(SCALING_METHODS),
                   help=f"the scaling part's methods, of {tuple(SCALING_METHODS)}")
    p.add_argument("--measured-layouts", default=",".join(SMOLLM2_LAYOUTS),
                   help=f"the measured part's layouts, of {tuple(SMOLLM2_LAYOUTS)}")
    args = p.parse_args(argv)
    trace = Tracer(Path(args.cache) if args.cache else None)
    parts = {"measured": lambda t: measured_part(t, tuple(args.measured_layouts.split(","))),
             "analytic": analytic_part, "gpu_check": gpu_check_part,
             "scaling": lambda t: scaling_part(
                 t, tuple(int(g) for g in args.scaling_gpus.split(",")),
                 tuple(args.scaling_methods.split(",")))}
    report: dict = {"benchmark": "dry_run"}
    for name in args.parts.split(","):
        report[name] = parts[name](trace)
    if "analytic" in report:  # what one rank of the 27B LoGRA recipe costs, traced alone
        report["cost_27b_rank"] = max(
            (dict(r["cost"], rank=r["rank"]) for r in report["analytic"]["rows"]
             if r["model"] == "27B" and r["recipe"] == "logra"), key=lambda c: c["cpu_s"])
    if args.save:
        save("dry_run", report, markdown(report))
        if "scaling" in report:
            plot(report, RESULTS / "dry_run.png")
    print(json.dumps(report))


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f}"


def pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def markdown(report: dict) -> str:
    """The docs' tables (docs/results.md, ``<!-- BEGIN GENERATED: dry_run -->``) from the
    report: the scaling study, then the dry run against what is planned and measured."""
    out = []
    if "scaling" in report:
        out += ["Per-rank GPU memory of the 27B recipe (Qwen3-style 27B, TP4 x PP2, data "
                "parallel grown with the GPUs; 128 prompts x 4096 tokens per update), traced "
                "by `launch/pretrain_rl.py --dry-run` (GiB):", "",
                "| GPUs | layout | method | stage | model state | peak | of which activations "
                "| plan's peak | fits 80 GiB | fits 141 GiB |", "|---" * 10 + "|"]
        for r in report["scaling"]["rows"]:
            need = r["peak_bytes"]
            out.append(f"| {r['gpus']} | {r['layout']} | {r['method']} | {r['stage']} | "
                       f"{gib(r['model_state_bytes'])} | {gib(r['peak_bytes'])} | "
                       f"{gib(r['peak_by_category'].get('activations', 0))} | "
                       f"{gib(r['plan_peak_bytes'])} | {'yes' if need <= 0.9 * 80 * GIB else 'no'}"
                       f" | {'yes' if need <= 0.9 * 141 * GIB else 'no'} |")
        out += ["", "Fits: the peak within 90% of the GPU; the colocated rollout engine's "
                "share (the recipes' engine TP8 on node 0's GPUs) is not included here (the "
                "dry run's own table adds it on the ranks it shares). Each row is the TP-0, "
                "DP-0 rank of the pipeline stage the memory plan puts the higher peak on "
                "(the other ranks of a stage hold the same shapes); the comparison with the "
                "plan below traces both stages at 8 GPUs.", ""]
    if "analytic" in report:
        out += ["The dry run against the memory plan (`memory.forecast.paper_plan`), the "
                "paper's recipes on 8 GPUs, one rank per pipeline stage (GiB):", "",
                "| model | recipe | layout | stage | state: dry run / plan | peak: dry run / "
                "plan | peak difference |", "|---|---|---|---|---|---|---|"]
        for r in report["analytic"]["rows"]:
            out.append(f"| {r['model']} | {r['recipe']} | {r['layout']} | {r['stage']} | "
                       f"{gib(r['dry_run_state_bytes'])} / {gib(r['plan_state_bytes'])} | "
                       f"{gib(r['dry_run_peak_bytes'])} / {gib(r['plan_peak_bytes'])} | "
                       f"{pct(r['peak_rel'])} |")
        out.append("")
    if "measured" in report:
        m = report["measured"]
        out += [f"The dry run against `benchmarks/memory.py`'s measurement ({m['shape']}, "
                f"{m['device'].upper()}), the busiest rank (MiB):", "",
                "| layout | method | state: dry run / measured | peak: dry run / measured | "
                "peak difference |", "|---|---|---|---|---|"]
        for r in m["rows"]:
            out.append(f"| {r['layout']} | {r['variant']} | "
                       f"{r['dry_run_state_bytes'] / 2**20:.0f} / "
                       f"{r['measured_state_bytes'] / 2**20:.0f} | "
                       f"{r['dry_run_peak_bytes'] / 2**20:.0f} / "
                       f"{r['measured_peak_bytes'] / 2**20:.0f} | {pct(r['peak_rel'])} |")
        out.append("")
    if report.get("cost_27b_rank"):
        c = report["cost_27b_rank"]
        out.append(f"What a dry run costs: rank {c['rank']} of the 27B LoGRA recipe (its whole "
                   f"update, 128 sequences of 4096 tokens), traced in a process of its "
                   f"own: {c['cpu_s']:.0f} s of CPU, {c['wall_s']:.0f} s wall, "
                   f"{c['max_rss_bytes'] / GIB:.2f} GiB peak RSS, on a machine of "
                   f"{c['cores']} cores shared with other jobs (load average "
                   f"{c['loadavg_before']:.1f} before, {c['loadavg_after']:.1f} after).")
    return "\n".join(out) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["scaling"]["rows"]
    gpu_counts = sorted({r["gpus"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in SCALING_METHODS:
        points = {}
        for r in rows:
            if r["method"] == method:
                points[r["gpus"]] = max(points.get(r["gpus"], 0), r["peak_bytes"] / GIB)
        if not points:
            continue
        gpus = sorted(points)
        ax.plot(gpus, [points[g] for g in gpus], marker="o", label=method)
    for size in (80, 141):
        ax.axhline(0.9 * size, color="grey", linestyle=":", linewidth=1)
        ax.text(gpu_counts[-1], 0.9 * size, f" 90% of {size} GiB", va="bottom", ha="right",
                fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpu_counts, [str(g) for g in gpu_counts])
    ax.set_xlabel("GPUs (TP4 x PP2 x DP)")
    ax.set_ylabel("peak GPU memory per rank (GiB, busiest traced rank)")
    ax.set_title("27B recipe, one RL update traced by the dry run")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
