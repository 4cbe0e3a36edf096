"""Weight pushes over the rank-0 pipe vs the direct channel, side by side, per transport.

    .venv/bin/python benchmarks/weight_channel.py [--updates 4] [--engine-tps 1,2]
        [--tp 2] [--pp 2] [--save weight_channel]

One torchrun job per engine TP size: a trainer at TP x PP (4 CPU processes at TP2 x
PP2) of a 160M-parameter random-init Llama shape (``SHAPE``), bf16 weights, LoGRA in SR
mode on every target (embedding and output layer included; the rest frozen), and two live
bf16 vLLM engines of that TP size: an engine process fed over the rank-0 pipe, and vLLM's
own server fed over the direct channel (``--weight-sync-channel direct``: vLLM's
weight-transfer routes into the ``mlogra`` backend; exactness by vLLM's checksums). Per update (a real LoGRA step on a random
batch) each engine gets the same delta (sketch-delta on odd updates, sparse-delta on
even ones), then the same full push; the two channels take turns going first. Per push:
wall time (all ranks, barrier to barrier), the bytes the engine took (pipe: what crossed
rank 0's pipe, each worker then receiving all of it; direct: what the workers received,
headers included), what crossed trainer rank 0 (pipe: the whole payload; direct: its
own pieces), and at the end whether each engine holds the trainer's weights bit for
bit. CPU figures (gloo, shared memory, 2 cores): the point is the shape of the traffic;
on GPUs the direct channel is NCCL. Last stdout line: the JSON.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from _results import mib, save  # noqa: E402
from sync import _random_microbatches  # noqa: E402

SHAPE = dict(family="llama", hidden_size=1024, num_layers=8, num_heads=8, num_kv_heads=4,
             intermediate_size=2816, vocab_size=32000, tie_word_embeddings=False)
CHANNELS = ("pipe", "direct")
TRANSPORTS = ("sketch-delta", "sparse-delta", "full")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--updates", type=int, default=4)
    p.add_argument("--engine-tps", default="1,2")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--rank", type=int, default=64, help="LoGRA rank")
    p.add_argument("--save", metavar="NAME", help="write benchmarks/results/NAME.{json,md}")
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    p.add_argument("--engine-tp", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _engine_dirs(root: Path) -> dict[str, str]:
    """One engine folder per channel: the shape's config.json and the packaged tiny
    tokenizer (no rollouts here; the pipe engine's start-up weights are written into it)."""
    from megatron_logra.model.tiny_assets import tiny_hf_config

    kw = dict(SHAPE)
    config = tiny_hf_config(kw.pop("family"), **kw)
    tokenizer = REPO / "megatron_logra" / "assets" / "tiny-llama"
    out = {}
    for channel in CHANNELS:
        folder = root / channel
        folder.mkdir(parents=True, exist_ok=True)
        for f in tokenizer.iterdir():
            if f.name != "config.json":
                shutil.copy2(f, folder / f.name)
        (folder / "config.json").write_text(json.dumps(config))
        out[channel] = str(folder)
    return out


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from megatron_logra.bridge.config import WeightSyncConfig
    from megatron_logra.bridge.engine_link import EngineLink
    from megatron_logra.bridge.full_weights import full_push
    from megatron_logra.bridge.protocol import Channel, EngineConfig, Transport
    from megatron_logra.bridge.sync import WeightSync
    from megatron_logra.config import LograConfig, OptimizerConfig
    from megatron_logra.model.arch import load_arch
    from megatron_logra.model.provider import ModelBuildConfig
    from megatron_logra.runtime.device import init_runtime
    from megatron_logra.runtime.parallel import ParallelConfig, initialize
    from megatron_logra.training.setup import build_training_objects
    from megatron_logra.training.step import train_step

    rt = init_runtime()
    initialize(ParallelConfig(args.tp, args.pp), rt.world_size, seed=0)
    root = Path(tempfile.gettempdir()) / f"megatron_logra-weight-channel-{os.getuid()}"
    dirs = [_engine_dirs(root) if rt.rank == 0 else None]
    dist.broadcast_object_list(dirs, src=0)
    dirs = dirs[0]
    arch = load_arch(dirs["pipe"])
    opt = OptimizerConfig(name="logra", lr=1e-5, use_distributed_optimizer=True,
                          logra=LograConfig(rank=args.rank, master_weights="none",
                                            update_ratio=2e-3, keep_updates=True,
                                            targets=("qkv", "proj", "fc1", "fc2", "embedding",
                                                     "output"), untargeted="frozen"))
    objs = build_training_objects(arch, ModelBuildConfig(bf16=True), opt, seed=0,
                                  train_iters=args.updates + 1)
    links = {}
    for channel in CHANNELS:
        sync = WeightSync(WeightSyncConfig(transport=Transport.SKETCH_DELTA,
                                           channel=Channel(channel), verify_interval=0),
                          objs.model, arch, torch.bfloat16, optimizer=objs.optimizer,
                          engine_tp=args.engine_tp)
        sync.track_changes()  # sparse deltas: every full push records its base
        cfg = EngineConfig(dirs[channel], max_model_len=128, dtype="bfloat16",
                           kv_cache_gib=0.25, tensor_parallel_size=args.engine_tp,
                           max_num_seqs=4, delta_sync=True,
                           load_format="dummy" if channel == "direct" else "auto")
        links[channel] = EngineLink(sync, cfg if rt.rank == 0 else None)
        links[channel].push(0, Transport.FULL)  # start-up (the pipe's: written to its folder)
    rows = []
    try:
        for update in range(args.updates):
            train_step(objs, _random_microbatches(arch.vocab_size, 64, update), seq_length=64,
                       micro_batch_size=2)
            version = update + 1
            order = CHANNELS if update % 2 == 0 else CHANNELS[::-1]
            delta = TRANSPORTS[update % 2]
            for transport in (delta, Transport.FULL):
                for channel in order:
                    rows.append(_timed_push(links[channel], channel, version, transport))
                    if rt.rank == 0:
                        print(f"[weight_channel] {json.dumps(rows[-1])}", file=sys.stderr,
                              flush=True)
        exact = {}
        mine = {n: t for b in full_push(objs.model, arch, links["pipe"].sync.plan,
                                        dtype=torch.bfloat16) for n, t in b}
        for channel, link in links.items():
            if channel == "direct":  # vLLM's server: its checksums (collective)
                bad, failed = link.sync.full.mismatches(link.engine)
                exact[channel] = not failed and bad == []
            elif rt.rank == 0:
                theirs = link.engine.engine_weights(sorted(mine))
                exact[channel] = all(torch.equal(mine[n], theirs[n]) for n in mine)
    finally:
        for link in links.values():
            link.close()
    if rt.rank == 0:
        params = sum(t.numel() for t in mine.values())
        Path(args.worker).write_text(json.dumps({"rows": rows, "exact": exact,
                                                 "params": params}))
    dist.barrier()


def _timed_push(link, channel: str, version: int, transport: str) -> dict:
    import torch.distributed as dist

    direct = link.sync.weights.direct
    before_bytes, before_own = link.stats.bytes, direct.sent_here if direct else 0
    dist.barrier()
    start = time.perf_counter()
    link.push(version, transport)
    dist.barrier()
    seconds = time.perf_counter() - start
    if link.sync.stats.last_transport != transport:
        raise RuntimeError(f"{channel}: asked for {transport}, pushed "
                           f"{link.sync.stats.last_transport}")
    sent = link.stats.bytes - before_bytes
    workers = link.engine_cfg.tensor_parallel_size if link.engine_cfg else 1
    return {"channel": channel, "version": version, "transport": transport,
            "seconds": round(seconds, 4), "engine_bytes": sent,
            "worker_bytes": sent if direct else sent * workers,
            "rank0_bytes": (direct.sent_here - before_own) if direct else sent}


def _summary(rows: list[dict]) -> dict:
    out = {}
    for transport in TRANSPORTS:
        for channel in CHANNELS:
            mine = [r for r in rows if r["channel"] == channel and r["transport"] == transport]
            if mine:
                out.setdefault(transport, {})[channel] = {
                    k: statistics.median(r[k] for r in mine)
                    for k in ("seconds", "engine_bytes", "worker_bytes", "rank0_bytes")}
        both = out.get(transport, {})
        if len(both) == 2:
            both["time_ratio_direct_vs_pipe"] = round(
                both["direct"]["seconds"] / both["pipe"]["seconds"], 3)
    return out


def _table(report: dict) -> str:
    lines = ["| trainer | engine | transport | channel | time (s) | into engine (MiB) | "
             "into workers (MiB) | through rank 0 (MiB) |", "|---|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        for transport, both in run["summary"].items():
            for channel in CHANNELS:
                r = both[channel]
                lines.append(f"| TP{report['tp']} PP{report['pp']} | TP{run['engine_tp']} | "
                             f"{transport} | {channel} | {r['seconds']:.2f} | "
                             f"{mib(r['engine_bytes'])} | {mib(r['worker_bytes'])} | "
                             f"{mib(r['rank0_bytes'])} |")
    exact = all(all(run["exact"].values()) for run in report["runs"])
    return ("\n".join(lines) + f"\n\n{report['params'] / 1e6:.0f}M parameters, bf16; medians "
            f"over {report['updates']} updates (deltas: half each). Engines' weights equal the "
            f"trainer's bit for bit at the end: {exact}. CPU figures (gloo over loopback, "
            f"2 cores shared by {report['tp'] * report['pp']} trainer ranks and both "
            f"engines).\n")


def main(argv=None) -> None:
    args = parse(argv)
    if args.worker:
        return worker(args)
    runs = []
    for engine_tp in (int(x) for x in args.engine_tps.split(",")):
        out = Path(tempfile.mkdtemp(prefix="weight-channel-")) / "out.json"
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
    report = {"benchmark": "weight_channel", "shape": SHAPE, "params": params, "tp": args.tp,
              "pp": args.pp, "updates": args.updates, "logra_rank": args.rank, "runs": runs}
    if args.save:
        save(args.save, report, _table(report))
    print(_table(report))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
