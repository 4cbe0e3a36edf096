"""Per-rank memory of dense Adam, LoGRA and LoRA: a model, validated by measurement, projected.

    .venv/bin/python benchmarks/memory_plan.py [--measured memory.json] [--gpu-gib 80,141]

1. The model counts every tensor a rank holds, from the model megatron builds: the
   parameters come from ``model.provider.build_meta_model`` (megatron's own modules on
   the meta device: names, shapes and TP split dims, no memory), divided over TP by
   their split dim and over PP by layer. Per method: bf16 weights; dense Adam's fp32
   grad buffer and its fp32 main + Adam moments sharded over DP (megatron's distributed
   optimizer); LoGRA's fp32 sketches (out x r, DP-reduced, whole), row states and fp32
   masters sharded over DP by whole rows, projections A (bf16 when exact); LoRA's
   adapters with dense Adam's state. Activations op by op (with or without full
   recompute), times the microbatches the rank's pipeline stage keeps in flight
   (1F1B: PP - stage). The optimizer step's transient is derived from the ops the step
   runs (``step_transient``), and the peak is the larger of it and the activations.
2. Validation against ``benchmarks/memory.py`` at every layout it measured (DP1, DP2,
   DP4, TP2, PP2): the busiest rank's model state within 2% and its peak within 10%.
3. Projection: 1.5B, 7B and a Qwen3-style 27B (``configs/qwen3-27b.json``, which
   ``model/arch.py`` loads) on 8 GPUs of each ``--gpu-gib``, at the paper's sequence
   length (4096), microbatch 1 and activation checkpointing, for the TP/PP/DP layouts
   the trainer's CLI accepts for each method (LoGRA cannot sketch qkv when TP exceeds
   the kv heads: that layout is not listed for it).
4. The rollout engine's share for each placement (``placements``): the engine's GPUs
   (weights, the rollout batch's KV cache, an assumed overhead) beside the trainer's
   on the rest of the 8 (dedicated), or on the same GPUs in turns (colocated).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

GIB = 2**30
PAPER_TABLE1 = {"1.5B": {"dense_adam": 9.18, "logra": 7.18}, "7B": {"dense_adam": 31.82,
                "logra": 17.29}, "27B": {"dense_adam": "OOM", "logra": 51.54}}  # avg GiB/GPU
PROJECTED = {"1.5B": "qwen2.5-1.5b", "7B": "qwen2.5-7b", "27B": "qwen3-27b"}
LAYOUTS_8 = [(8, 1, 1), (4, 2, 1), (4, 1, 2), (2, 4, 1), (2, 2, 2), (2, 1, 4), (1, 1, 8),
             (1, 2, 4), (1, 4, 2), (1, 8, 1)]
ROLES = ("qkv", "proj", "fc1", "fc2")  # the layer linears LoGRA sketches and LoRA adapts
CHUNK_ROWS = 1024  # logra.row_adam.DEFAULT_CHUNK_ROWS


@dataclass(frozen=True)
class Param:
    """One parameter of the TP=1, PP=1 model megatron builds."""

    name: str
    shape: tuple[int, ...]
    split_dim: int | None  # megatron's TP partition dim (None: replicated)
    layer: int | None  # decoder layer (None: embedding, output layer, final norm)
    role: str  # qkv | proj | fc1 | fc2 | embedding | output | other


@lru_cache(maxsize=None)
def model_of(shape: str):
    """(ModelArch, [Param]) from megatron's model built on the meta device at TP1/PP1."""
    import os
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("MEGATRON_LOGRA_DEVICE", "cpu")
    from megatron_logra.model.arch import arch_from_hf_config
    from megatron_logra.model.provider import ModelBuildConfig, build_meta_model
    from megatron_logra.runtime.device import init_runtime
    from megatron_logra.runtime.parallel import ParallelConfig, initialize

    init_runtime()
    initialize(ParallelConfig(), 1, seed=0)
    from _train_probe import hf_config

    arch = arch_from_hf_config(hf_config(shape))
    model = build_meta_model(arch, ModelBuildConfig(bf16=True, use_transformer_engine=False))
    params = []
    for name, p in model.named_parameters():
        split = getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel",
                                                              False) else None
        layer = int(name.split(".")[2]) if name.startswith("decoder.layers.") else None
        role = next((r for r in ROLES if f"linear_{r}.weight" in name), "other")
        if name == "embedding.word_embeddings.weight":
            role = "embedding"
        elif name == "output_layer.weight":
            role = "output"
        params.append(Param(name, tuple(p.shape), split, layer, role))
    return arch, tuple(params)


