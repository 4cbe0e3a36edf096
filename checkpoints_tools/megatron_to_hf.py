"""megatron-core checkpoint (converted or trained, any layout) -> complete HF folder.

    python -m checkpoints_tools.megatron_to_hf --ckpt CKPT --out HF_OUT --hf-config-from HF_DIR \
        [--dtype bf16|fp32] [--max-shard-size-mb 2048] [--adapter-out ADAPTER_DIR]

HF_OUT gets sharded safetensors + index (with metadata), config.json with the
written dtype, and HF_DIR's generation config, tokenizer files and chat template.
A checkpoint trained with --peft lora is exported merged (W + alpha / r B A); with
--adapter-out its adapter is also written in PEFT's format (adapter_config.json +
adapter_model.safetensors, for peft.PeftModel.from_pretrained on the base model).
"""

from __future__ import annotations

import argparse
import sys

from checkpoints_tools._cli import add_dtype_flag, run_tool, tool_parser


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser("megatron_to_hf", __doc__)
    p.add_argument("--ckpt", required=True,
                   help="checkpoint folder (follows its 'latest') or one iter_* folder")
    p.add_argument("--out", required=True, help="HF folder to create")
    p.add_argument("--hf-config-from", required=True,
                   help="HF folder whose config.json, tokenizer and generation config to use")
    add_dtype_flag(p, default="bf16")
    p.add_argument("--max-shard-size-mb", type=int, default=2048, help="safetensors shard size")
    p.add_argument("--adapter-out", default=None,
                   help="LoRA checkpoints: also write the adapter here in PEFT's format")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> None:
        from megatron_logra.convert.pipeline import DTYPES, megatron_to_hf

        if args.max_shard_size_mb < 1:
            raise ValueError("--max-shard-size-mb must be >= 1")
        megatron_to_hf(args.ckpt, args.out, hf_config_from=args.hf_config_from,
                       dtype=DTYPES[args.dtype], overwrite=args.overwrite,
                       max_shard_bytes=args.max_shard_size_mb * 1024 * 1024,
                       adapter_out=args.adapter_out)

    return run_tool(body)


if __name__ == "__main__":
    sys.exit(main())
