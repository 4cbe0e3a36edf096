"""HF safetensors folder -> megatron-core checkpoint that loads at any TP/PP/DP.

    python -m checkpoints_tools.hf_to_megatron --hf-dir HF_DIR --out CKPT [--dtype bf16|fp32]

Streams one layer tensor at a time; writes CKPT/iter_0000000 + CKPT/latest, which
``launch/pretrain_rl.py --load CKPT`` and ``checkpoints_tools.verify`` read.
"""

from __future__ import annotations

import argparse
import sys

from checkpoints_tools._cli import add_dtype_flag, run_tool, tool_parser


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser("hf_to_megatron", __doc__)
    p.add_argument("--hf-dir", required=True, help="HF model folder (config.json + safetensors)")
    p.add_argument("--out", required=True, help="checkpoint folder to create")
    add_dtype_flag(p, default="fp32")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> None:
        from megatron_logra.convert.pipeline import DTYPES, hf_to_megatron

        hf_to_megatron(args.hf_dir, args.out, dtype=DTYPES[args.dtype], overwrite=args.overwrite)

    return run_tool(body)


if __name__ == "__main__":
    sys.exit(main())
