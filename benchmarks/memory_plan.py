"""Analytic per-GPU memory of dense Adam vs LoGRA, checked against measurement, then projected.

    .venv/bin/python benchmarks/memory_plan.py [--measured memory.json] [--gpu-gib 80]

1. The model: bytes per rank of weights, DP-reduced grads, optimizer state and
   fp32 masters, LoGRA sketches / projections / row states, plus activations
   (op by op, with or without full recompute; the projection assumes recompute)
   for a TP/PP/DP layout.
2. Validation against ``benchmarks/memory.py`` at the same shape, layout and
   recompute mode (pass --measured, or this script runs memory.py itself): the
   model-state part against its enumerated tensors, the total against its
   measured peak (CUDA max allocated; on CPU live tensor bytes), each within 10%.
3. Projection: 1.5B / 7B / 27B shapes on 8 x ``--gpu-gib`` GPUs for several
   layouts, beside the paper's Table 1; the JSON names the 27B layouts that fit
   with room for activations.

What the model assumes of this implementation: megatron's distributed optimizer
shards the dense fp32 main + Adam moments over DP; LoGRA (with the same flag)
shards its row states and fp32 masters over DP by whole rows, keeps its sketches
whole in fp32 (they are DP-reduced); bf16 projections (exact for r a power of 4).
LoGRA's unsketched parameters are frozen as in the paper (no grad buffer, no optimizer
state; ``untargeted="adam"`` counts megatron's Adam for them instead).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30
PAPER_TABLE1 = {"1.5B": {"dense_adam": 9.18, "logra": 7.18}, "7B": {"dense_adam": 31.82,
                "logra": 17.29}, "27B": {"dense_adam": "OOM", "logra": 51.54}}  # avg GiB/GPU


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    head_dim: int | None = None

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads


SHAPES = {
    "tiny": Shape(128, 4, 4, 2, 384, 384, True),  # _train_probe's tiny llama (tests)
    "smollm2-135m": Shape(576, 30, 9, 3, 1536, 49152, True),
    "1.5B": Shape(1536, 28, 12, 2, 8960, 151936, True),  # Qwen2.5-1.5B
    "7B": Shape(3584, 28, 28, 4, 18944, 152064, False),  # Qwen2.5-7B
    "27B": Shape(5376, 62, 32, 16, 21504, 262144, True, head_dim=128),  # Gemma-3-27B-like
}


def layer_linears(s: Shape) -> list[tuple[int, int, str]]:
    """(out, in, parallel) of one layer's sketched linears, global (TP=1) sizes."""
    qkv = (s.heads + 2 * s.kv_heads) * s.hd
    return [(qkv, s.hidden, "col"), (s.hidden, s.heads * s.hd, "row"),
            (2 * s.ffn, s.hidden, "col"), (s.hidden, s.ffn, "row")]


