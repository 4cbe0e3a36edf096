"""Entry point: ``torchrun [--nproc-per-node N] launch/pretrain_rl.py [flags]``.

It runs post-training (``--stage sft`` or ``--stage rl``), not pretraining: the name is
the one Megatron-LM users know (``pretrain_gpt.py``) and stays for them.

Parse the flags into a frozen RunConfig (failing fast on bad input), then run
the requested stage. One process: ``python launch/pretrain_rl.py`` works too.

    # SFT warm start of the embedded tiny model at TP=2 on CPU
    torchrun --standalone --nproc-per-node 2 launch/pretrain_rl.py \
        --stage sft --tensor-model-parallel-size 2 --task basic_arithmetic \
        --train-iters 20 --output-dir runs/sft

    # will the paper's 27B recipe fit its 8 GPUs? One update traced at full size, on CPU
    python launch/pretrain_rl.py --config recipes/paper/logra-27b.yaml \
        --model-dir megatron_logra/assets/qwen3-27b --dry-run --output-dir runs/dry-27b
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from megatron_logra.runtime.lazy_wandb import keep_out_of_megatron
    from megatron_logra.runtime.quiet import quiet_library_warnings

    quiet_library_warnings()
    keep_out_of_megatron()  # before megatron-core is first imported
    from megatron_logra.cli import ConfigError, parse_run_config

    try:
        cfg = parse_run_config(argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.dry_run.enabled:  # one update traced at full size, for every rank, on this CPU
        from megatron_logra.dry_run.run import run_dry_run

        return run_dry_run(cfg)
    if cfg.training.stage == "rl":
        from megatron_logra.rl.stage import run_rl

        run_rl(cfg)
    else:
        from megatron_logra.training.sft import run_sft

        run_sft(cfg)
    return 0


if __name__ == "__main__":  # the guard dist_checkpointing's async writer needs
    sys.exit(main())
