"""Check a megatron checkpoint against its HF model: logits on sample prompts.

    python -m checkpoints_tools.verify --hf-dir HF_DIR --ckpt CKPT
    torchrun --standalone --nproc-per-node 4 -m checkpoints_tools.verify --hf-dir HF_DIR \
        --ckpt CKPT --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

Prints one JSON line (max |logits diff|, tolerance, layout) and exits 0 when the
difference is within --tolerance, 1 when it is not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import os
import sys

from checkpoints_tools._cli import run_tool, tool_parser


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser("verify", __doc__, launcher="[torchrun ...] ")
    p.add_argument("--hf-dir", required=True, help="HF model folder (the reference)")
    p.add_argument("--ckpt", required=True, help="megatron checkpoint folder or iter_* folder")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP degree")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP degree")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max |logits diff| allowed")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    status = {"code": 0}

    def body() -> None:
        from megatron_logra.convert.logits_parity import check_logits_parity, report
        from megatron_logra.runtime.parallel import ParallelConfig

        ParallelConfig(args.tensor_model_parallel_size,
                       args.pipeline_model_parallel_size).validate(
            int(os.environ.get("WORLD_SIZE", "1")))
        result = check_logits_parity(
            args.hf_dir, args.ckpt, tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            tolerance=args.tolerance)
        if int(os.environ.get("RANK", "0")) == 0:
            print(report(result), flush=True)
        status["code"] = 0 if result.ok else 1

    failed = run_tool(body)
    return failed or status["code"]


if __name__ == "__main__":
    sys.exit(main())