def plan(s: Shape, tp: int, pp: int, dp: int, *, method: str, rank: int = 256,
         master: str = "fp32", seq: int = 4096, mbs: int = 1, sketch_embedding: bool = False,
         untargeted: str = "frozen", activations: bool = True,
         recompute: bool = True) -> dict[str, float]:
    """Bytes on the busiest rank (the first stage, which also holds the embedding)."""
    layers = -(-s.layers // pp)
    lin = layer_linears(s)
    lin_params = layers * sum(o * i for o, i, _ in lin) / tp
    small = layers * (2 * s.hidden + (s.heads + 2 * s.kv_heads) * s.hd / tp)  # norms, qkv bias
    emb = s.vocab * s.hidden / tp
    emb_copies = 2 if not s.tied and pp == 1 else 1  # untied, PP1: embedding + output layer
    emb_params = emb * emb_copies
    out = {"params": 2 * (lin_params + small + emb_params)}
    dense_state = lambda n: 4 * n + 12 * n / dp  # fp32 grad buffer + (main, m, v) sharded  # noqa: E731
    if method == "dense_adam":
        out["grads_and_optimizer"] = dense_state(lin_params + small + emb_params)
    else:
        sketched = lin_params + (emb_params if sketch_embedding else 0)
        unsketched = small + (0 if sketch_embedding else emb_params)
        out["grads_and_optimizer"] = dense_state(unsketched) if untargeted == "adam" else 0.0
        rows = layers * sum(o / tp if p == "col" else o for o, _, p in lin)
        cols = layers * sum(i if p == "col" else i / tp for _, i, p in lin)
        if sketch_embedding:
            rows += emb_copies * s.vocab / tp
            cols += emb_copies * s.hidden
        out["sketches"] = 4 * rows * rank
        out["row_states"] = 4 * rows / dp
        out["projections"] = 2 * rank * cols
        out["masters"] = 4 * sketched / dp if master == "fp32" else 0.0
    out["model_state"] = sum(out.values())
    if activations:
        out["activations"] = activation_bytes(s, tp, layers, method=method, rank=rank, seq=seq,
                                              mbs=mbs, recompute=recompute,
                                              sketch_output=sketch_embedding)
        if method == "logra":  # the optimizer step's transient, when it exceeds the activations
            out["activations"] = max(out["activations"],
                                     logra_step_transient(s, tp, master, sketch_embedding))
    out["total"] = out["model_state"] + out.get("activations", 0.0)
    return out


def layer_activation_bytes(s: Shape, tp: int, *, method: str, rank: int, seq: int) -> float:
    """Bytes per token one layer's forward leaves saved for backward (no recompute, bf16).

    Counted op by op for this implementation (megatron local spec, unfused CPU/GPU path):
    torch RMSNorm saves its fp32 input copy, the fp32 normalised value and the rsqrt; RoPE
    its bf16 cos/sin for q and k; unfused attention q, k, v expanded to all heads, the fp32
    softmax and its bf16 copy (a*s per token each); SwiGLU gate, up and silu(gate).
    The linears save their bf16 inputs (dense) or only X A^T in fp32 (LoGRA: the weight
    gradient is sketched, and the input gradient needs no X).
    """
    q = s.heads * s.hd
    norms = 2 * (8 * s.hidden + 4)
    rope = 4 * 2 * s.hd
    attention = (3 * 2 * q + (4 + 2) * s.heads * seq) / tp
    mlp = 3 * 2 * s.ffn / tp
    if method == "logra":
        linear_inputs = 4 * 4 * rank
    else:
        linear_inputs = 2 * 2 * s.hidden + 2 * (q + s.ffn) / tp
    return norms + rope + attention + mlp + linear_inputs


def activation_bytes(s: Shape, tp: int, layers: int, *, method: str, rank: int, seq: int,
                     mbs: int, recompute: bool, sketch_output: bool) -> float:
    """Peak activation bytes of one microbatch on the first stage (its forward ends, backward starts).

    No recompute: every layer's saved tensors. Full recompute (megatron, one layer per
    checkpoint): each layer's bf16 input, plus one layer's saved tensors while its
    backward recomputes it. The head: final norm, the output layer's input (or X A^T),
    and the loss over this rank's vocab shard (bf16 logits, their fp32 copy, the saved
    fp32 softmax and, as backward starts, its fp32 gradient: 14 bytes per entry).
    """
    n = seq * mbs
    layer = layer_activation_bytes(s, tp, method=method, rank=rank, seq=seq)
    body = layers * layer if not recompute else layers * 2 * s.hidden + layer
    output_input = 4 * rank if method == "logra" and sketch_output else 2 * s.hidden
    head = (8 * s.hidden + 4) + output_input + 14 * s.vocab / tp
    return n * (body + head)


# bytes per weight element of one update chunk (counted with runtime.live_bytes on
# low_rank_apply / row_adam): SR: fp32 W, fp64 D A, fp32 sum, the int64 noise mix (two
# words alive at once), int32 bits (28; 46 before the cheaper noise mix); fp32 master: the
# fp32 D A and the difference
STEP_BYTES_PER_ELEMENT = {"none": 28, "fp32": 12}
CHUNK_ROWS = 1024  # row_adam.DEFAULT_CHUNK_ROWS


def logra_step_transient(s: Shape, tp: int, master: str, sketch_embedding: bool) -> float:
    """Peak extra bytes of LoGRA's step: D lives in the sketch buffers; the update is applied
    one row chunk of one piece (a gated fc1 half is a piece) at a time."""
    q = s.heads * s.hd
    qkv = (s.heads + 2 * s.kv_heads) * s.hd
    pieces = [(qkv / tp, s.hidden), (s.hidden, q / tp), (s.ffn / tp, s.hidden),
              (s.hidden, s.ffn / tp)]
    if sketch_embedding:
        pieces.append((s.vocab / tp, s.hidden))
    largest = max(min(CHUNK_ROWS, rows) * cols for rows, cols in pieces)
    return STEP_BYTES_PER_ELEMENT[master] * largest


def validate(measured: dict) -> dict:
    s = SHAPES[measured["shape"]]
    report = {}
    for variant, run in measured["runs"].items():
        method = "dense_adam" if variant == "dense_adam" else "logra"
        master = "none" if variant == "logra_none" else "fp32"
        sketch_emb = "embedding" in measured.get("targets", "")
        full = plan(s, 1, 1, 1, method=method, rank=measured["rank"], master=master,
                    sketch_embedding=sketch_emb, seq=measured["seq_length"],
                    untargeted=measured.get("untargeted", "frozen"),
                    mbs=measured["micro_batch_size"], recompute=measured["recompute"])
        predicted, got = full["model_state"], run["model_state_bytes"]["total"]
        peak = run["peak_mem_bytes"]
        report[variant] = {"predicted_bytes": int(predicted), "measured_bytes": got,
                           "rel_error": round(abs(predicted - got) / got, 4),
                           # peak: CUDA max allocated, or on CPU the same counted by hand
                           # (live tensor storage; _train_probe.py)
                           "predicted_peak_bytes": int(full["total"]), "measured_peak_bytes": peak,
                           "peak_rel_error": round(abs(full["total"] - peak) / peak, 4)}
    report["ok"] = all(v["rel_error"] <= 0.10 and v["peak_rel_error"] <= 0.10
                       for v in report.values() if isinstance(v, dict))
    return report


LAYOUTS = [(8, 1, 1), (4, 2, 1), (4, 1, 2), (2, 4, 1), (2, 2, 2), (2, 1, 4), (1, 1, 8)]


def project(gpu_gib: float) -> dict:
    out = {}
    for name in ("1.5B", "7B", "27B"):
        s = SHAPES[name]
        rows = []
        for tp, pp, dp in LAYOUTS:
            if s.heads % tp or s.kv_heads % tp and tp % s.kv_heads or s.layers % pp and pp > 1:
                continue
            row = {"layout": f"TP{tp} PP{pp} DP{dp}"}
            for method, master in (("dense_adam", None), ("logra", "fp32"), ("logra", "none")):
                key = method if master is None else f"logra_{master}_master"
                total = plan(s, tp, pp, dp, method=method, master=master or "fp32")
                row[key] = {"model_state_gib": round(total["model_state"] / GIB, 2),
                            "total_gib": round(total["total"] / GIB, 2),
                            "fits": total["total"] <= 0.9 * gpu_gib * GIB}
            rows.append(row)
        out[name] = {"paper_table1_avg_gib": PAPER_TABLE1[name], "layouts": rows}
    fits27 = [r["layout"] for r in out["27B"]["layouts"]
              if r["logra_fp32_master"]["fits"] or r["logra_none_master"]["fits"]]
    out["27B_logra_layouts_that_fit"] = fits27
    out["27B_dense_layouts_that_fit"] = [r["layout"] for r in out["27B"]["layouts"]
                                         if r["dense_adam"]["fits"]]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--measured", help="JSON printed by benchmarks/memory.py (default: run it)")
    p.add_argument("--gpu-gib", type=float, default=80.0)
    args = p.parse_args(argv)
    if args.measured:
        measured = json.loads(Path(args.measured).read_text().strip().splitlines()[-1])
    else:
        proc = subprocess.run([sys.executable, str(Path(__file__).with_name("memory.py"))],
                              capture_output=True, text=True, check=True)
        measured = json.loads(proc.stdout.strip().splitlines()[-1])
    report = {"benchmark": "memory_plan", "gpu_gib": args.gpu_gib,
              "validation": validate(measured), "projection": project(args.gpu_gib)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
