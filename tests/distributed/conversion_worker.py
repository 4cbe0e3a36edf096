"""torchrun worker for the conversion parity tests: many (model, source, layout) cases per launch.

    torchrun --standalone --nproc-per-node W tests/distributed/conversion_worker.py PLAN.json

PLAN.json: {"out": DIR, "cases": [{"name", "hf_dir", "source": "hf" | "ckpt", "ckpt",
"tp", "pp"}], "sft": [{"name", "argv"}]}. For each case every rank builds its shard,
loads it (``hf``: straight from the HF safetensors, each rank reading only its
slices; ``ckpt``: a megatron checkpoint through dist_checkpointing) and the
logits are compared with transformers'. Rank 0 writes DIR/NAME.json with the max
abs logits diff and, per rank, the safetensors bytes read vs the bytes of its
own parameters. Each "sft" entry is a launcher command line run in-process
(rank 0 writes DIR/NAME.json with its losses).
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def _run_case(case: dict, world_size: int, device: torch.device, reference: dict) -> dict:
    from megatron_logra.convert import safetensors_io
    from megatron_logra.convert.hf_checkpoint import load_hf_weights
    from megatron_logra.convert.logits_parity import logits_max_diff
    from megatron_logra.model.arch import load_arch
    from megatron_logra.model.provider import ModelBuildConfig, build_gpt_model
    from megatron_logra.runtime.parallel import ParallelConfig, initialize
    from megatron_logra.checkpoint.load import load_model_weights

    arch = load_arch(case["hf_dir"])
    initialize(ParallelConfig(case["tp"], case["pp"]), world_size, seed=0)
    model = [build_gpt_model(arch, ModelBuildConfig(), seed=1)]
    before = safetensors_io.BYTES_READ[0]
    if case["source"] == "hf":
        load_hf_weights(model, arch, case["hf_dir"])
    else:
        load_model_weights(case["ckpt"], model, arch)
    read = safetensors_io.BYTES_READ[0] - before
    own = sum(p.numel() * p.element_size() for p in model[0].parameters())
    diff, tokens = logits_max_diff(model, arch, case["hf_dir"], torch.float32, device, reference)
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, {"bytes_read": read, "param_bytes": own})
    return {"max_abs_diff": diff, "tokens": tokens, "ranks": per_rank}


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    from megatron_logra.cli import parse_run_config
    from megatron_logra.runtime.device import init_runtime
    from megatron_logra.training.sft import run_sft

    rt = init_runtime()
    out = Path(plan["out"])
    reference: dict = {}
    cases = sorted(plan.get("cases", []), key=lambda c: (c["tp"], c["pp"]))
    for case in cases:
        start = time.perf_counter()
        result = _run_case(case, rt.world_size, rt.device, reference)
        if rt.rank == 0:
            (out / f"{case['name']}.json").write_text(json.dumps(result))
            print(f"[worker] {case['name']}: max |diff| {result['max_abs_diff']:.3g} "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
    for run in plan.get("sft", []):
        result = run_sft(parse_run_config(run["argv"], world_size=rt.world_size))
        if rt.rank == 0:
            losses = [r["loss"] for r in result.records]
            (out / f"{run['name']}.json").write_text(json.dumps({"losses": losses}))
            print(f"[worker] {run['name']}: losses {losses}", flush=True)
        del result
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
