"""The memory model checked against measurement and projected: ``validate`` against
``benchmarks/memory.py``'s report, ``project`` every 8-GPU layout the CLI accepts onto GPU
sizes, and the rollout engine's share (``engine_share``) for each ``placements`` choice:
the engine's GPUs (weights, the rollout batch's KV cache, an assumed overhead) beside the
trainer's on the rest of the 8 (dedicated), or on the same GPUs in turns (colocated).
Also the bytes of one weight sync, full vs sketch delta (``sync_bytes``).
"""
from __future__ import annotations

import math

from megatron_logra.logra.config import LograConfig
from megatron_logra.memory.inventory import ROLES, model_of, rank_params
from megatron_logra.memory.rank_bytes import plan
from megatron_logra.memory.shapes import PAPER_SHAPES
from megatron_logra.rollout.engine_memory import ENGINE_OVERHEAD_BYTES, GIB

PAPER_TABLE1 = {"1.5B": {"dense_adam": 9.18, "logra": 7.18}, "7B": {"dense_adam": 31.82,
                "logra": 17.29}, "27B": {"dense_adam": "OOM", "logra": 51.54}}  # avg GiB/GPU
LAYOUTS_8 = [(8, 1, 1), (4, 2, 1), (4, 1, 2), (2, 4, 1), (2, 2, 2), (2, 1, 4), (1, 1, 8),
             (1, 2, 4), (1, 4, 2), (1, 8, 1)]  # (TP, PP, DP) on 8 GPUs

METHODS = {  # memory.py variant -> (method, LoGRA master)
    "dense_adam": ("dense_adam", "fp32"),
    "logra_fp32_master": ("logra", "fp32"),
    "logra_none": ("logra", "none"),
    "lora": ("lora", "fp32"),
}
STATE_TOLERANCE, PEAK_TOLERANCE = 0.02, 0.10
# the paper's LoGRA recipe runs predicted-KL control (recipes/paper/_logra.yaml): 2 probe
# responses per DP rank of up to 4096 tokens, 3072 of them generated (rank_bytes.kl_probe_bytes)
PAPER_KL_PROBE = (2, 4096, 3072)


def paper_plan(shape: str, tp: int, pp: int, dp: int, method: str, master: str) -> dict:
    """``plan`` of the paper's recipe for ``method`` (LoGRA with its KL control's probe)."""
    return plan(shape, tp, pp, dp, method=method, master=master,
                kl_probe=PAPER_KL_PROBE if method == "logra" else None)


def validate(measured: dict) -> dict:
    """Predicted vs measured busiest-rank model state and peak, per layout and variant."""
    report = {}
    targets = tuple(measured.get("targets", ",".join(ROLES)).split(","))
    for layout, entry in measured["layouts"].items():
        for variant, run in entry["runs"].items():
            method, master = METHODS[variant]
            predicted = plan(measured["shape"], entry["tp"], entry["pp"], entry["dp"],
                             method=method, rank=measured["rank"], master=master,
                             seq=measured["seq_length"], mbs=measured["micro_batch_size"],
                             microbatches=measured["microbatches"],
                             recompute=measured["recompute"], targets=targets,
                             untargeted=measured.get("untargeted", "frozen"),
                             lora_rank=measured.get("lora_rank", 16))
            got = run["busiest"]
            state_err = abs(predicted["model_state"] - got["model_state_bytes"]) \
                / got["model_state_bytes"]
            peak_err = abs(predicted["peak"] - got["peak_mem_bytes"]) / got["peak_mem_bytes"]
            report[f"{layout} {variant}"] = {
                "predicted_state_bytes": int(predicted["model_state"]),
                "measured_state_bytes": got["model_state_bytes"],
                "state_rel_error": round(state_err, 4),
                "predicted_peak_bytes": int(predicted["peak"]),
                "measured_peak_bytes": got["peak_mem_bytes"],
                "peak_rel_error": round(peak_err, 4)}
    report["ok"] = all(v["state_rel_error"] <= STATE_TOLERANCE
                       and v["peak_rel_error"] <= PEAK_TOLERANCE
                       for v in report.values() if isinstance(v, dict))
    return report


def cli_accepts(shape: str, tp: int, pp: int, method: str) -> bool:
    """Whether the trainer's CLI takes this TP/PP layout of ``shape`` for ``method``, by the
    CLI's own checks: the model splits that way (``ModelArch.check_parallel``) and, under
    LoGRA on the targets ``ROLES``, the sketches fit the layout (``LograConfig.check_fits``:
    qkv needs TP <= kv heads)."""
    arch, _ = model_of(shape)
    try:
        arch.check_parallel(tp, pp)
        if method == "logra":
            LograConfig(targets=ROLES).check_fits(arch.num_kv_heads, tp)
    except ValueError:
        return False
    return True


