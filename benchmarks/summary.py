"""The headline tables: docs/results.md's Summary and the README's Results, one row per
result, every figure read from its benchmark's committed JSON (never typed).

``benchmarks/render_docs.py`` renders them (blocks ``summary`` and ``readme_results``)
from ``SOURCES``, and lists each file's provenance under the table. A row is a function
of the reports: ``(what, figures, section anchor in docs/results.md)``.
"""

from __future__ import annotations

from collections.abc import Callable

from _results import under_load

Row = tuple[str, str, str]


def _timed(*reports: dict) -> str:
    """What the machine was doing while these timings were taken: under load they are
    noisy upper bounds, not a quiet machine's figures."""
    machines = [r["provenance"]["machine"] for r in reports]
    loaded = [under_load(m) for m in machines]
    if None in loaded:
        return "timed on shared cores, load not recorded: not a quiet machine's figures"
    worst = max(max(m["load_avg"]) for m in machines)
    return (f"timed under load, load average up to {worst:g} on {machines[0]['cores']} cores: "
            f"not a quiet machine's figures" if any(loaded) else
            f"load average at most {worst:g}")


def _memory(r: dict) -> list[Row]:
    layouts = r["memory.json"]["layouts"]

    def ratios(key: str) -> str:
        def at(layout: str, variant: str) -> str:
            return f"{layouts[layout]['ratios'][variant][key]:.2f}"
        return (f"LoGRA r=256 {at('DP4', 'logra_fp32_master')} ({at('DP1', 'logra_fp32_master')}) "
                f"fp32 master, {at('DP4', 'logra_none')} ({at('DP1', 'logra_none')}) bf16 only; "
                f"LoRA r=16 {at('DP4', 'lora')} ({at('DP1', 'lora')})")
    return [("model-state memory per rank / dense Adam's, SmolLM2 shape, DP4 (DP1)",
             ratios("model_state_ratio"), "memory"),
            ("peak memory per rank / dense Adam's, the same", ratios("peak_ratio"), "memory")]


def _memory_plan(r: dict) -> list[Row]:
    plan = r["memory_plan.json"]
    checked = [v for k, v in plan["validation"].items() if k != "ok"]
    layouts = sorted({k.split(" ", 1)[0] for k in plan["validation"] if k != "ok"})
    entry, small = plan["projection"]["27B"], plan["gpu_gib"][0]
    fits = entry["fits"][f"{small:g}gib"]
    listed = {v: sum(v in row for row in entry["layouts"]) for v in fits}
    return [(f"memory model vs measured, {'/'.join(layouts)}, four methods",
             f"model state within {max(v['state_rel_error'] for v in checked):.1%}, peak within "
             f"{max(v['peak_rel_error'] for v in checked):.1%}",
             "the-analytic-model-and-its-projection"),
            (f"Qwen3-style 27B on 8 x {small:g} GiB, seq 4096 (**projection**, not measured)",
             f"layouts that fit: dense Adam {len(fits['dense_adam'])} of "
             f"{listed['dense_adam']}, LoGRA {len(fits['logra_fp32_master'])} of "
             f"{listed['logra_fp32_master']} (fp32 master) / {len(fits['logra_none'])} (bf16 "
             f"only), LoRA {len(fits['lora'])} of {listed['lora']}",
             "the-analytic-model-and-its-projection")]


def _step_time(r: dict) -> list[Row]:
    main, emb = r["step_time.json"]["step_time_ratio"], r["step_time_embedding_adam.json"]
    met = r["step_time.json"]["target_met"]
    targets = r["step_time.json"]["ratio_targets"]
    return [("train-step time, LoGRA / dense Adam, SmolLM2 shape, alternating steps",
             f"r=256: {main['logra_r256_fp32']:.2f} (fp32 master), {main['logra_r256_none']:.2f} "
             f"(bf16 only); r=64: {main['logra_r64_fp32']:.2f}, {main['logra_r64_none']:.2f} "
             f"(targets {targets['256']} / {targets['64']}: "
             f"{'met' if all(met.values()) else '**not all met**'}); embedding sketched and "
             f"Adam on the rest, r=256: {emb['step_time_ratio']['logra_r256_fp32']:.2f} / "
             f"{emb['step_time_ratio']['logra_r256_none']:.2f} "
             f"({'met' if all(emb['target_met'].values()) else 'not met'}); "
             f"{_timed(r['step_time.json'], emb)}", "step-time")]