@dataclass(frozen=True)
class Local:
    """One parameter's block on a rank: [rows, cols] (1-D: cols = 1)."""

    role: str
    rows: int
    cols: int
    parallel: str | None  # "column" (rows split), "row" (cols split), None (replicated)
    gated: bool  # a SwiGLU fc1 ([gate; up]: two row segments)

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def rank_params(shape: str, tp: int, pp: int, stage: int) -> list[Local]:
    """The parameter blocks pipeline stage ``stage`` holds on one TP rank."""
    arch, params = model_of(shape)
    per_stage = arch.num_layers // pp
    first, last = stage == 0, stage == pp - 1
    out = []
    for p in params:
        if p.layer is not None and not stage * per_stage <= p.layer < (stage + 1) * per_stage:
            continue
        if p.role == "embedding" and not first:
            continue
        if p.layer is None and p.role != "embedding" and not last:  # final norm, output
            continue
        rows, cols = (p.shape[0], p.shape[1]) if len(p.shape) == 2 else (p.shape[0], 1)
        if p.role == "qkv" and arch.num_kv_heads < tp:  # kv heads replicated over TP
            rows = (arch.num_attention_heads + 2 * tp) * arch.head_dim
        parallel = {0: "column", 1: "row"}.get(p.split_dim)
        if parallel == "column":
            rows //= tp
        elif parallel == "row":
            cols //= tp
        out.append(Local(p.role, rows, cols, parallel, p.role == "fc1"))
    if last and not first and arch.tie_word_embeddings:  # the last stage's copy of the
        emb = next(p for p in params if p.role == "embedding")  # tied embedding
        out.append(Local("output", emb.shape[0] // tp, emb.shape[1], "column", False))
    return out


def _dp_owned_rows(block: Local, dp: int) -> int:
    """Rows a DP rank owns of a sketched weight (``logra.row_shards``: whole rows, each
    segment split when it divides, else not sharded)."""
    segments = [block.rows // 2] * 2 if block.gated else [block.rows]
    return block.rows // dp if all(s % dp == 0 for s in segments) else block.rows


def _projection_bytes(rank: int) -> int:
    """Bytes per entry of a stored A: bf16 when +-1/sqrt(r) is exact (r a power of 4)."""
    exact = rank & (rank - 1) == 0 and (rank.bit_length() - 1) % 2 == 0
    return 2 if exact else 4


def model_state(blocks: list[Local], dp: int, *, method: str, rank: int = 256,
                master: str = "fp32", targets: tuple[str, ...] = ROLES,
                untargeted: str = "frozen", lora_rank: int = 16) -> dict[str, float]:
    """Bytes by category of one rank's model state (``_train_probe.model_state_bytes``)."""
    dense_state = lambda n: (4 * n, 12 * n / dp)  # noqa: E731  fp32 grads; main, m, v
    out = {"params": 2 * sum(b.numel for b in blocks), "grads": 0.0, "dense_optimizer": 0.0}
    if method == "dense_adam":
        trained = sum(b.numel for b in blocks)
    elif method == "lora":
        adapted = [b for b in blocks if b.role in targets]
        trained = sum(lora_rank * (b.rows + b.cols) for b in adapted)  # A [r, in], B [out, r]
        out["params"] += 2 * trained
    else:
        sketched = [b for b in blocks if b.role in targets
                    or (b.role in ("embedding", "output") and "embedding" in targets)]
        rest = sum(b.numel for b in blocks if b not in sketched)
        trained = rest if untargeted == "adam" else 0
        # S rows: a column-parallel block's own rows; a row-parallel block's S is out x r
        out["logra_sketches"] = 4 * rank * sum(b.rows for b in sketched)
        out["logra_row_indices"] = sum(  # int64 global row and HF module of each row, and
            16 * b.rows + (8 * _dp_owned_rows(b, dp)  # the owned rows' modules (a copy
                           if b.gated and _dp_owned_rows(b, dp) < b.rows else 0)  # only
            for b in sketched)  # when a gated fc1's two halves are sharded)
        out["logra_row_states"] = 4 * sum(_dp_owned_rows(b, dp) for b in sketched)
        out["logra_masters"] = (4 * sum(_dp_owned_rows(b, dp) * b.cols for b in sketched)
                                if master == "fp32" else 0.0)
        out["logra_projections"] = _projection_bytes(rank) * rank * sum(b.cols
                                                                        for b in sketched)
    out["grads"], out["dense_optimizer"] = dense_state(trained)
    out["total"] = sum(out.values())
    return out


def layer_activation_bytes(arch, tp: int, *, method: str, rank: int, seq: int,
                           lora_rank: int = 16, frozen_norms: bool = False) -> float:
    """Bytes per token one layer's forward leaves saved for backward (no recompute, bf16).

    Counted op by op for this implementation (megatron local spec, unfused CPU/GPU path):
    torch RMSNorm saves its fp32 input copy, the rsqrt and, when its weight trains, the
    fp32 normalised value (the weight's gradient needs it; LoGRA and LoRA freeze the
    norms) (Qwen3's q/k norms too); RoPE its bf16 cos/sin for q and k; unfused attention q, k,
    v expanded to all heads, the fp32 softmax and its bf16 copy (a*s per token each);
    SwiGLU gate, up and silu(gate). The linears save their bf16 inputs (dense Adam; LoRA
    too, for its A, plus X A^T [r] per adapter) or only X A^T in bf16 (LoGRA: the weight
    gradient is sketched, and the input gradient needs no X).
    """
    h, hd = arch.hidden_size, arch.head_dim
    q = arch.num_attention_heads * hd
    per_element = 4 if frozen_norms else 8
    norms = 2 * (per_element * h + 4)
    if arch.qk_norm:
        norms += per_element * (q + arch.num_kv_heads * hd) / tp
    rope = 4 * 2 * hd
    attention = (3 * 2 * q + (4 + 2) * arch.num_attention_heads * seq) / tp
    mlp = 3 * 2 * arch.ffn_hidden_size / tp
    if method == "logra":
        linear_inputs = 4 * 2 * rank
    else:
        linear_inputs = 2 * 2 * h + 2 * (q + arch.ffn_hidden_size) / tp
        if method == "lora":
            linear_inputs += 4 * 2 * lora_rank
    return norms + rope + attention + mlp + linear_inputs


def activation_bytes(arch, tp: int, pp: int, stage: int, *, method: str, rank: int, seq: int,
                     mbs: int, microbatches: int, recompute: bool,
                     sketch_output: bool = False, frozen_norms: bool = False,
                     lora_rank: int = 16) -> float:
    """Peak activation bytes of pipeline stage ``stage`` (1F1B: PP - stage microbatches in
    flight, capped by the microbatch count; the last stage also holds the loss head).

    No recompute: every layer's saved tensors. Full recompute (megatron, one layer per
    checkpoint): each layer's bf16 input, plus one layer's saved tensors while its
    backward recomputes it. The head: final norm, the output layer's input (or X A^T),
    and the loss over this rank's vocab shard at its forward's peak: the bf16 logits, their
    fp32 copy and its contiguous copy (megatron's cross entropy then works in place on
    it: max, exp, and in backward the softmax becomes the gradient), 10 bytes per entry,
    4 more when padded vocab entries are masked (``training.loss.token_nll``)."""
    n = seq * mbs
    layers = arch.num_layers // pp
    layer = layer_activation_bytes(arch, tp, method=method, rank=rank, seq=seq,
                                   lora_rank=lora_rank, frozen_norms=frozen_norms)
    body = layers * layer if not recompute else layers * 2 * arch.hidden_size + layer
    in_flight = min(pp - stage, microbatches)
    total = in_flight * n * body
    if stage == pp - 1:
        output_input = 2 * rank if method == "logra" and sketch_output else 2 * arch.hidden_size
        final_norm = (4 if frozen_norms else 8) * arch.hidden_size + 4
        loss = 10 + (4 if arch.padded_vocab_size > arch.vocab_size else 0)
        total += n * (final_norm + output_input + loss * arch.padded_vocab_size / tp)
    return total


def step_transient(blocks: list[Local], dp: int, *, method: str, rank: int,
                   master: str, targets: tuple[str, ...]) -> float:
    """Peak bytes LoGRA's optimizer step allocates beyond the model state, from the ops it
    runs per sketched block (D is computed in place in the sketch buffers):

    - the factor's rounding (``optimizer._apply_all``): D x c as bf16, 2 rows r;
    - ||D A|| (``row_adam.update_sq_norm``): D (A A^T), 4 rows r, and A A^T, 4 r^2;
    - SR mode (``row_adam.apply_low_rank_update`` exact, ``rounding``): per row chunk of
      E = min(1024, rows) x cols elements, A in fp64 (8 r cols) and D's chunk in fp64
      (8 chunk r) stay alive while the fp64 product and its fp32 copy (12 E), then the
      fp32 sum, the int32 noise and its shifted copy (12 E) are;
    - fp32 master: one in-place GEMM on the master, A in fp32 (4 r cols), then the bf16
      weight copied in place.
    Dense Adam and LoRA: 0 (megatron's Adam updates its shards in place)."""
    if method != "logra":
        return 0.0
    worst = 0.0
    for b in blocks:
        if b.role not in targets:
            continue
        rows = _dp_owned_rows(b, dp) // (2 if b.gated else 1)  # a gated fc1: two pieces
        common = max(2 * rows * rank, 4 * rows * rank + 4 * rank * rank)
        if master == "none":
            chunk = min(CHUNK_ROWS, rows)
            apply = 8 * rank * b.cols + 8 * chunk * rank + 12 * chunk * b.cols
        else:
            apply = 4 * rank * b.cols
        worst = max(worst, common, apply)
    return worst


def plan(shape: str, tp: int, pp: int, dp: int, *, method: str, rank: int = 256,
         master: str = "fp32", seq: int = 4096, mbs: int = 1, microbatches: int = 1,
         recompute: bool = True, targets: tuple[str, ...] = ROLES,
         untargeted: str = "frozen", lora_rank: int = 16) -> dict:
    """Bytes of every pipeline stage's rank, and the busiest (model state; peak)."""
    arch, _ = model_of(shape)
    stages = []
    for stage in range(pp):
        blocks = rank_params(shape, tp, pp, stage)
        state = model_state(blocks, dp, method=method, rank=rank, master=master,
                            targets=targets, untargeted=untargeted, lora_rank=lora_rank)
        frozen_norms = method == "lora" or (method == "logra" and untargeted == "frozen")
        act = activation_bytes(arch, tp, pp, stage, method=method, rank=rank, seq=seq,
                               mbs=mbs, microbatches=microbatches, recompute=recompute,
                               sketch_output="embedding" in targets,
                               frozen_norms=frozen_norms, lora_rank=lora_rank)
        transient = step_transient(blocks, dp, method=method, rank=rank, master=master,
                                   targets=targets)
        stages.append({"model_state": state["total"], "state": state, "activations": act,
                       "step_transient": transient,
                       "peak": state["total"] + max(act, transient)})
    return {"stages": stages, "model_state": max(s["model_state"] for s in stages),
            "peak": max(s["peak"] for s in stages)}


METHODS = {  # memory.py variant -> (method, LoGRA master)
    "dense_adam": ("dense_adam", "fp32"),
    "logra_fp32_master": ("logra", "fp32"),
    "logra_none": ("logra", "none"),
    "lora": ("lora", "fp32"),
}
STATE_TOLERANCE, PEAK_TOLERANCE = 0.02, 0.10


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
    """Whether the trainer's CLI takes this layout for this method (``ModelArch.
    check_parallel``; LoGRA's qkv sketch needs TP <= kv heads, ``cli._check_logra_fits``)."""
    arch, _ = model_of(shape)
    try:
        arch.check_parallel(tp, pp)
    except ValueError:
        return False
    return not (method == "logra" and arch.num_kv_heads < tp)


def project(gpu_gibs: list[float]) -> dict:
    """Every 8-GPU layout the CLI accepts, per model and method: busiest-rank model state
    and peak (seq 4096, microbatch 1, full recompute, r=256, LoRA r=16), and which fit."""
    out = {}
    for name, shape in PROJECTED.items():
        rows = []
        for tp, pp, dp in LAYOUTS_8:
            row = {"layout": f"TP{tp} PP{pp} DP{dp}"}
            for variant, (method, master) in METHODS.items():
                if not cli_accepts(shape, tp, pp, method):
                    continue
                got = plan(shape, tp, pp, dp, method=method, master=master)
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
            _numel(p.shape) for p in model_of(shape)[1]),
            "paper_table1_avg_gib": PAPER_TABLE1[name], "layouts": rows, "fits": fits}
    return out


# The rollout engine's share (``rollout.placement``), per engine GPU. Assumed, not
# measured: vLLM's CUDA context, workspace and sampler on an awake engine, and what a
# sleeping one keeps (level 1: weights moved to host memory, KV cache dropped).
ENGINE_OVERHEAD_GIB, ENGINE_ASLEEP_GIB = 2.0, 1.0
ROLLOUT_SEQS, ROLLOUT_TOKENS = 128, 4096  # the paper's rollout batch, all of its KV at once
ENGINE_TPS = (1, 2, 4, 8)


def engine_share(shape: str, engine_tp: int) -> dict:
    """Bytes per engine GPU: bf16 weights split over the engine's TP, the KV cache of the
    whole rollout batch (KV heads split over TP, replicated when fewer), the overhead."""
    arch, params = model_of(shape)
    weights = 2 * sum(_numel(p.shape) for p in params) / engine_tp
    kv_heads = max(arch.num_kv_heads / engine_tp, 1)
    kv = 2 * 2 * arch.num_layers * kv_heads * arch.head_dim * ROLLOUT_SEQS * ROLLOUT_TOKENS
    return {"weights": weights, "kv_cache": kv,
            "total": weights + kv + ENGINE_OVERHEAD_GIB * GIB}


def _layouts(shape: str, gpus: int, method: str) -> list[tuple[int, int, int]]:
    return [(tp, pp, gpus // (tp * pp)) for tp in range(1, gpus + 1) for pp in
            range(1, gpus + 1) if gpus % (tp * pp) == 0 and cli_accepts(shape, tp, pp, method)]


def placements(gpu_gibs: list[float], gpus: int = 8, models=tuple(PROJECTED),
               variants=tuple(METHODS)) -> dict:
    """Per projected model and method, on ``gpus`` GPUs of each size: the engine TPs and
    trainer layouts that fit (90% of a GPU) with the engine dedicated (its own GPUs, the
    trainer on the rest) or colocated (the same GPUs in turns: the trainer's model state
    stays while the engine generates; a sleeping engine's residue while the trainer
    trains)."""
    out = {}
    for name in models:
        shape = PROJECTED[name]
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
                                      if plan(shape, tp, pp, dp, method=method,
                                              master=master)["peak"] <= limit]
                    for tp, pp, dp in _layouts(shape, gpus, method):
                        got = plan(shape, tp, pp, dp, method=method, master=master)
                        if max(got["model_state"] + engine["total"],
                               got["peak"] + ENGINE_ASLEEP_GIB * GIB) <= limit:
                            colocated.append(f"engine TP{e} + TP{tp} PP{pp} DP{dp}")
                per_gib[f"{g:g}gib"] = {"dedicated": dedicated, "colocated": colocated}
            entry[variant] = per_gib
        out[name] = entry
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--measured", help="benchmarks/memory.py's JSON: its stdout or its --save "
                   "file (default: run it)")
    p.add_argument("--gpu-gib", default="80,141", help="GPU sizes to project on, comma list")
    p.add_argument("--save", action="store_true",
                   help="also write benchmarks/results/memory_plan.json and memory_plan.md")
    args = p.parse_args(argv)
    if args.measured:
        text = Path(args.measured).read_text().strip()
        try:  # benchmarks/results/memory.json (indented), or memory.py's stdout
            measured = json.loads(text)
        except json.JSONDecodeError:
            measured = json.loads(text.splitlines()[-1])
    else:
        proc = subprocess.run([sys.executable, str(HERE / "memory.py")],
                              capture_output=True, text=True, check=True)
        measured = json.loads(proc.stdout.strip().splitlines()[-1])
    gibs = [float(g) for g in args.gpu_gib.split(",")]
    report = {"benchmark": "memory_plan", "gpu_gib": gibs, "validation": validate(measured),
              "projection": project(gibs), "engine_placements": placements(gibs)}
    if args.save:
        from _results import save

        save("memory_plan", report, table(report, measured))
    print(json.dumps(report))


