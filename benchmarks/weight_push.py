"""Weight pushes into vLLM's server per transport, trainer TP x PP into server TP 1 and 2.

    .venv/bin/python benchmarks/weight_push.py [--updates 6] [--engine-tps 1,2]
        [--tp 2] [--pp 2] [--save weight_push]

One torchrun job per server TP size: a trainer at TP x PP (4 CPU processes at TP2 x
PP2) of a 160M-parameter random-init Llama shape (``SHAPE``), bf16 weights, LoGRA in SR
mode on every target (embedding and output layer included; the rest frozen), and a live
bf16 vLLM server of that TP size, started by trainer rank 0, taking pushes through its
weight-transfer routes into the ``mlogra`` backend. Per update (a real LoGRA step on a
random batch) the server gets a delta (sketch-delta on odd updates, sparse-delta on even
ones), then a full push of the same weights. Per push: wall time (all ranks, barrier to
barrier), the bytes the server's workers received (headers included), what left trainer
rank 0 (its own pieces only), and at the end whether the server holds the trainer's
weights bit for bit (vLLM's checksums). CPU figures (gloo over loopback, 2 cores): the
point is the shape of the traffic; on GPUs the group is NCCL. Last stdout line: the
JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import mib, save

from megatron_logra.memory.shapes import SHAPES, hf_config

REPO = Path(__file__).resolve().parents[1]

SHAPE = "llama-160m"  # memory.shapes.SHAPES
TRANSPORTS = ("sketch-delta", "sparse-delta", "full")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--updates", type=int, default=6)
    p.add_argument("--engine-tps", default="1,2")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--rank", type=int, default=64, help="LoGRA rank")
    p.add_argument("--save", metavar="NAME", help="write benchmarks/results/NAME.{json,md}")
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    p.add_argument("--engine-tp", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _engine_dir(root: Path) -> str:
    """The server's folder: the shape's config.json and the packaged tiny tokenizer (no
    rollouts here; the server starts on dummy weights, the first push brings them)."""
    config = hf_config(SHAPE)
    tokenizer = REPO / "megatron_logra" / "assets" / "tiny-llama"
    folder = root / "engine_init"
    folder.mkdir(parents=True, exist_ok=True)
    for f in tokenizer.iterdir():
        if f.name != "config.json":
            shutil.copy2(f, folder / f.name)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from megatron_logra.weight_sync.config import WeightSyncConfig
    from megatron_logra.rl.synced_engines import SyncedEngines
    from megatron_logra.rollout.engines import RolloutEngines
    from megatron_logra.rollout.config import EngineConfig
    from megatron_logra.rollout.types import ServerSpec
    from megatron_logra.weight_sync.contract import Transport
    from megatron_logra.weight_sync.sync import WeightSync
    from megatron_logra.config import LograConfig, OptimizerConfig
    from megatron_logra.model.arch import load_arch
    from megatron_logra.model.provider import ModelBuildConfig
    from megatron_logra.runtime.collectives import from_rank0
    from megatron_logra.runtime.device import init_runtime
    from megatron_logra.runtime.parallel import ParallelConfig, initialize
    from megatron_logra.testing.batches import random_microbatches
    from megatron_logra.training.build import build_training_objects
    from megatron_logra.training.step import train_step

    rt = init_runtime()
    initialize(ParallelConfig(args.tp, args.pp), rt.world_size, seed=0)
    root = Path(tempfile.gettempdir()) / f"megatron_logra-weight-push-{os.getuid()}"
    folder = from_rank0(lambda: _engine_dir(root))
    arch = load_arch(folder)
    opt = OptimizerConfig(name="logra", lr=1e-5, use_distributed_optimizer=True,
                          logra=LograConfig(rank=args.rank, master_weights="none",
                                            update_ratio=2e-3, keep_updates=True,
                                            targets=("qkv", "proj", "fc1", "fc2", "embedding",
                                                     "output"), untargeted="frozen"))
    objs = build_training_objects(arch, ModelBuildConfig(bf16=True), opt, seed=0,
                                  train_iters=args.updates + 1)
    sync = WeightSync(WeightSyncConfig(transport=Transport.SKETCH_DELTA, verify_interval=0),
                      objs.model, arch, torch.bfloat16, optimizer=objs.optimizer,
                      engine_tp=args.engine_tp)
    sync.track_changes()  # sparse deltas: every full push records its base
    cfg = ServerSpec(folder, max_model_len=128, max_num_seqs=4,
                     engine=EngineConfig(dtype="bfloat16", kv_cache_gib=0.25,
                                         tensor_parallel_size=args.engine_tp))
    link = SyncedEngines(RolloutEngines([cfg] if rt.rank == 0 else None), sync)
    with sync.forcing(Transport.FULL):  # start-up: the server on dummy weights, then these
        link.push(0)
    rows = []
    try:
        for update in range(args.updates):
            batch = random_microbatches(arch.vocab_size, count=1, batch=2, seq=64, seed=update)
            train_step(objs, batch, seq_length=64, micro_batch_size=2)
            version = update + 1
            for transport in (TRANSPORTS[update % 2], Transport.FULL):
                rows.append(_timed_push(link, version, transport))
                if rt.rank == 0:
                    print(f"[weight_push] {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
        # vLLM's checksums (collective)
        bad, failed = link.sync.full.mismatches(link.engines.server)
        exact = not failed and bad == []
    finally:
        link.close()
    if rt.rank == 0:
        params = arch.num_parameters
        Path(args.worker).write_text(json.dumps({"rows": rows, "exact": exact,
                                                 "params": params}))
    dist.barrier()


def _timed_push(link, version: int, transport: str) -> dict:
    import torch.distributed as dist

    direct = link.sync.weights.direct
    before_bytes, before_own = link.stats.bytes, direct.sent_here
    dist.barrier()
    start = time.perf_counter()
    with link.sync.forcing(transport):
        link.push(version)
    dist.barrier()
    seconds = time.perf_counter() - start
    if link.sync.stats.last_transport != transport:
        raise RuntimeError(f"asked for {transport}, pushed {link.sync.stats.last_transport}")
    return {"version": version, "transport": transport, "seconds": round(seconds, 4),
            "worker_bytes": link.stats.bytes - before_bytes,
            "rank0_bytes": direct.sent_here - before_own}


def _summary(rows: list[dict]) -> dict:
    return {transport: {k: statistics.median(r[k] for r in rows if r["transport"] == transport)
                        for k in ("seconds", "worker_bytes", "rank0_bytes")}
            for transport in TRANSPORTS if any(r["transport"] == transport for r in rows)}


def _table(report: dict) -> str:
    lines = ["| trainer | server | transport | time (s) | into workers (MiB) | "
             "from rank 0 (MiB) |", "|---|---|---|---|---|---|"]
    for run in report["runs"]:
        for transport, r in run["summary"].items():
            lines.append(f"| TP{report['tp']} PP{report['pp']} | TP{run['engine_tp']} | "
                         f"{transport} | {r['seconds']:.2f} | {mib(r['worker_bytes'])} | "
                         f"{mib(r['rank0_bytes'])} |")
    exact = all(run["exact"] for run in report["runs"])
    return ("\n".join(lines) + f"\n\n{report['params'] / 1e6:.0f}M parameters, bf16; medians "
            f"over {report['updates']} updates (deltas: half each). The server's weights equal "
            f"the trainer's bit for bit at the end (vLLM's checksums): {exact}. CPU figures "
            f"(gloo over loopback, 2 cores shared by {report['tp'] * report['pp']} trainer "
            f"ranks and the server).\n")


def main(argv=None) -> None:
    args = parse(argv)
    if args.worker:
        return worker(args)
    runs = []
    for engine_tp in (int(x) for x in args.engine_tps.split(",")):
        out = Path(tempfile.mkdtemp(prefix="weight-push-")) / "out.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(args.tp * args.pp), __file__, "--worker", str(out),
               "--engine-tp", str(engine_tp), "--tp", str(args.tp), "--pp", str(args.pp),
               "--updates", str(args.updates), "--rank", str(args.rank)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        subprocess.run(cmd, check=True, env=env)
        got = json.loads(out.read_text())
        runs.append({"engine_tp": engine_tp, "exact": got["exact"],
                     "summary": _summary(got["rows"]), "rows": got["rows"]})
        params = got["params"]
    report = {"benchmark": "weight_push", "shape": SHAPES[SHAPE], "params": params,
              "tp": args.tp, "pp": args.pp, "updates": args.updates, "logra_rank": args.rank,
              "runs": runs}
    if args.save:
        save(args.save, report, _table(report))
    print(_table(report))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
