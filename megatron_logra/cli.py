"""Command line -> ``RunConfig``, with every check that can run before heavy work.

Flag names follow Megatron-LM where it has one. ``parse_run_config(argv,
world_size)`` is the whole contract: it either returns a frozen config or raises
``ConfigError`` naming the problem and the fix.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from megatron_logra.config import (
    CheckpointConfig,
    DataConfig,
    LograConfig,
    ModelSource,
    OptimizerConfig,
    RLConfig,
    RunConfig,
    TrainingConfig,
)
from megatron_logra.cli_rl import add_rl_arguments, rl_config
from megatron_logra.model.tiny_assets import EMBEDDED_DEFAULT
from megatron_logra.runtime.parallel import ParallelConfig


class ConfigError(ValueError):
    """A bad command line: the message says what is wrong and how to fix it."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchrun [--nproc-per-node N] launch/pretrain_rl.py",
        description="Megatron-core SFT / RL post-training with dense Adam or LoGRA.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP degree")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP degree")
    g = p.add_argument_group("model")
    g.add_argument("--model-dir", default=None,
                   help="HF model folder (config.json + tokenizer); default: the --load HF folder "
                        "if there is one, else the embedded tiny Llama")
    g.add_argument("--tokenizer-model", default=None,
                   help="sentencepiece tokenizer.model overriding the folder's tokenizer")
    g = p.add_argument_group("training")
    g.add_argument("--stage", choices=("sft", "rl"), default="sft", help="what to train")
    g.add_argument("--micro-batch-size", type=int, default=1, help="sequences per microbatch")
    g.add_argument("--global-batch-size", type=int, default=8, help="sequences per update")
    g.add_argument("--seq-length", type=int, default=256, help="tokens per sequence (padded)")
    g.add_argument("--train-iters", type=int, default=10, help="number of updates")
    g.add_argument("--seed", type=int, default=1234, help="init, data and sampling seed")
    g.add_argument("--bf16", action="store_true", help="bf16 parameters (fp32 main grads)")
    g.add_argument("--recompute-activations", action="store_true",
                   help="full activation recompute, one layer at a time")
    g.add_argument("--log-interval", type=int, default=1, help="updates between progress lines")
    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=("adam", "logra"), default="adam", help="update rule")
    g.add_argument("--lr", type=float, default=1e-4, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0, help="final learning rate of the decay")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warm-up updates")
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"),
                   default="cosine", help="decay after warm-up")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="updates over which to decay (default: --train-iters)")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1")
    g.add_argument("--adam-beta2", type=float, default=0.95, help="Adam beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon")
    g.add_argument("--weight-decay", type=float, default=0.0, help="decoupled weight decay")
    g.add_argument("--clip-grad", type=float, default=1.0,
                   help="global grad-norm clip; 0 disables clipping (it never zeroes grads)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard optimizer state and fp32 master weights over data parallel")
    g = p.add_argument_group("LoGRA (--optimizer logra)")
    g.add_argument("--logra-rank", type=int, default=256, help="sketch rank r per weight")
    g.add_argument("--logra-projection", choices=("rademacher", "gaussian"),
                   default="rademacher", help="entries of the random projection A")
    g.add_argument("--logra-refresh-interval", type=int, default=1,
                   help="draw new projections every N updates")
    g.add_argument("--logra-targets", default="qkv,proj,fc1,fc2",
                   help="comma list of sketched weights: qkv, proj, fc1, fc2, embedding, output "
                        "(a tied embedding/output matrix is sketched for both uses)")
    g.add_argument("--logra-beta2", type=float, default=0.95, help="RowAdam second-moment decay")
    g.add_argument("--logra-eps", type=float, default=1e-8,
                   help="RowAdam epsilon, relative to the layer's mean row scale")
    g.add_argument("--logra-update-ratio", type=float, default=LograConfig.update_ratio,
                   help="norm-ratio step: ||c D A|| = ratio * ||W|| over all sketched weights, "
                        "as the paper; 0: the step is --lr instead (for plain RowAdam, "
                        "--no-logra-norm-restoration)")
    g.add_argument("--logra-master-weights", choices=("fp32", "none"), default="fp32",
                   help="with --bf16: keep an fp32 master of sketched weights, or none "
                        "(bf16 only, deterministic stochastic rounding)")
    g.add_argument("--logra-norm-restoration", action=argparse.BooleanOptionalAction,
                   default=LograConfig.norm_restoration,
                   help="rescale each HF module's (q, k, v, o, gate, up, down) RowAdam direction "
                        "to its sketch's norm, as the paper's reference does; --no-... gives "
                        "plain RowAdam")
    g.add_argument("--logra-untargeted", choices=("frozen", "adam"),
                   default=LograConfig.untargeted,
                   help="parameters that are not sketched (norms, biases, unsketched embedding "
                        "and output layer): frozen, as the paper (no optimizer state, no "
                        "gradient buffers), or trained by Adam at --lr")
    g.add_argument("--logra-update-factor-dtype", choices=("bfloat16", "float32"),
                   default=LograConfig.update_factor_dtype,
                   help="round the final factor alpha c D to this dtype before applying it "
                        "(the reference rounds to bfloat16)")
    g = p.add_argument_group("data")
    g.add_argument("--task", default="basic_arithmetic",
                   help="reasoning-gym tasks with optional weights: NAME[:WEIGHT],...")
    g.add_argument("--dataset-size", type=int, default=2000, help="items generated per run")
    g.add_argument("--data-seed", type=int, default=None, help="task seed (default: --seed)")
    add_rl_arguments(p)
    g = p.add_argument_group("checkpointing and output")
    g.add_argument("--output-dir", default="runs/latest", help="config.json + metrics.jsonl")
    g.add_argument("--save", default=None, help="checkpoint directory")
    g.add_argument("--save-interval", type=int, default=0,
                   help="updates between checkpoints (0: only at the end)")
    g.add_argument("--load", default=None,
                   help="checkpoint directory (or one iter_* folder in it) to resume from, or an "
                        "HF model folder / converted checkpoint to start from (weights only)")
    g.add_argument("--finetune", action="store_true",
                   help="with --load: take the weights only (fresh optimizer, step 0)")
    return p


