"""torchrun worker for the parallel-invariance tests: runs several layouts in one launch.

    torchrun --standalone --nproc-per-node W tests/distributed/invariance_worker.py PLAN.json

PLAN.json: {"out": DIR, "runs": [{"name": ..., "argv": [...]} ...]}. A run
{"name", "init_weights": [...]} builds the model of that command line and saves its
initial weights only (the yardstick of the update-size tolerances). A run
{"name", "sketch_check": [TP, PP]} instead compares LoGRA's sketches with the dense
G A^T at that layout (``sketch_check.py``) and writes DIR/NAME.json; a run
{"name", "kl_check": [TP, PP, OPTIMIZER, DIST_OPT(, BF16)]} writes the predicted-KL
controller's numbers there (``kl_check.py``). Each run is a
normal launcher command line executed in-process (megatron's process groups are
rebuilt per run); rank 0 writes DIR/NAME.pt = {"losses", "grad_norms", "weights"}
with the weights gathered to full TP=1 tensors by canonical name.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    from megatron_logra.cli import parse_run_config
    from megatron_logra.testing.gather import gather_full_state_dict
    from megatron_logra.runtime.device import init_runtime
    from megatron_logra.training.prepare import prepare_training
    from megatron_logra.training.sft import run_sft

    rt = init_runtime()
    out = Path(plan["out"])
    for run in plan["runs"]:
        if "sketch_check" in run:  # {"name", "sketch_check": [tp, pp]}
            from sketch_check import sketch_vs_dense

            report = sketch_vs_dense(*run["sketch_check"], rt.world_size)
            if rt.rank == 0:
                (out / f"{run['name']}.json").write_text(json.dumps(report))
                print(f"[worker] {run['name']}: {report}", flush=True)
            continue
        if "kl_check" in run:  # {"name", "kl_check": [tp, pp, optimizer, distributed_opt]}
            from kl_check import kl_numbers

            report = kl_numbers(*run["kl_check"][:4], rt.world_size, *run["kl_check"][4:])
            if rt.rank == 0:
                (out / f"{run['name']}.json").write_text(json.dumps(report))
                print(f"[worker] {run['name']}: {report}", flush=True)
            continue
        if "init_weights" in run:
            cfg = parse_run_config(run["init_weights"], world_size=rt.world_size)
            objs = prepare_training(cfg).objs
            weights = gather_full_state_dict(objs.model[0], objs.arch)
            if rt.rank == 0:
                torch.save({"weights": weights}, out / f"{run['name']}.pt")
            del objs
            continue
        cfg = parse_run_config(run["argv"], world_size=rt.world_size)
        result = run_sft(cfg)
        weights = gather_full_state_dict(result.objects.model[0], result.objects.arch)
        if rt.rank == 0:
            torch.save({"losses": [r["loss"] for r in result.records],
                        "grad_norms": [r["grad_norm"] for r in result.records],
                        "steps": [r["step"] for r in result.records],
                        "state_bytes": getattr(result.objects.optimizer, "state_bytes",
                                               dict)(),
                        "weights": weights}, out / f"{run['name']}.pt")
            print(f"[worker] {run['name']}: losses {[round(r['loss'], 6) for r in result.records]}",
                  flush=True)
        del result
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