def _convert(r: dict) -> list[Row]:
    c = r["convert.json"]
    return [("checkpoint conversion, SmolLM2, peak RSS / largest tensor",
             f"HF -> megatron {c['hf_to_megatron']['rss_over_largest_tensor_ratio']:.1f}x, "
             f"megatron -> HF {c['megatron_to_hf']['rss_over_largest_tensor_ratio']:.1f}x "
             f"(the whole model: {c['load_whole_model']['rss_over_largest_tensor_ratio']:.1f}x)",
             "checkpoint-conversion")]


def _sync(r: dict) -> list[Row]:
    s = r["sync.json"]
    return [(f"weight sync into vLLM, sketch-delta / full push, SmolLM2, r={s['rank']}",
             f"bytes {s['sync_bytes_ratio']:.3f}, bit-exact: {'yes' if s['exact'] else 'no'}; "
             f"time {s['sync_time_ratio']:.1f}x on CPU (target 0.3 "
             f"{'met' if s['sync_time_ratio'] <= 0.3 else 'not met'}; {_timed(s)})",
             "weight-sync")]


def _weight_push(r: dict) -> list[Row]:
    w = r["weight_push.json"]
    runs = {run["engine_tp"]: run["summary"] for run in w["runs"]}
    full = runs[min(runs)]["full"]
    mib = 2**20
    sketch = [s["sketch-delta"]["worker_bytes"] / s["full"]["worker_bytes"] for s in runs.values()]
    tps = " and ".join(f"TP{tp}" for tp in runs)
    return [(f"pushes into vLLM's server, trainer TP{w['tp']} PP{w['pp']}, "
             f"{w['params'] / 1e6:.0f}M, server {tps}",
             f"rank 0 sends {full['rank0_bytes'] / mib:.0f} of a full push's "
             f"{full['worker_bytes'] / mib:.0f} MiB; sketch delta {min(sketch):.3f}-"
             f"{max(sketch):.3f} of a full push; bit-exact: "
             f"{'yes' if all(run['exact'] for run in w['runs']) else 'no'}",
             "pushes-into-vllms-server-benchmarksweight_pushpy")]


METHODS = {"adam": "dense Adam", "dense": "dense Adam", "logra": "LoGRA", "lora": "LoRA"}


def _learning(r: dict) -> list[Row]:
    runs = r["learning.json"]["runs"]
    seeds = len(next(iter(runs.values())))
    gains = "; ".join(f"{METHODS.get(m, m)} " + " / ".join(f"{g['gain']:+.3f}"
                                                          for g in by_seed.values())
                      for m, by_seed in runs.items())
    smallest = min(g["gain"] / g["se"] for by_seed in runs.values() for g in by_seed.values())
    return [(f"RL learning, tiny model, 30 GRPO updates, {seeds} seed{'s' * (seeds != 1)}",
             f"held-out pass@1 gain: {gains} (each at least {smallest:.1f} SE)",
             "rl-learning-tiny-model")]


def _faults(r: dict) -> list[Row]:
    s = r["faults.json"]["summary"]
    return [("faults injected into short RL jobs (trainer ranks, vLLM's server, disk, "
             "checkpoints; one with generation one step off)",
             f"{s['runs_completed']} of {s['faults_injected']} completed, {s['mismatches']} "
             f"mismatches, at most {s['max_updates_lost']} updates lost (checkpoint interval "
             f"{r['faults.json']['save_interval']}), {s['orphans']} orphans, {s['leaked_shm']} "
             f"leaked shm", "reliability-benchmarksfaultspy")]