def parse_tasks(spec: str, *, allow_math: bool = True) -> tuple[tuple[str, float], ...]:
    """--task: reasoning-gym names with weights, a preset, or 'math' (rl.verifiers checks them)."""
    from megatron_logra.rl.verifiers import MATH, resolve_tasks

    try:
        tasks = resolve_tasks(spec)
    except ValueError as e:
        raise ConfigError(f"--task: {e}") from None
    if not allow_math and any(name == MATH for name, _ in tasks):
        raise ConfigError(f"--task: {MATH!r} has no SFT targets here; SFT takes reasoning-gym "
                          "tasks (use it with --stage rl)")
    return tasks


def _check_positive(args: argparse.Namespace) -> None:
    for flag in ("micro_batch_size", "global_batch_size", "seq_length", "train_iters",
                 "log_interval", "dataset_size"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.save_interval < 0:
        raise ConfigError("--save-interval must be >= 0")
    if args.lr < 0 or args.min_lr < 0 or args.min_lr > args.lr:
        raise ConfigError(f"need 0 <= --min-lr <= --lr, got --lr {args.lr} --min-lr {args.min_lr}")
    if args.clip_grad < 0:
        raise ConfigError("--clip-grad must be >= 0 (0 disables clipping)")
    if not (0 <= args.adam_beta1 < 1 and 0 <= args.adam_beta2 < 1):
        raise ConfigError("--adam-beta1/--adam-beta2 must lie in [0, 1)")


def _load_source(args: argparse.Namespace) -> tuple[str, str, bool]:
    """(model_dir, load_format, weights_only) after checking --model-dir / --load / --finetune."""
    from megatron_logra.convert.hf_checkpoint import is_hf_folder

    load_format, weights_only = "megatron", args.finetune
    if args.finetune and not args.load:
        raise ConfigError("--finetune needs --load")
    if args.load and is_hf_folder(args.load):
        load_format, weights_only = "hf", True
    elif args.load:
        from megatron_logra.training.checkpointing import read_meta, resolve_load_dir

        try:
            weights_only = weights_only or bool(read_meta(resolve_load_dir(args.load)).get(
                "weights_only"))
        except (FileNotFoundError, ValueError) as exc:
            raise ConfigError(f"--load: {exc}") from None
    model_dir = args.model_dir or (args.load if load_format == "hf" else str(EMBEDDED_DEFAULT))
    if not (Path(model_dir) / "config.json").is_file():
        raise ConfigError(f"--model-dir {model_dir}: no config.json there; name an HF model folder")
    if args.tokenizer_model and not Path(args.tokenizer_model).is_file():
        raise ConfigError(f"--tokenizer-model {args.tokenizer_model}: file not found")
    return model_dir, load_format, weights_only


def _check_hf_load(load: str, arch) -> None:
    """Open the HF folder's headers now, so bad weights fail before any process starts work."""
    from megatron_logra.convert.hf_checkpoint import HFCheckpoint
    from megatron_logra.model.arch import load_arch

    if load_arch(load) != arch:
        raise ConfigError(f"--load {load} holds another model than --model-dir describes; drop "
                          f"--model-dir or make it the same model")
    try:
        HFCheckpoint(load, arch)
    except ValueError as exc:
        raise ConfigError(f"--load: {exc}") from None


def _logra_config(args, arch, parallel) -> LograConfig:
    from megatron_logra.logra.sketched_linear import TARGETS

    targets = tuple(t.strip() for t in args.logra_targets.split(",") if t.strip())
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise ConfigError(f"--logra-targets {args.logra_targets!r}: choose a comma list from "
                          f"{','.join(TARGETS)}")
    if args.logra_rank < 1:
        raise ConfigError(f"--logra-rank {args.logra_rank} must be >= 1 (the paper uses 256)")
    if args.logra_refresh_interval < 1:
        raise ConfigError(f"--logra-refresh-interval {args.logra_refresh_interval} must be >= 1")
    if not 0.0 <= args.logra_beta2 < 1.0:
        raise ConfigError(f"--logra-beta2 {args.logra_beta2} must be in [0, 1)")
    if args.logra_eps < 0:
        raise ConfigError(f"--logra-eps {args.logra_eps} must be >= 0")
    if args.logra_update_ratio < 0:
        raise ConfigError(f"--logra-update-ratio {args.logra_update_ratio} must be > 0 "
                          f"(the reference runs use 6e-5), or 0 to step by --lr")
    if args.logra_master_weights == "none" and not args.bf16:
        raise ConfigError("--logra-master-weights none keeps bf16 weights only: add --bf16 "
                          "(fp32 parameters are their own master)")
    if args.logra_master_weights == "none" and args.logra_update_factor_dtype != "bfloat16":
        raise ConfigError("--logra-master-weights none applies bf16 factors (the exact, "
                          "reproducible update a rollout engine repeats): drop "
                          "--logra-update-factor-dtype float32 or keep an fp32 master")
    tp = parallel.tensor_model_parallel_size
    if "qkv" in targets and arch.num_kv_heads < tp:
        raise ConfigError(f"LoGRA cannot sketch linear_qkv when num_key_value_heads "
                          f"({arch.num_kv_heads}) < TP ({tp}): megatron replicates the kv heads "
                          f"over TP ranks; use --tensor-model-parallel-size <= "
                          f"{arch.num_kv_heads} or drop qkv from --logra-targets")
    return LograConfig(rank=args.logra_rank, projection=args.logra_projection,
                       refresh_interval=args.logra_refresh_interval, targets=targets,
                       beta2=args.logra_beta2, eps=args.logra_eps,
                       update_ratio=args.logra_update_ratio or None,
                       master_weights=args.logra_master_weights,
                       norm_restoration=args.logra_norm_restoration,
                       untargeted=args.logra_untargeted,
                       update_factor_dtype=args.logra_update_factor_dtype)


def parse_run_config(argv: list[str] | None = None, world_size: int | None = None) -> RunConfig:
    """Parse and validate; ``world_size`` defaults to torchrun's WORLD_SIZE (or 1)."""
    args = build_parser().parse_args(argv)
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    _check_positive(args)
    parallel = ParallelConfig(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    try:
        dp = parallel.data_parallel_size(world_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    rl = RLConfig()
    if args.stage == "rl":
        try:
            rl = rl_config(args, dp)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        args.global_batch_size = rl.prompts_per_step * rl.responses_per_prompt
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ConfigError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {dp} = {args.micro_batch_size * dp}; "
            f"choose a global batch that is a multiple of {args.micro_batch_size * dp}")
    model_dir, load_format, weights_only = _load_source(args)
    from megatron_logra.model.arch import UnsupportedModelError, load_arch

    try:
        arch = load_arch(model_dir)
        arch.check_parallel(parallel.tensor_model_parallel_size,
                            parallel.pipeline_model_parallel_size)
    except (UnsupportedModelError, ValueError) as exc:
        raise ConfigError(f"--model-dir {model_dir}: {exc}") from None
    if load_format == "hf":
        _check_hf_load(args.load, arch)
    if args.seq_length > arch.max_position_embeddings:
        raise ConfigError(f"--seq-length {args.seq_length} exceeds the model's "
                          f"max_position_embeddings={arch.max_position_embeddings}; use at most that")
    logra = _logra_config(args, arch, parallel) if args.optimizer == "logra" else LograConfig()
    return RunConfig(
        model=ModelSource(model_dir, args.tokenizer_model),
        output_dir=args.output_dir,
        parallel=parallel,
        optimizer=OptimizerConfig(
            name=args.optimizer, lr=args.lr, min_lr=args.min_lr,
            lr_warmup_iters=args.lr_warmup_iters, lr_decay_style=args.lr_decay_style,
            lr_decay_iters=args.lr_decay_iters, adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, weight_decay=args.weight_decay,
            clip_grad=args.clip_grad, use_distributed_optimizer=args.use_distributed_optimizer,
            logra=logra),
        training=TrainingConfig(
            stage=args.stage, micro_batch_size=args.micro_batch_size,
            global_batch_size=args.global_batch_size, seq_length=args.seq_length,
            train_iters=args.train_iters, seed=args.seed, bf16=args.bf16,
            recompute_activations=args.recompute_activations, log_interval=args.log_interval),
        data=DataConfig(tasks=parse_tasks(args.task, allow_math=args.stage != "sft"),
                        dataset_size=args.dataset_size,
                        data_seed=args.data_seed),
        checkpoint=CheckpointConfig(save=args.save, save_interval=args.save_interval,
                                    load=args.load, load_format=load_format,
                                    finetune=weights_only),
        rl=rl,
    )
