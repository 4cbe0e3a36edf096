"""Command line -> ``RunConfig``, with every check that can run before heavy work.

The flags are the config dataclasses' fields (``flags``): a new setting is one field in
its component's config. Flag names follow Megatron-LM where it has one.
``parse_run_config(argv, world_size)`` is the whole contract: it either returns a frozen
config or raises ``ConfigError`` naming the problem and the fix.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from megatron_logra.weight_sync.config import WeightSyncConfig
from megatron_logra.cli_rl import check_rl
from megatron_logra.config import (CheckpointConfig, DataConfig, LoggingConfig, ModelSource,
                                   OptimizerConfig, RunConfig, TrainingConfig)
from megatron_logra.config_file import ConfigFileError, resolve
from megatron_logra.flags import FlagError, add_flags, from_flags
from megatron_logra.kl.config import KLControlConfig
from megatron_logra.logra.config import LograConfig
from megatron_logra.lora.config import LoraConfig
from megatron_logra.model.tiny_assets import EMBEDDED_DEFAULT
from megatron_logra.rl.config import RLConfig
from megatron_logra.runtime.parallel import ParallelConfig

# (config class, flag prefix, help group title), in --help order
FLAG_GROUPS = (
    (ParallelConfig, "", "parallelism"),
    (ModelSource, "", "model"),
    (TrainingConfig, "", "training"),
    (OptimizerConfig, "", "optimizer"),
    (LograConfig, "logra-", "LoGRA (--optimizer logra)"),
    (LoraConfig, "lora-", "LoRA (--peft lora)"),
    (DataConfig, "", "data"),
    (RLConfig, "", "RL (--stage rl): rollouts, rewards, evaluation"),
    (WeightSyncConfig, "weight-sync-", "weight sync to the rollout engine (--stage rl)"),
    (KLControlConfig, "kl-", "predicted-KL step control (--stage rl)"),
    (CheckpointConfig, "", "checkpointing"),
    (RunConfig, "", "output"),
    (LoggingConfig, "", "logging: TensorBoard and Weights & Biases"),
)


class ConfigError(ValueError):
    """A bad command line: the message says what is wrong and how to fix it."""


def build_parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser
                 ) -> argparse.ArgumentParser:
    p = parser_class(
        prog="torchrun [--nproc-per-node N] launch/pretrain_rl.py",
        description="Megatron-core SFT / RL post-training with dense Adam or LoGRA.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", metavar="FILE.yaml", default=None,
                   help="Take flags from this YAML file (keys: flag names; 'defaults: "
                        "OTHER.yaml' builds on another file); flags given on the command "
                        "line override it. recipes/ holds the documented runs")
    for cls, prefix, title in FLAG_GROUPS:
        add_flags(p, cls, prefix, title)
    return p


def parse_tasks(spec: str, *, allow_math: bool = True) -> tuple[tuple[str, float], ...]:
    """--task: reasoning-gym names with weights, a preset, or 'math' (data.tasks checks them)."""
    from megatron_logra.data.tasks import MATH, resolve_tasks

    try:
        tasks = resolve_tasks(spec)
    except ValueError as e:
        raise ConfigError(f"--task: {e}") from None
    if not allow_math and any(name == MATH for name, _ in tasks):
        raise ConfigError(f"--task: {MATH!r} has no SFT targets here; SFT takes reasoning-gym "
                          "tasks (use it with --stage rl)")
    return tasks


def _load_source(args: argparse.Namespace) -> tuple[str, str, bool]:
    """(model_dir, load_format, weights_only) after checking --model-dir / --load / --finetune."""
    from megatron_logra.convert.hf_checkpoint import is_hf_folder

    load_format, weights_only = "megatron", args.finetune
    if args.finetune and not args.load:
        raise ConfigError("--finetune needs --load")
    if args.load and is_hf_folder(args.load):
        load_format, weights_only = "hf", True
    elif args.load:
        from megatron_logra.model.checkpoint_dir import read_meta, resolve_load_dir

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


def _check_optimizer(opt: OptimizerConfig, training: TrainingConfig) -> None:
    if opt.min_lr > opt.lr:
        raise ConfigError(f"need 0 <= --min-lr <= --lr, got --lr {opt.lr} --min-lr {opt.min_lr}")
    if not (0 <= opt.adam_beta1 < 1 and 0 <= opt.adam_beta2 < 1):
        raise ConfigError("--adam-beta1/--adam-beta2 must lie in [0, 1)")
    if opt.name == "logra":
        _check_logra(opt.logra, training)
    if opt.peft == "lora":
        _check_lora(opt)
    if training.transformer_impl == "transformer_engine" and (opt.name == "logra"
                                                               or opt.peft == "lora"):
        feature = "LoGRA's sketched" if opt.name == "logra" else "LoRA's adapted"
        raise ConfigError(f"--transformer-impl transformer_engine: {feature} linears are "
                          f"megatron-core's local Column/RowParallelLinear; use "
                          f"--transformer-impl local (or auto)")


def _check_lora(opt: OptimizerConfig) -> None:
    from megatron_logra.lora.layers import TARGETS

    if opt.name != "adam":
        raise ConfigError(f"--peft lora trains its adapters with Adam: use --optimizer adam "
                          f"(not {opt.name}); LoGRA and LoRA are alternatives")
    unknown = [t for t in opt.lora.targets if t not in TARGETS]
    if unknown or not opt.lora.targets:
        raise ConfigError(f"--lora-targets {','.join(opt.lora.targets)!r}: choose a comma list "
                          f"from {','.join(TARGETS)}")
    if opt.lora.dropout >= 1:
        raise ConfigError(f"--lora-dropout {opt.lora.dropout} must be in [0, 1)")


def _check_logra(lg: LograConfig, training: TrainingConfig) -> None:
    from megatron_logra.logra.sketched_linear import TARGETS

    unknown = [t for t in lg.targets if t not in TARGETS]
    if unknown or not lg.targets:
        raise ConfigError(f"--logra-targets {','.join(lg.targets)!r}: choose a comma list from "
                          f"{','.join(TARGETS)}")
    if lg.rank < 1:
        raise ConfigError(f"--logra-rank {lg.rank} must be >= 1 (the paper uses 256)")
    if lg.refresh_interval < 1:
        raise ConfigError(f"--logra-refresh-interval {lg.refresh_interval} must be >= 1")
    if not 0.0 <= lg.beta2 < 1.0:
        raise ConfigError(f"--logra-beta2 {lg.beta2} must be in [0, 1)")
    if lg.update_ratio is not None and lg.update_ratio < 0:
        raise ConfigError(f"--logra-update-ratio {lg.update_ratio} must be > 0 "
                          f"(the reference runs use 6e-5), or 0 to step by --lr")
    if lg.master_weights == "none" and not training.bf16:
        raise ConfigError("--logra-master-weights none keeps bf16 weights only: add --bf16 "
                          "(fp32 parameters are their own master)")
    if lg.master_weights == "none" and lg.update_factor_dtype != "bfloat16":
        raise ConfigError("--logra-master-weights none applies bf16 factors (the exact, "
                          "reproducible update a rollout engine repeats): drop "
                          "--logra-update-factor-dtype float32 or keep an fp32 master")


def check_logra_fits(lg: LograConfig, arch, parallel: ParallelConfig) -> None:
    """Refuse (``ConfigError``) LoGRA settings the layout cannot sketch: qkv needs TP <= the
    model's kv heads. ``memory.projection.cli_accepts`` asks it too."""
    tp = parallel.tensor_model_parallel_size
    if "qkv" in lg.targets and arch.num_kv_heads < tp:
        raise ConfigError(f"LoGRA cannot sketch linear_qkv when num_key_value_heads "
                          f"({arch.num_kv_heads}) < TP ({tp}): megatron replicates the kv heads "
                          f"over TP ranks; use --tensor-model-parallel-size <= "
                          f"{arch.num_kv_heads} or drop qkv from --logra-targets")


