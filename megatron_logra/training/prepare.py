"""What both stages start from: runtime, parallel groups, model, optimizer, loaded weights.

``prepare_training(cfg)`` brings up the runtime and megatron-core's groups, builds the
model and its optimizer (``training.build``), has the run's ``CheckpointManager`` load
what it starts from (a checkpoint to resume or finetune from, or HF weights) and writes
``config.json``. The SFT stage (``training.sft``) and the RL stage (``rl.stage``) run
from what it returns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megatron.core import parallel_state

from megatron_logra.checkpoint.manager import CheckpointManager
from megatron_logra.config import RunConfig
from megatron_logra.convert.hf_checkpoint import load_hf_weights
from megatron_logra.data.tokenizer import load_tokenizer
from megatron_logra.model.arch import load_arch
from megatron_logra.model.provider import ModelBuildConfig, transformer_engine_available
from megatron_logra.runtime import parallel
from megatron_logra.runtime.device import init_runtime
from megatron_logra.runtime.provenance import provenance
from megatron_logra.training.build import TrainingObjects, build_training_objects


@dataclass
class Prepared:
    """What every stage starts from: the built (and loaded) training objects, and the
    run's checkpoints (the scheduler registered; a stage registers its own resumable
    parts, which a resumed run restores as they register)."""

    objs: TrainingObjects
    tokenizer: object
    start_step: int
    checkpoints: CheckpointManager

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id


def layer_impl(cfg: RunConfig, announce: bool = False) -> str:
    """``--transformer-impl``, with auto resolved to local under predicted-KL control: its
    forward-mode tangent is carried through megatron-core's local linears only
    (``patches/forward_ad``), not Transformer Engine's (an explicit transformer_engine is
    refused by ``RunConfig``)."""
    impl = cfg.training.transformer_impl
    if impl == "auto" and cfg.training.stage == "rl" and cfg.rl.kl.control != "none":
        if announce and transformer_engine_available():
            print(f"--kl-control {cfg.rl.kl.control}: building megatron-core's local layer spec, not "
                  "Transformer Engine's (the KL tangent passes through local linears only)",
                  flush=True)
        return "local"
    return impl


def model_build_config(cfg: RunConfig, announce: bool = False) -> ModelBuildConfig:
    """How this run instantiates its model (precision, recompute, layer implementation)."""
    impl = layer_impl(cfg, announce=announce)
    return ModelBuildConfig(bf16=cfg.training.bf16,
                            recompute_activations=cfg.training.recompute_activations,
                            use_transformer_engine=None if impl == "auto"
                            else impl == "transformer_engine")


def prepare_training(cfg: RunConfig) -> Prepared:
    """Runtime + parallel groups, model + optimizer, then --load (HF weights, or a checkpoint
    to resume or to finetune from); writes config.json. Shared by the SFT and RL stages."""
    rt = init_runtime(cfg.training.distributed_timeout_minutes)
    parallel.initialize(cfg.parallel, rt.world_size, cfg.training.seed)
    is_logger = rt.rank == 0
    arch = load_arch(cfg.model.model_dir)
    arch.check_parallel(cfg.parallel.tensor_model_parallel_size,
                        cfg.parallel.pipeline_model_parallel_size)
    tokenizer = load_tokenizer(cfg.model.model_dir, cfg.model.tokenizer_model)
    objs = build_training_objects(arch, model_build_config(cfg, announce=is_logger),
                                  cfg.optimizer, seed=cfg.training.seed,
                                  train_iters=cfg.training.train_iters)
    checkpoints = CheckpointManager(cfg.checkpoint, objs, arch=arch, run_config=cfg.to_dict(),
                                    distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
                                    is_logger=is_logger)
    start_step = checkpoints.load(lambda folder: _load_hf(objs, arch, folder, is_logger))
    checkpoints.register("scheduler", objs.scheduler, required=True)
    out_dir = Path(cfg.output_dir)
    if is_logger:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(
            {"run": cfg.to_dict(), "arch": arch.to_dict(), "world_size": rt.world_size,
             "data_parallel_size": parallel_state.get_data_parallel_world_size(),
             "device": str(rt.device), "backend": rt.backend,
             "flags": cfg.flag_sources, "provenance": provenance()}, indent=1))
    return Prepared(objs, tokenizer, start_step, checkpoints)


def _load_hf(objs: TrainingObjects, arch, folder: str, is_logger: bool) -> None:
    """--load of an HF folder: its weights, each rank reading its own slices."""
    load_hf_weights(objs.model, arch, folder)
    objs.reload_main_params()
    if is_logger:
        print(f"loaded HF weights from {folder} (each rank read its own slices)", flush=True)
