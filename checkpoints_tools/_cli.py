"""Shared plumbing of the checkpoint tools: their parser, dtype flag, error reporting."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

DTYPE_CHOICES = ("bf16", "fp32", "fp16")


def tool_parser(module: str, doc: str, launcher: str = "") -> argparse.ArgumentParser:
    """The parser of ``python -m checkpoints_tools.MODULE`` (``launcher`` before it, e.g.
    torchrun), described by the first paragraph of the tool's docstring ``doc``."""
    return argparse.ArgumentParser(prog=f"{launcher}python -m checkpoints_tools.{module}",
                                   description=doc.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def add_dtype_flag(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=default,
                        help="dtype of the written tensors")


def run_tool(body: Callable[[], None]) -> int:
    """Run ``body``; bad input (any ValueError/FileNotFoundError raised while validating or
    converting) becomes 'error: ...' on stderr and exit status 2, nothing half-written."""
    from megatron_logra.runtime.lazy_wandb import keep_out_of_megatron
    from megatron_logra.runtime.quiet import quiet_library_warnings

    quiet_library_warnings()
    keep_out_of_megatron()  # before megatron-core is first imported
    try:
        body()
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