def _flags_to_configs(args: argparse.Namespace) -> dict:
    """Every component's config from its flags (single-flag checks included)."""
    try:
        rl = from_flags(RLConfig, args, sync=from_flags(WeightSyncConfig, args, "weight-sync-"),
                        kl=from_flags(KLControlConfig, args, "kl-"))
        training = from_flags(TrainingConfig, args)
        logra = from_flags(LograConfig, args, "logra-", keep_updates=(
            training.stage == "rl" and rl.sync.transport == "sketch-delta"))
        return dict(parallel=from_flags(ParallelConfig, args), training=training,
                    optimizer=from_flags(OptimizerConfig, args, logra=logra,
                                         lora=from_flags(LoraConfig, args, "lora-")), rl=rl,
                    checkpoint=from_flags(CheckpointConfig, args))
    except FlagError as exc:
        raise ConfigError(str(exc)) from None


def parse_run_config(argv: list[str] | None = None, world_size: int | None = None) -> RunConfig:
    """Parse and validate; ``world_size`` defaults to torchrun's WORLD_SIZE (or 1)."""
    try:
        args, sources = resolve(build_parser, list(sys.argv[1:] if argv is None else argv))
    except ConfigFileError as exc:
        raise ConfigError(str(exc)) from None
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    cfg = _flags_to_configs(args)
    parallel, training, optimizer, rl = (cfg[k] for k in ("parallel", "training", "optimizer",
                                                          "rl"))
    try:
        dp = parallel.data_parallel_size(world_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if training.stage == "rl":
        try:
            check_rl(rl, training, optimizer, dp)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if rl.kl.mode == "predicted" and optimizer.optimizer_cpu_offload:
            raise ConfigError("--kl-control predicted with --optimizer-cpu-offload: the "
                              "control scales the update on the GPU's master params, while "
                              "the offloaded optimizer keeps its own host copy, which would "
                              "stay unscaled; drop one of them (colocated runs fit the "
                              "engine without offload under LoGRA: "
                              "benchmarks/results/memory_plan.md)")
        if rl.kl.mode == "predicted" and training.transformer_impl == "transformer_engine":
            raise ConfigError("--kl-control predicted with --transformer-impl "
                              "transformer_engine: the KL tangent is carried through "
                              "megatron-core's local linears only; use --transformer-impl "
                              "local (or auto, which builds local under predicted-KL control)")
        training = replace(training,
                           global_batch_size=rl.prompts_per_step * rl.responses_per_prompt)
    else:
        rl = RLConfig()
    _check_optimizer(optimizer, training)
    if training.global_batch_size % (training.micro_batch_size * dp):
        mb = training.micro_batch_size
        raise ConfigError(
            f"--global-batch-size {training.global_batch_size} is not divisible by "
            f"--micro-batch-size {mb} x data-parallel size {dp} = {mb * dp}; "
            f"choose a global batch that is a multiple of {mb * dp}")
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
    if training.seq_length > arch.max_position_embeddings:
        raise ConfigError(f"--seq-length {training.seq_length} exceeds the model's "
                          f"max_position_embeddings={arch.max_position_embeddings}; use at most that")
    if optimizer.name == "logra":
        check_logra_fits(optimizer.logra, arch, parallel)
    else:
        optimizer = replace(optimizer, logra=LograConfig())
    if optimizer.peft != "lora":
        optimizer = replace(optimizer, lora=LoraConfig())
    return RunConfig(
        model=from_flags(ModelSource, args, model_dir=model_dir),
        output_dir=args.output_dir, parallel=parallel, optimizer=optimizer, training=training,
        data=from_flags(DataConfig, args, tasks=parse_tasks(
            args.tasks, allow_math=training.stage != "sft")),
        checkpoint=replace(cfg["checkpoint"], load_format=load_format, finetune=weights_only),
        rl=rl, logging=_logging_config(args), flag_sources=_flag_sources(args, sources))


def _logging_config(args: argparse.Namespace) -> LoggingConfig:
    import importlib.util

    cfg = from_flags(LoggingConfig, args)
    for flag, wanted, module in (("--tensorboard-dir", cfg.tensorboard_dir, "tensorboard"),
                                 ("--wandb-project", cfg.wandb_project, "wandb")):
        if wanted and importlib.util.find_spec(module) is None:
            raise ConfigError(f"{flag} needs the {module} package, which is not installed: "
                              f"pip install {module} (requirements/lock.txt pins it)")
    if (cfg.wandb_exp_name or cfg.wandb_save_dir) and not cfg.wandb_project:
        raise ConfigError("--wandb-exp-name / --wandb-save-dir need --wandb-project")
    return cfg


def _flag_sources(args: argparse.Namespace, sources: dict[str, str]) -> dict[str, dict]:
    """{flag: {"value", "source"}} for config.json."""
    names = {a.dest: a.option_strings[0] for a in build_parser()._actions if a.option_strings}
    out = {}
    for dest, source in sources.items():
        value = getattr(args, dest)
        if isinstance(value, tuple):
            value = list(value)
        elif not isinstance(value, (bool, int, float, str, type(None))):
            value = str(value)
        out[names[dest]] = {"value": value, "source": source}
    return out