def _async(r: dict) -> list[Row]:
    a, t = r["async_rollouts.json"], r["throughput_model.json"]
    v = a["variants"]
    best = {s: max((row for row in e["rows"] if row["mode"].startswith("async")),
                   key=lambda row: row["updates_per_h"]) for s, e in t["settings"].items()}
    modelled = ", ".join(f"{s} {row['updates_per_h']:.0f} (the paper's, synchronous: "
                         f"{t['paper_updates_per_h'][s]['dense_adam']:.0f})" for s, row in best.items())
    return [("generation one step off (`--async-rollouts`), SmolLM2, CPU",
             f"updates/h on dedicated cores {v['dedicated async']['updates_per_h']:.0f} against "
             f"{v['dedicated sync']['updates_per_h']:.0f} synchronous "
             f"({a['ratios']['dedicated']:.2f}x); on shared cores "
             f"{a['ratios']['shared_1']:.2f}x; {_timed(a)}",
             "rollouts-at-node-scale-replicas-and-generation-beside-training"),
            ("updates/h on 8 GPUs, one step off, best layout (**model**, not measured)", modelled,
             "rollouts-at-node-scale-replicas-and-generation-beside-training")]


def _task_signal(r: dict) -> list[Row]:
    t = r["task_signal.json"]
    tasks = t["tasks"]
    some = [name for name, v in tasks.items() if v["prompts_with_a_correct"] > 0]
    return [("SmolLM2-135M-Instruct out of the box, reasoning-gym tasks, temperature 1",
             f"{len(tasks) - len(some)} of {len(tasks)} tasks with no correct sample in "
             f"{t['prompts']} x {t['samples']}" + (f" (some: {', '.join(some)})" if some else ""),
             "which-task-gives-smollm2-a-learning-signal-benchmarkstask_signalpy")]


def _sketches(r: dict) -> list[Row]:
    models = r["figures/sketch_cosines.json"]["models"]
    d = models["smollm2"]

    def mean(rank: int, key) -> float:
        return sum(key(layer[f"r{rank}"]) for layer in d["layers"].values()) / len(d["layers"])
    return [("SmolLM2's real RL gradients, r=64: sketch reconstruction and update direction",
             f"cos(accumulated sketch, gradient) {mean(64, lambda x: x['accumulated']['refreshed-rademacher']):.2f}"
             f"; cos(LoGRA's update, dense Adam's) {mean(64, lambda x: x['update_cosine']):.2f} "
             f"(RowAdam without a sketch {mean(64, lambda x: x['update_cosine_unsketched']):.2f})",
             "what-logras-sketches-keep-and-how-its-update-differs-from-dense-adams-benchmarksfigurespy")]


def _quality(r: dict) -> list[Row]:
    q = r["quality.json"]
    group = q["groups"].get("comparison")
    anchor = "dense-adam-vs-logra-vs-lora-benchmarksqualitypy"
    what = "RL of SmolLM2, dense Adam vs LoGRA r=64 vs LoRA r=16, one KL budget per update"
    if group is None:
        return [(what, "no finished seed of all three methods yet", anchor)]
    seeds = group["seeds"]
    gains = "; ".join(f"{METHODS.get(m, m)} {v['gain_pass@1']['mean']:+.3f}"
                      for m, v in group["methods"].items())
    called = ("one seed: nothing called" if len(seeds) == 1 else
              "; ".join(f"{METHODS[p['a']]} - {METHODS[p['b']]} {p['mean']:+.3f} +- {p['se']:.3f} ({p['verdict']})"
                        for p in group["pairs"]))
    return [(what, f"held-out pass@1 gain after 24 updates, seeds {','.join(map(str, seeds))}: "
             f"{gains} ({called})", anchor)]