def project(gpu_gibs: list[float]) -> dict:
    """Every 8-GPU layout the CLI accepts, per model and method: busiest-rank model state
    and peak (seq 4096, microbatch 1, full recompute, r=256, LoRA r=16; LoGRA with the
    paper's predicted-KL control, ``PAPER_KL_PROBE``), and which fit."""
    out = {}
    for name, shape in PAPER_SHAPES.items():
        rows = []
        for tp, pp, dp in LAYOUTS_8:
            row = {"layout": f"TP{tp} PP{pp} DP{dp}"}
            for variant, (method, master) in METHODS.items():
                if not cli_accepts(shape, tp, pp, method):
                    continue
                got = paper_plan(shape, tp, pp, dp, method, master)
                row[variant] = {"model_state_gib": round(got["model_state"] / GIB, 2),
                                "peak_gib": round(got["peak"] / GIB, 2),
                                **{f"fits_{g:g}gib": got["peak"] <= 0.9 * g * GIB
                                   for g in gpu_gibs}}
            if len(row) > 1:
                rows.append(row)
        fits = {f"{g:g}gib": {variant: [r["layout"] for r in rows
                                        if r.get(variant, {}).get(f"fits_{g:g}gib")]
                              for variant in METHODS} for g in gpu_gibs}
        out[name] = {"config": shape, "params": sum(
            math.prod(p.shape) for p in model_of(shape)[1]),
            "paper_table1_avg_gib": PAPER_TABLE1[name], "layouts": rows, "fits": fits}
    return out


# The rollout engine's share (``rollout.placement``), per engine GPU. Assumed, not
# measured: vLLM's CUDA context, workspace and sampler on an awake engine (the margin
# ``rollout.engine_memory`` leaves it), and what a sleeping one keeps (level 1: weights
# moved to host memory, KV cache dropped).
ENGINE_OVERHEAD_GIB, ENGINE_ASLEEP_GIB = ENGINE_OVERHEAD_BYTES / GIB, 1.0
ROLLOUT_SEQS, ROLLOUT_TOKENS = 128, 4096  # the paper's rollout batch, all of its KV at once
ENGINE_TPS = (1, 2, 4, 8)


def engine_share(shape: str, engine_tp: int) -> dict:
    """Bytes per engine GPU: bf16 weights split over the engine's TP, the KV cache of the
    whole rollout batch (KV heads split over TP, replicated when fewer), the overhead."""
    arch, params = model_of(shape)
    weights = 2 * sum(math.prod(p.shape) for p in params) / engine_tp
    kv_heads = max(arch.num_kv_heads / engine_tp, 1)
    kv = 2 * 2 * arch.num_layers * kv_heads * arch.head_dim * ROLLOUT_SEQS * ROLLOUT_TOKENS
    return {"weights": weights, "kv_cache": kv,
            "total": weights + kv + ENGINE_OVERHEAD_GIB * GIB}


def _layouts(shape: str, gpus: int, method: str) -> list[tuple[int, int, int]]:
    return [(tp, pp, gpus // (tp * pp)) for tp in range(1, gpus + 1) for pp in
            range(1, gpus + 1) if gpus % (tp * pp) == 0 and cli_accepts(shape, tp, pp, method)]


def placements(gpu_gibs: list[float], gpus: int = 8, models=tuple(PAPER_SHAPES),
               variants=tuple(METHODS)) -> dict:
    """Per projected model and method, on ``gpus`` GPUs of each size: the engine TPs and
    trainer layouts that fit (90% of a GPU) with the engine dedicated (its own GPUs, the
    trainer on the rest) or colocated (the same GPUs in turns: the trainer's model state
    stays while the engine generates; a sleeping engine's residue while the trainer
    trains)."""
    out = {}
    for name in models:
        shape = PAPER_SHAPES[name]
        engines = {e: engine_share(shape, e) for e in ENGINE_TPS
                   if e == 1 or model_of(shape)[0].num_attention_heads % e == 0}
        entry = {"engine_gib": {f"TP{e}": round(v["total"] / GIB, 1)
                                for e, v in engines.items()}}
        for variant in variants:
            method, master = METHODS[variant]
            per_gib = {}
            for g in gpu_gibs:
                limit = 0.9 * g * GIB
                dedicated, colocated = [], []
                for e, engine in engines.items():
                    if engine["total"] <= limit and e < gpus:
                        dedicated += [f"engine TP{e} + TP{tp} PP{pp} DP{dp}"
                                      for tp, pp, dp in _layouts(shape, gpus - e, method)
                                      if paper_plan(shape, tp, pp, dp, method,
                                                    master)["peak"] <= limit]
                    for tp, pp, dp in _layouts(shape, gpus, method):
                        got = paper_plan(shape, tp, pp, dp, method, master)
                        if max(got["model_state"] + engine["total"],
                               got["peak"] + ENGINE_ASLEEP_GIB * GIB) <= limit:
                            colocated.append(f"engine TP{e} + TP{tp} PP{pp} DP{dp}")
                per_gib[f"{g:g}gib"] = {"dedicated": dedicated, "colocated": colocated}
            entry[variant] = per_gib
        out[name] = entry
    return out


def sync_bytes(shape: str, rank: int) -> dict:
    """bf16 bytes per sync: full (every param) vs sketch delta (out x r bf16 D + 8-byte row
    index per sketched row, the other tensors (norms, biases) in full; the embedding and an
    untied output layer sketched, all rows counted). From the tensors megatron builds for
    ``shape`` (``rank_params`` at TP1/PP1); ``benchmarks/sync.py`` reports them."""
    blocks = rank_params(shape, 1, 1, 0)
    full = 2 * sum(b.numel for b in blocks)
    sketched_rows = sum(b.rows for b in blocks if b.role in ROLES + ("embedding", "output"))
    others = sum(b.numel for b in blocks if b.role in ("norm", "other"))
    delta = sketched_rows * (2 * rank + 8) + 2 * others
    return {"full_bytes": full, "sketch_delta_bytes": delta,
            "sync_bytes_ratio": round(delta / full, 5)}
