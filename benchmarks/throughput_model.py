"""Updates/h of the paper's RL settings on 8 GPUs: sync one engine, sync N replicas, async.

    .venv/bin/python benchmarks/throughput_model.py [--save]

A model, not a measurement (seconds of arithmetic): ``megatron_logra.rollout.
throughput_model``, calibrated on the paper's own layout (four TP1 vLLM engines on 4 GPUs,
the trainer on the other 4, synchronous; ``skzhang1/RL`` research/logra/configs) so that
it reproduces the paper's dense-Adam updates/h (Table 1: 54.28 at 1.5B, 25.28 at 7B), then
asked what each schedule and GPU split would make of the same hardware and software.
``docs/throughput-model.md`` gives every input's source. Prints one JSON line (``--save``:
also results/throughput_model.json and a table in throughput_model.md).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace

from _results import save

from megatron_logra.memory.throughput_model import (PAPER_LAYOUT, PAPER_UPDATES_PER_H,
                                                    Hardware, Timing, Workload, best,
                                                    decode_step_s, dense_train_s_1p5b,
                                                    engine_rollout_s, kv_bytes_per_token,
                                                    matmul_params, min_train_gpus,
                                                    paper_inputs, rollout_s, update_time,
                                                    weight_bytes)

MANY = range(2, 9)
MODES = (  # label, schedule, placement, engine counts allowed
    ("sync, 1 engine, colocated", "sync", "colocated", (1,)),
    ("sync, 1 engine, dedicated", "sync", "dedicated", (1,)),
    ("sync, N replicas, dedicated", "sync", "dedicated", MANY),
    ("sync, N replicas, colocated", "sync", "colocated", MANY),
    ("async, 1 engine", "async", "dedicated", (1,)),
    ("async, N replicas", "async", "dedicated", MANY),
)
VARIANTS = {  # name -> paper_inputs keywords: what each changes from the assumed inputs
    "as assumed": {},
    "7B: trainer MFU fitted instead of the decode overhead": {"fit": "trainer"},
    "mean response 500 tokens": {"workload": Workload(mean_response_tokens=500.0)},
    "mean response 2000 tokens": {"workload": Workload(mean_response_tokens=2000.0)},
    "longest response 2048 tokens (none reaches the cap)":
        {"workload": Workload(longest_response_tokens=2048.0)},
    "TP all-reduce 50 us (not 10)": {"hardware": Hardware(allreduce_s=50e-6)},
}


def row(inputs, setting: str, mode: str, t: Timing) -> dict:
    """One layout's figures; tokens/s per GPU (NeMo-RL's measure) over the update's time
    and the GPUs the layout uses (colocated: the trainer's, which the engines share)."""
    lay = t.layout
    w = inputs.workload
    gpus = lay.train_gpus + (lay.generate_gpus if lay.placement == "dedicated" else 0)
    out = {"setting": setting, "mode": mode, **asdict(lay),
           "generate_gpus": lay.generate_gpus, "rollout_s": t.rollout_s, "train_s": t.train_s,
           "push_s": t.push_s, "switch_s": t.switch_s, "update_s": t.update_s,
           "updates_per_h": t.updates_per_h, "gpus": gpus,
           "generated_tokens_per_s_per_gpu":
               w.sequences * w.mean_response_tokens / t.update_s / gpus,
           "trained_tokens_per_s_per_gpu": w.trained_tokens / t.update_s / gpus,
           "trainer_wait": t.trainer_wait,
           "engine_wait": t.engine_wait,
           "paper_updates_per_h": PAPER_UPDATES_PER_H[setting]["dense_adam"]}
    if lay.schedule == "async":  # the push received while generating
        staged = update_time(inputs, replace(lay, staged_push=True))
        out["staged_push_updates_per_h"] = staged.updates_per_h
    return out


def setting_report(setting: str) -> dict:
    inputs = paper_inputs(setting)
    paper = update_time(inputs, PAPER_LAYOUT)
    rows = [row(inputs, setting, "paper's layout (calibration)", paper),
            row(inputs, setting, "async, the paper's layout",
                update_time(inputs, replace(PAPER_LAYOUT, schedule="async")))]
    rows += [row(inputs, setting, label, best(inputs, sched, place, n))
             for label, sched, place, n in MODES]
    no_tail = replace(inputs, workload=replace(
        inputs.workload, longest_response_tokens=inputs.workload.mean_response_tokens))
    m = inputs.model
    return {"inputs": {"model": {"name": inputs.name, **asdict(m)},
                       "params": m.num_parameters, "matmul_params": matmul_params(m),
                       "weight_bytes": weight_bytes(m),
                       "kv_bytes_per_token": kv_bytes_per_token(m),
                       "workload": asdict(inputs.workload),
                       "hardware": asdict(inputs.hardware),
                       "efficiency": asdict(inputs.efficiency), "gpus": inputs.gpus,
                       "min_train_gpus": min_train_gpus(inputs)},
            "rows": rows,
            "engines_on_4_gpus": engine_scan(inputs),
            "predicted_from_1p5b_updates_per_h":
                update_time(paper_inputs(setting, fit="none"), PAPER_LAYOUT).updates_per_h,
            "paper_rollout_s_without_tail": engine_rollout_s(
                no_tail, PAPER_LAYOUT.engine_tp, inputs.workload.sequences // 4)}


def engine_scan(inputs) -> list[dict]:
    """The paper's batch on the paper's 4 generation GPUs, split every way: each engine's
    share, its mean decode step (ms) and the rollout (s)."""
    w, out = inputs.workload, []
    for n, tp in ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 4)):
        share = w.sequences // n
        live = share * w.mean_response_tokens / w.longest_response_tokens
        step = decode_step_s(inputs, tp, live, w.prompt_tokens + w.mean_response_tokens / 2)
        out.append({"replicas": n, "engine_tp": tp, "sequences_per_engine": share,
                    "decode_step_ms": 1e3 * step, "rollout_s": rollout_s(inputs, n, tp)})
    return out


def sensitivity() -> list[dict]:
    """Per variant and setting: the paper's layout (calibrated again), the best sync and the
    best async layout."""
    out = []
    for name, kw in VARIANTS.items():
        for setting in PAPER_UPDATES_PER_H:
            if name.startswith("7B") and setting != "7B":  # the same as assumed at 1.5B
                continue
            inputs = paper_inputs(setting, **kw)
            sync = min((best(inputs, "sync", p) for p in ("dedicated", "colocated")),
                       key=lambda t: t.update_s)
            asyn = best(inputs, "async", "dedicated")
            out.append({"variant": name, "setting": setting,
                        "step_overhead_s": inputs.efficiency.step_overhead_s,
                        "train_mfu": inputs.efficiency.train_mfu,
                        "paper_layout_updates_per_h":
                            update_time(inputs, PAPER_LAYOUT).updates_per_h,
                        "best_sync_updates_per_h": sync.updates_per_h,
                        "best_sync_layout": label(sync), "best_async_updates_per_h":
                            asyn.updates_per_h, "best_async_layout": label(asyn)})
    return out


def label(t: Timing) -> str:
    lay = t.layout
    gens = f"{lay.replicas}xTP{lay.engine_tp}"
    return (f"{lay.placement} {gens}, trainer {lay.train_gpus}"
            + ("" if lay.placement == "dedicated" else " (shared)"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--save", action="store_true",
                   help="also write benchmarks/results/throughput_model.json and .md")
    args = p.parse_args(argv)
    report = {"benchmark": "throughput_model", "measured": False,
              "paper_updates_per_h": PAPER_UPDATES_PER_H,
              "dense_train_s_1p5b": dense_train_s_1p5b(),
              "settings": {s: setting_report(s) for s in PAPER_UPDATES_PER_H},
              "sensitivity": sensitivity()}
    if args.save:
        save("throughput_model", report, markdown(report))
    print(json.dumps(report))


def modes_table(report: dict) -> str:
    """Markdown: per setting and mode, the best layout's updates/h against the paper's."""
    lines = ["| setting | mode | replicas x TP | GPUs train / generate | updates/h | trainer "
             "waits | engines wait | paper, dense Adam (LoGRA) |", "|---|---|---|---|---|---|---|---|"]
    for setting, entry in report["settings"].items():
        paper = report["paper_updates_per_h"][setting]
        for r in entry["rows"]:
            shared = " (shared)" if r["placement"] == "colocated" else ""
            lines.append(f"| {setting} | {r['mode']} | {r['replicas']} x TP{r['engine_tp']} | "
                         f"{r['train_gpus']} / {r['generate_gpus']}{shared} | "
                         f"**{r['updates_per_h']:.1f}** | {r['trainer_wait']:.0%} | "
                         f"{r['engine_wait']:.0%} | {paper['dense_adam']} ({paper['logra']}) |")
    return "\n".join(lines) + (
        "\n\n**A model, not a measurement**: 8 GPUs (H100 80 GB assumed), 128 prompts x 1 "
        "response per update, dense Adam, calibrated so that the paper's layout reproduces the "
        "paper's updates/h; each mode's best layout.\n")


def markdown(report: dict) -> str:
    """Markdown: every mode's best layout per setting, then the sensitivity of the best."""
    lines = ["**A model, not a measurement** (`megatron_logra/memory/throughput_model.py`; "
             "inputs and sources in `docs/throughput-model.md`). 8 GPUs (H100 80 GB assumed), "
             "128 prompts x 1 response per update, dense Adam; calibrated so that the paper's "
             "layout reproduces the paper's updates/h. Each mode: its best layout. GPUs "
             "train / generate (colocated: the same GPUs in turns); waits: share of the "
             "update each side has nothing to do; tokens/s/GPU: the batch's response (generated) "
             "and prompt + response (trained) tokens per second of the update, per GPU the "
             "layout uses.", "",
             "| setting | mode | replicas x TP | GPUs train / generate | rollout s | train s "
             "| push s | s/update | updates/h | tokens/s/GPU generated / trained | "
             "trainer waits | engines wait | paper updates/h |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for setting, entry in report["settings"].items():
        logra = report["paper_updates_per_h"][setting]["logra"]
        for r in entry["rows"]:
            shared = " (shared)" if r["placement"] == "colocated" else ""
            lines.append(
                f"| {setting} | {r['mode']} | {r['replicas']} x TP{r['engine_tp']} | "
                f"{r['train_gpus']} / {r['generate_gpus']}{shared} | {r['rollout_s']:.1f} | "
                f"{r['train_s']:.1f} | {r['push_s']:.1f} | {r['update_s']:.1f} | "
                f"**{r['updates_per_h']:.1f}** | {r['generated_tokens_per_s_per_gpu']:.0f} / "
                f"{r['trained_tokens_per_s_per_gpu']:.0f} | {r['trainer_wait']:.0%} | "
                f"{r['engine_wait']:.0%} | {r['paper_updates_per_h']} (LoGRA {logra}) |")
    lines += [""]
    for setting, entry in report["settings"].items():
        e = entry["inputs"]["efficiency"]
        lines.append(f"- {setting}: calibrated decode-step overhead "
                     f"{e['step_overhead_s'] * 1e3:.1f} ms, trainer MFU {e['train_mfu']:.1%}; the "
                     f"paper's rollout, {entry['rows'][0]['rollout_s']:.1f} s, would take "
                     f"{entry['paper_rollout_s_without_tail']:.1f} s without its long tail "
                     "(longest response = the mean).")
    seven = report["settings"]["7B"]["predicted_from_1p5b_updates_per_h"]
    paper = report["paper_updates_per_h"]["7B"]["dense_adam"]
    lines += [f"- 7B's paper layout predicted from 1.5B's calibration alone (nothing fitted "
              f"to 7B): {seven:.2f} updates/h, paper {paper}.",
              "", "The batch on the paper's 4 generation GPUs, split every way (sync; the "
              "rollout lasts the longest response's decode steps whatever the split):", "",
              "| setting | replicas x TP | responses per engine | decode step ms | rollout s |",
              "|---|---|---|---|---|"]
    for setting, entry in report["settings"].items():
        for e in entry["engines_on_4_gpus"]:
            lines.append(f"| {setting} | {e['replicas']} x TP{e['engine_tp']} | "
                         f"{e['sequences_per_engine']} | {e['decode_step_ms']:.2f} | "
                         f"{e['rollout_s']:.1f} |")
    lines += ["", "Sensitivity (each variant calibrated again on the paper's layout):", "",
              "| variant | setting | decode overhead ms | trainer MFU | best sync | "
              "updates/h | best async | updates/h |", "|---|---|---|---|---|---|---|---|"]
    for s in report["sensitivity"]:
        lines.append(f"| {s['variant']} | {s['setting']} | {s['step_overhead_s'] * 1e3:.1f} | "
                     f"{s['train_mfu']:.1%} | {s['best_sync_layout']} | "
                     f"{s['best_sync_updates_per_h']:.1f} | {s['best_async_layout']} | "
                     f"{s['best_async_updates_per_h']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