def _dry_run(r: dict) -> list[Row]:
    rows = r["dry_run.json"]["scaling"]["rows"]
    names = {"dense_adam": "dense Adam", "logra_fp32_master": "LoGRA fp32 master",
             "logra_none": "LoGRA bf16 only", "lora": "LoRA"}
    counts = sorted({row["gpus"] for row in rows})
    at8 = ", ".join(f"{names.get(row['method'], row['method'])} {row['peak_bytes'] / 2**30:.1f}"
                    for row in rows if row["gpus"] == counts[0])
    worst = max(abs(row["peak_bytes"] / row["plan_peak_bytes"] - 1) for row in rows)
    errors = sum(len(row["errors"]) for row in rows)
    return [(f"Qwen3-style 27B, TP4 x PP2 x DP, one update traced per rank on fake CUDA "
             f"tensors (`--dry-run`), {', '.join(map(str, counts))} GPUs",
             f"peak GiB per GPU at {counts[0]} GPUs: {at8}; every row within "
             f"{100 * worst:.0f}% of the analytic plan; {errors} collective or device "
             f"errors", "dry-run-at-full-size")]


# in order: (the files a row reads, what it shows, its section in docs/results.md, the
# function); a row whose file is not committed says so. The quality comparison's tables
# are benchmarks/quality_report.py's, in its own section; its row here is the headline.
ROWS: list[tuple[tuple[str, ...], str, str, Callable[[dict], list[Row]]]] = [
    (("memory.json",), "model-state and peak memory per rank / dense Adam's", "memory",
     _memory),
    (("memory_plan.json",), "memory model vs measured; the 27B projection",
     "the-analytic-model-and-its-projection", _memory_plan),
    (("step_time.json", "step_time_embedding_adam.json"), "train-step time, LoGRA / dense Adam",
     "step-time", _step_time),
    (("dry_run.json",), "27B dry run at full size", "dry-run-at-full-size", _dry_run),
    (("convert.json",), "checkpoint conversion, peak RSS", "checkpoint-conversion", _convert),
    (("sync.json",), "weight sync into vLLM, sketch-delta / full push", "weight-sync", _sync),
    (("weight_push.json",), "pushes into vLLM's server",
     "pushes-into-vllms-server-benchmarksweight_pushpy", _weight_push),
    (("task_signal.json",), "SmolLM2 out of the box, reasoning-gym tasks",
     "which-task-gives-smollm2-a-learning-signal-benchmarkstask_signalpy", _task_signal),
    (("quality.json",), "RL of SmolLM2: dense Adam vs LoGRA vs LoRA",
     "dense-adam-vs-logra-vs-lora-benchmarksqualitypy", _quality),
    (("learning.json",), "RL learning, tiny model", "rl-learning-tiny-model", _learning),
    (("async_rollouts.json", "throughput_model.json"),
     "generation one step off (`--async-rollouts`); updates/h on 8 GPUs (model)",
     "rollouts-at-node-scale-replicas-and-generation-beside-training", _async),
    (("figures/sketch_cosines.json",), "SmolLM2's real RL gradients: sketch and update direction",
     "what-logras-sketches-keep-and-how-its-update-differs-from-dense-adams-benchmarksfigurespy",
     _sketches),
    (("faults.json",), "faults injected into short RL jobs", "reliability-benchmarksfaultspy",
     _faults),
]
# every results file a row reads (paths under benchmarks/results/)
SOURCES = tuple(dict.fromkeys(f for needs, *_ in ROWS for f in needs))


def _rows(reports: dict) -> list[Row]:
    """Each row from its reports; a row whose files are not committed, a row saying so."""
    rows = []
    for needs, what, anchor, make in ROWS:
        missing = [f for f in needs if f not in reports]
        rows += (make(reports) if not missing else
                 [(what, f"no committed result yet ({', '.join(missing)} not in the tree)",
                   anchor)])
    return rows


def docs_summary(reports: dict) -> str:
    """docs/results.md's Summary: what, figures, a link to the section."""
    lines = ["| what | figures | details |", "|---|---|---|"]
    lines += [f"| {what} | {figures} | [section](#{anchor}) |"
              for what, figures, anchor in _rows(reports)]
    return "\n".join(lines) + "\n"


def readme_results(reports: dict) -> str:
    """The README's Results: each row linked to its section of docs/results.md."""
    lines = ["| | result |", "|---|---|"]
    lines += [f"| [{what}](docs/results.md#{anchor}) | {figures} |"
              for what, figures, anchor in _rows(reports)]
    return "\n".join(lines) + "\n"
