"""``launch/pretrain_rl.py --dry-run``: which ranks to trace, their report and its table.

Ranks alike are traced once. Every rank of a pipeline stage holds the same shapes; ranks
of one stage differ only in the data-parallel shard they own (the distributed
optimizer's and LoGRA's rows: equal sizes, the last shard taking what does not divide)
and in whether they send the weight push (data-parallel rank 0: its TP shard of each
parameter; TP rank 0 also what TP does not split). So per stage: TP rank 0 of DP rank 0
stands for the DP-rank-0 ranks (the senders), the last TP rank of the last DP rank for
the others (when there are others); ``--dry-run-ranks`` traces exactly the ranks named
(``all``: every rank). Each traced rank's report says which ranks it stands for.

The report (``--output-dir``/dry_run.json): the job's layout, per traced rank its peak
GPU memory by category and model state (``trace.trace_rank``), whether it fits
``--dry-run-gpu-gib`` (90% usable; beside the rollout engine when the engine shares the
GPU), the point-to-point pairing across the traced ranks (``pair_p2p``), and errors.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

from megatron_logra.config import RunConfig

GIB = 2**30
USABLE = 0.9  # of a GPU's memory (the memory plan's rule: memory.forecast)
ENGINE_ASLEEP_BYTES = GIB  # what a sleeping vLLM engine keeps (memory.forecast's assumption)


def global_rank(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int) -> int:
    """megatron-core's numbering (TP fastest, then DP, then PP; ``dry_run.world`` checks
    it against the groups it builds through ``weight_sync.gathered_weights.plan_push``)."""
    return tp_rank + tp * (dp_rank + dp * pp_rank)


def representatives(tp: int, pp: int, dp: int) -> dict[int, list[int]]:
    """{traced rank: the ranks it stands for} (see the module doc)."""
    out = {}
    for stage in range(pp):
        senders = [global_rank(t, 0, stage, tp, dp) for t in range(tp)]
        others = [global_rank(t, d, stage, tp, dp) for d in range(1, dp) for t in range(tp)]
        out[senders[0]] = senders
        if others:
            out[global_rank(tp - 1, dp - 1, stage, tp, dp)] = others
    return out


def chosen_ranks(cfg: RunConfig, world: int) -> dict[int, list[int]]:
    tp = cfg.parallel.tensor_model_parallel_size
    pp = cfg.parallel.pipeline_model_parallel_size
    ranks = cfg.dry_run.ranks
    if ranks is None:
        return representatives(tp, pp, world // (tp * pp))
    return {r: [r] for r in (ranks or range(world))}


def pair_p2p(reports: list[dict]) -> dict:
    """Every send a traced rank makes to another traced rank against that rank's receives
    from it, in order: same count, shapes and dtypes (``checks.TraceChecks.p2p``)."""
    logs = {r["rank"]: r.pop("p2p_log", []) for r in reports}
    pairs, mismatches = 0, []
    for src, log in logs.items():
        for dst, other in logs.items():
            sends = [e for e in log if e["op"] == "send" and e["peer"] == dst]
            recvs = [e for e in other if e["op"] == "recv" and e["peer"] == src]
            if not sends and not recvs:
                continue
            pairs += 1
            if len(sends) != len(recvs):
                mismatches.append({"from": src, "to": dst, "problem": f"{len(sends)} sends, "
                                   f"{len(recvs)} receives"})
                continue
            for i, (s, r) in enumerate(zip(sends, recvs)):
                if (s["shape"], s["dtype"]) != (r["shape"], r["dtype"]):
                    mismatches.append({
                        "from": src, "to": dst, "message": i,
                        "problem": f"sends {s['dtype']} {s['shape']} at {s['site']}, the "
                                   f"receive expects {r['dtype']} {r['shape']} at {r['site']}"})
                    break
    return {"pairs_checked": pairs, "mismatches": mismatches}


def fits(rank: dict, gpu_gib: float) -> dict:
    """Whether the rank's GPU holds it within ``USABLE`` of ``gpu_gib``: its peak, plus the
    rollout engine where the engine shares that GPU (awake beside training; or, with
    vLLM's sleep mode, beside the model state while it generates and as its sleeping
    residue while the trainer trains)."""
    limit = USABLE * gpu_gib * GIB
    need = rank.get("peak_bytes", 0)
    engine = rank.get("engine_bytes", 0)
    if engine:
        if rank["engine"]["sleep_mode"]:
            need = max(rank["model_state_bytes"]["total"] + engine,
                       need + ENGINE_ASLEEP_BYTES)
        else:
            need += engine
    return {"gpu_gib": gpu_gib, "needed_bytes": int(need), "fits": bool(need <= limit)}


def dry_run(cfg: RunConfig) -> dict:
    """Trace the chosen ranks in turn; the whole report."""
    from megatron_logra.dry_run.trace import trace_rank

    tp = cfg.parallel.tensor_model_parallel_size
    pp = cfg.parallel.pipeline_model_parallel_size
    world = cfg.dry_run.world(tp, pp)
    chosen = chosen_ranks(cfg, world)
    reports = []
    for rank, alike in chosen.items():
        print(f"dry run: tracing rank {rank} of {world}", file=sys.stderr, flush=True)
        report = trace_rank(cfg, rank, world, cfg.dry_run.gpus_per_node)
        report["stands_for"] = alike
        _place_engine(report, cfg.dry_run.gpus_per_node)
        report["fits"] = fits(report, cfg.dry_run.gpu_gib)
        reports.append(report)
        gc.collect()
    return {"world_size": world, "layout": {"tp": tp, "pp": pp, "dp": world // (tp * pp)},
            "stage": cfg.training.stage, "optimizer": cfg.optimizer.name,
            "peft": cfg.optimizer.peft, "model_dir": cfg.model.model_dir,
            "ranks": reports, "p2p": pair_p2p(reports),
            "errors": sum(len(r["errors"]) for r in reports)}


def _place_engine(report: dict, gpus_per_node: int) -> None:
    """The engine's bytes on this rank's GPU: a colocated (or inherited) engine's TP ranks
    run on node 0's first GPUs (``rollout.placement``)."""
    engine = report.get("engine")
    on_gpu = (engine is not None and engine["colocated"]
              and report["rank"] < min(engine["gpus"], gpus_per_node))
    report["engine_bytes"] = engine["bytes_per_gpu"] if on_gpu else 0