def table(report: dict, measured: dict) -> str:
    """Markdown: the validation, then per projected model the busiest rank's peak (GiB) per
    layout and method, marked where it fits 90% of each GPU size."""
    lines = [f"Validation against `benchmarks/memory.py` ({measured['shape']} shape, "
             f"{measured['device'].upper()}), busiest rank:", "",
             "| layout and method | model state: predicted / measured (MiB) | error | "
             "peak: predicted / measured (MiB) | error |", "|---|---|---|---|---|"]
    for key, v in report["validation"].items():
        if key == "ok":
            continue
        lines.append(f"| {key} | {v['predicted_state_bytes'] / 2**20:.0f} / "
                     f"{v['measured_state_bytes'] / 2**20:.0f} | {v['state_rel_error']:.1%} | "
                     f"{v['predicted_peak_bytes'] / 2**20:.0f} / "
                     f"{v['measured_peak_bytes'] / 2**20:.0f} | {v['peak_rel_error']:.1%} |")
    gibs = report["gpu_gib"]
    sizes = " / ".join(f"{g:g}" for g in gibs)
    lines += ["", "**Projection** (not measured): 8 GPUs, seq 4096, microbatch 1, full "
              "recompute, LoGRA r=256 (q/k/v/o/gate/up/down, the rest frozen), LoRA r=16; "
              f"peak GiB of the busiest rank; fits: under 90% of {sizes} GiB; - : the CLI "
              "refuses the layout for that method.", ""]
    for name, entry in report["projection"].items():
        where = ("benchmarks/configs/" if (HERE / "configs" / f"{entry['config']}.json")
                 .is_file() else "_train_probe.SHAPES, ") + entry["config"]
        paper = entry["paper_table1_avg_gib"]
        lines += [f"{name} ({where}, {entry['params'] / 1e9:.2f}B parameters; the paper's "
                  f"Table 1, average GiB per GPU: dense Adam {paper['dense_adam']}, LoGRA "
                  f"{paper['logra']}):", "",
                  "| layout | " + " | ".join(METHODS) + " |", "|---|" + "---|" * len(METHODS)]
        for row in entry["layouts"]:
            cells = []
            for variant in METHODS:
                got = row.get(variant)
                if got is None:
                    cells.append("-")
                    continue
                fits = "/".join("fits" if got[f"fits_{g:g}gib"] else "no" for g in gibs)
                cells.append(f"{got['peak_gib']} ({fits})")
            lines.append(f"| {row['layout']} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += engine_table(report)
    return "\n".join(lines)


def engine_table(report: dict) -> list[str]:
    """Markdown: per model and method, how many (engine TP, trainer layout) pairs fit with
    the engine dedicated and colocated, on 8 GPUs of each size, and the engine's share."""
    gibs = report["gpu_gib"]
    lines = ["**The rollout engine's share** (projection, not measured; "
             "`--rollout-placement`): per engine GPU, bf16 weights over the engine's TP, the "
             f"KV cache of the paper's rollout batch ({ROLLOUT_SEQS} x {ROLLOUT_TOKENS} "
             "tokens, all of it at once: the upper bound; a smaller --rollout-kv-cache-gib "
             "generates the batch in waves) and an assumed "
             f"{ENGINE_OVERHEAD_GIB:g} GiB of vLLM overhead. "
             "Dedicated: the engine on GPUs of its own, the trainer on the other 8 - TP. "
             "Colocated: the same 8 GPUs in turns, the trainer's model state kept while the "
             f"engine generates, an assumed {ENGINE_ASLEEP_GIB:g} GiB left by the sleeping "
             "engine while the trainer trains (dense Adam's optimizer state is not "
             "offloaded). Cells: the number of (engine TP, trainer layout) pairs that fit "
             "under 90% of the GPU, and the first of them.", ""]
    for name, entry in report["engine_placements"].items():
        share = ", ".join(f"{k} {v} GiB" for k, v in entry["engine_gib"].items())
        lines += [f"{name}, engine per GPU: {share}", "",
                  "| method | " + " | ".join(f"{mode} on {g:g} GiB" for g in gibs
                                             for mode in ("dedicated", "colocated")) + " |",
                  "|---|" + "---|" * (2 * len(gibs))]
        for variant in METHODS:
            cells = []
            for g in gibs:
                for mode in ("dedicated", "colocated"):
                    fits = entry[variant][f"{g:g}gib"][mode]
                    cells.append(f"{len(fits)}: {fits[0]}" if fits else "0")
            lines.append(f"| {variant} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


if __name__ == "__main__":
    main()
