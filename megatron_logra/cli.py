"""Command line -> ``RunConfig``: parse the flags, build the configs, check what needs files.

The flags are the config dataclasses' fields (``flags``): a new setting is one field in
its component's config. Flag names follow Megatron-LM where it has one. Each config
checks itself when built and ``RunConfig`` checks the rules across them (``config``);
here are only the checks that need the model's files or the world size's launch:
--model-dir, --tokenizer-model, --load, the architecture (TP/PP, LoGRA's qkv vs kv heads,
--seq-length) and the logging packages. ``parse_run_config(argv, world_size)`` is the
whole contract: it either returns a frozen config or raises ``ConfigError`` naming the
problem and the fix.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from megatron_logra.checkpoint.config import CheckpointConfig
from megatron_logra.config import (DataConfig, LoggingConfig, ModelSource, OptimizerConfig,
                                   RunConfig, TrainingConfig)
from megatron_logra.config_file import ConfigFileError, resolve
from megatron_logra.dry_run.config import DryRunConfig
from megatron_logra.flags import add_flags, from_flags
from megatron_logra.kl.config import KLControlConfig
from megatron_logra.logra.config import LograConfig
from megatron_logra.lora.config import LoraConfig
from megatron_logra.model.tiny_assets import EMBEDDED_DEFAULT
from megatron_logra.rl.config import PolicyObjective, RLConfig, StalenessConfig, VerifierConfig
from megatron_logra.rollout.config import EngineConfig
from megatron_logra.runtime.parallel import ParallelConfig
from megatron_logra.weight_sync.config import WeightSyncConfig
from megatron_logra.weight_sync.contract import needs

# (config class, help group title), in --help order; a class's flags are
# --{its FLAG_PREFIX}{field-name}
FLAG_GROUPS = (
    (ParallelConfig, "parallelism"),
    (ModelSource, "model"),
    (TrainingConfig, "training"),
    (OptimizerConfig, "optimizer"),
    (LograConfig, "LoGRA (--optimizer logra)"),
    (LoraConfig, "LoRA (--peft lora)"),
    (DataConfig, "data"),
    (RLConfig, "RL (--stage rl): rollouts, rewards, evaluation"),
    (PolicyObjective, "the policy loss (--stage rl)"),
    (VerifierConfig, "the verifier (--stage rl)"),
    (EngineConfig, "the rollout engines (--stage rl)"),
    (StalenessConfig, "generation beside training (--stage rl)"),
    (WeightSyncConfig, "weight sync to the rollout engine (--stage rl)"),
    (KLControlConfig, "predicted-KL step control (--stage rl)"),
    (CheckpointConfig, "checkpointing"),
    (RunConfig, "output"),
    (LoggingConfig, "logging: TensorBoard and Weights & Biases"),
    (DryRunConfig, "dry run: one update traced at full size on this CPU, no GPU"),
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
    for cls, title in FLAG_GROUPS:
        add_flags(p, cls, title)
    return p


def parse_tasks(spec: str) -> tuple[tuple[str, float], ...]:
    """--task: reasoning-gym names with weights, a preset, or 'math' (data.tasks checks them
    against its registry; ``RunConfig`` keeps math out of SFT)."""
    from megatron_logra.data.tasks import resolve_tasks

    try:
        return resolve_tasks(spec)
    except ValueError as e:
        raise ConfigError(f"--task: {e}") from None


def _load_source(args: argparse.Namespace) -> tuple[str, str, bool]:
    """(model_dir, load_format, weights_only) after checking --model-dir / --load /
    --tokenizer-model (the files)."""
    from megatron_logra.convert.hf_checkpoint import is_hf_folder

    load_format, weights_only = "megatron", args.finetune
    if args.load and is_hf_folder(args.load):
        load_format, weights_only = "hf", True
    elif args.load:
        from megatron_logra.checkpoint.layout import resolve_load_dir
        from megatron_logra.checkpoint.meta import read_meta

        try:
            weights_only = weights_only or read_meta(resolve_load_dir(args.load)).weights_only
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


def _configs(args: argparse.Namespace, sources: dict[str, str], world_size: int) -> RunConfig:
    """Every config from its flags (each checks itself), then the run's (the rules across
    them) and its split over ``world_size``; ValueError names the flag and the fix."""
    parallel = from_flags(ParallelConfig, args)
    dry_run = from_flags(DryRunConfig, args)
    if dry_run.enabled:  # one process tracing the ranks of the job it describes
        if world_size > 1:
            raise ConfigError(f"--dry-run runs in one process (it traces each rank of "
                              f"--dry-run-world-size in turn), not under torchrun with "
                              f"{world_size}: python launch/pretrain_rl.py --dry-run ...")
        world_size = dry_run.world(parallel.tensor_model_parallel_size,
                                   parallel.pipeline_model_parallel_size)
        if dry_run.ranks and max(dry_run.ranks) >= world_size:
            raise ConfigError(f"--dry-run-ranks: rank {max(dry_run.ranks)} is outside the "
                              f"world of {world_size} (--dry-run-world-size)")
    parallel.validate(world_size)  # first: a launch that does not match is said first
    rl = from_flags(RLConfig, args, objective=from_flags(PolicyObjective, args),
                    verifier=from_flags(VerifierConfig, args),
                    rollout=from_flags(EngineConfig, args),
                    staleness=from_flags(StalenessConfig, args),
                    weight_sync=from_flags(WeightSyncConfig, args),
                    kl=from_flags(KLControlConfig, args))
    training = from_flags(TrainingConfig, args)
    optimizer = from_flags(OptimizerConfig, args, lora=from_flags(LoraConfig, args),
                           logra=from_flags(LograConfig, args, keep_updates=(
                               training.stage == "rl"
                               and needs(rl.weight_sync.transport).keeps_logra_updates)))
    checkpoint = from_flags(CheckpointConfig, args)
    if training.stage == "rl":
        training = replace(training,
                           global_batch_size=rl.prompts_per_step * rl.responses_per_prompt)
    else:
        rl = RLConfig()
    if optimizer.name != "logra":
        optimizer = replace(optimizer, logra=LograConfig())
    if optimizer.peft != "lora":
        optimizer = replace(optimizer, lora=LoraConfig())
    model_dir, load_format, weights_only = _load_source(args)
    cfg = RunConfig(
        model=from_flags(ModelSource, args, model_dir=model_dir),
        output_dir=args.output_dir, parallel=parallel, optimizer=optimizer, training=training,
        data=from_flags(DataConfig, args, tasks=parse_tasks(args.tasks)),
        checkpoint=replace(checkpoint, load_format=load_format, finetune=weights_only),
        rl=rl, logging=_logging_config(args), dry_run=dry_run,
        flag_sources=_flag_sources(args, sources))
    cfg.check_world_size(world_size)
    return cfg


def _check_arch(cfg: RunConfig, load: str | None) -> None:
    """The rules that need the model's architecture (its config.json): TP/PP against heads
    and layers, LoGRA's qkv against kv heads, --seq-length, an HF --load's weights."""
    from megatron_logra.model.arch import UnsupportedModelError, load_arch

    parallel, model_dir = cfg.parallel, cfg.model.model_dir
    try:
        arch = load_arch(model_dir)
        arch.check_parallel(parallel.tensor_model_parallel_size,
                            parallel.pipeline_model_parallel_size)
    except (UnsupportedModelError, ValueError) as exc:
        raise ConfigError(f"--model-dir {model_dir}: {exc}") from None
    if cfg.checkpoint.load_format == "hf":
        _check_hf_load(load, arch)
    if cfg.training.seq_length > arch.max_position_embeddings:
        raise ConfigError(f"--seq-length {cfg.training.seq_length} exceeds the model's "
                          f"max_position_embeddings={arch.max_position_embeddings}; use at "
                          f"most that")
    if cfg.optimizer.name == "logra":
        try:
            cfg.optimizer.logra.check_fits(arch.num_kv_heads,
                                           parallel.tensor_model_parallel_size)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def parse_run_config(argv: list[str] | None = None, world_size: int | None = None) -> RunConfig:
    """Parse and validate; ``world_size`` defaults to torchrun's WORLD_SIZE (or 1)."""
    try:
        args, sources = resolve(build_parser, list(sys.argv[1:] if argv is None else argv))
    except ConfigFileError as exc:
        raise ConfigError(str(exc)) from None
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = _configs(args, sources, world_size)
    except ConfigError:
        raise
    except ValueError as exc:  # a config refused itself (flags.FlagError is one)
        raise ConfigError(str(exc)) from None
    _check_arch(cfg, args.load)
    return cfg


def _logging_config(args: argparse.Namespace) -> LoggingConfig:
    import importlib.util

    cfg = from_flags(LoggingConfig, args)
    for flag, wanted, module in (("--tensorboard-dir", cfg.tensorboard_dir, "tensorboard"),
                                 ("--wandb-project", cfg.wandb_project, "wandb")):
        if wanted and importlib.util.find_spec(module) is None:
            raise ConfigError(f"{flag} needs the {module} package, which is not installed: "
                              f"pip install {module} (requirements/lock.txt pins it)")
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