COLUMNS = ("params", "grads", "optimizer", "logra", "activations", "temporaries",
           "weight_push")


def unit(report: dict) -> tuple[str, int]:
    """GiB, or MiB when every rank's peak is under 1 GiB (a small model)."""
    small = all(r.get("peak_bytes", 0) < GIB for r in report["ranks"])
    return ("MiB", 2**20) if small else ("GiB", GIB)


def table(report: dict) -> str:
    """Markdown: per traced rank its model state, peak and the peak's categories."""
    name, size = unit(report)

    def fmt(nbytes: float) -> str:
        return f"{nbytes / size:.2f}"

    head = ["rank", "TP,PP,DP", "stands for", "model state", "peak", *COLUMNS, "engine",
            f"fits {report['ranks'][0]['fits']['gpu_gib']:g} GiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["ranks"]:
        where = r.get("coordinates", {})
        peak = max((r.get("update_peak", {}), r.get("push_peak", {})),
                   key=lambda p: p.get("total", 0))
        fit = r["fits"]
        row = [str(r["rank"]), f"{where.get('tp')},{where.get('pp')},{where.get('dp')}",
               _ranges(r["stands_for"]), fmt(r.get("model_state_bytes", {}).get("total", 0)),
               fmt(r.get("peak_bytes", 0)), *(fmt(peak.get(c, 0)) for c in COLUMNS),
               fmt(r.get("engine_bytes", 0)),
               ("yes" if fit["fits"] else "NO") + f" (needs {fit['needed_bytes'] / GIB:.1f})"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + f"\n\n({name} per GPU; peak: the larger of the update's and the " \
        f"weight push's, its categories at that moment)"


def _ranges(ranks: list[int]) -> str:
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)


def summary(report: dict) -> str:
    """The table, then what else the reader must see: errors, p2p, host reads assumed."""
    lay = report["layout"]
    lines = [f"dry run: {report['world_size']} GPUs as TP{lay['tp']} x PP{lay['pp']} x "
             f"DP{lay['dp']}, {report['stage']} stage, {report['optimizer']}"
             f"{' + LoRA' if report['peft'] == 'lora' else ''}", "",
             table(report), ""]
    for r in report["ranks"]:
        for e in r["errors"]:
            lines.append(f"rank {r['rank']}: {e['kind']} in {e['phase']} at {e['site']}: "
                         f"{e['message']}")
    p2p = report["p2p"]
    lines.append(f"point to point: {p2p['pairs_checked']} rank pairs checked, "
                 f"{len(p2p['mismatches'])} mismatched")
    lines += [f"  {m['from']} -> {m['to']}: {m['problem']}" for m in p2p["mismatches"]]
    return "\n".join(lines)


def run_dry_run(cfg: RunConfig) -> int:
    """Trace, write dry_run.json into --output-dir, print the summary; 1 when a traced
    rank failed (a real run would too), else 0."""
    report = dry_run(cfg)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dry_run.json").write_text(json.dumps(report, indent=1) + "\n")
    print(summary(report))
    print(f"report: {(out / 'dry_run.json').resolve()}")
    return 1 if report["errors"] or report["p2p"]["mismatches"] else 0
