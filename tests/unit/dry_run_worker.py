"""The dry run in one process of its own (fake CUDA refuses a process whose CPU shims are
applied, as pytest's are): ``python tests/unit/dry_run_worker.py MODEL_DIR`` prints one JSON
line for ``test_dry_run.py``:

- ``layouts``: world 8 as TP2 x PP2 x DP2 (LoGRA as the paper: sketched linears, the rest
  frozen, distributed optimizer, bf16, predicted-KL control, RL update and first weight
  push) and as TP4 x PP2 (dense Adam), each a ``dry_run.run.dry_run`` report;
- ``faults``: the TP2 x PP2 x DP2 run of rank 0 with a fault put into its update (the
  report, and the line the fault is on): a CPU tensor all-reduced in a group that only
  NCCL serves, and a CPU tensor added to a CUDA one.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

COMMON = ["--stage", "rl", "--bf16", "--use-distributed-optimizer", "--prompts-per-step", "4",
          "--seq-length", "48", "--max-new-tokens", "16", "--micro-batch-size", "1",
          "--task", "gcd", "--dry-run", "--dry-run-world-size", "8"]
LAYOUTS = {
    "tp2_pp2_dp2_logra": ["--tensor-model-parallel-size", "2",
                          "--pipeline-model-parallel-size", "2", "--optimizer", "logra",
                          "--logra-rank", "16", "--kl-control", "predicted"],
    "tp4_pp2_dense_adam": ["--tensor-model-parallel-size", "4",
                           "--pipeline-model-parallel-size", "2", "--optimizer", "adam"],
}
FAULT_LINES: dict[str, int] = {}


def cpu_tensor_to_nccl(reports, width):
    """A CPU tensor all-reduced in a group only NCCL serves."""
    group = dist.new_group(list(range(dist.get_world_size())), backend="nccl")
    FAULT_LINES["cpu_tensor_to_nccl"] = sys._getframe().f_lineno + 1
    dist.all_reduce(torch.zeros(width), group=group)
    return ORIGINAL(reports, width)


def cpu_tensor_into_cuda(reports, width):
    """A CPU tensor [width] added to a CUDA one."""
    from megatron_logra.runtime.device import current_device

    FAULT_LINES["cpu_tensor_into_cuda"] = sys._getframe().f_lineno + 1
    torch.zeros(width, device=current_device()) + torch.ones(width)
    return ORIGINAL(reports, width)


def main(model_dir: str) -> None:
    global ORIGINAL
    from megatron_logra.cli import parse_run_config
    from megatron_logra.dry_run.run import dry_run
    from megatron_logra.training import step

    out = {"layouts": {}, "faults": {}}
    for name, flags in LAYOUTS.items():
        cfg = parse_run_config(["--model-dir", model_dir, *COMMON, *flags])
        out["layouts"][name] = dry_run(cfg)
    ORIGINAL = step.global_report_sums
    cfg = parse_run_config(["--model-dir", model_dir, *COMMON, *LAYOUTS["tp2_pp2_dp2_logra"],
                            "--dry-run-ranks", "0"])
    for fault in (cpu_tensor_to_nccl, cpu_tensor_into_cuda):
        step.global_report_sums = fault
        try:
            report = dry_run(cfg)
        finally:
            step.global_report_sums = ORIGINAL
        out["faults"][fault.__name__] = {"report": report, "line": FAULT_LINES[fault.__name__]}
    print(json.dumps(out))


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    main(sys.argv[1])
