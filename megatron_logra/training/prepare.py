"""What both stages start from: runtime, parallel groups, model, optimizer, loaded weights.

``prepare_training(cfg)`` brings up the runtime and megatron-core's groups, builds the
model and its optimizer (``training.build``), loads ``--load`` (HF weights, or a
checkpoint to resume or finetune from) and writes ``config.json``. The SFT stage
(``training.sft``) and the RL stage (``rl.stage``) run from what it returns.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from megatron.core import parallel_state

from megatron_logra.checkpoint.layout import resolve_load_dir
from megatron_logra.checkpoint.load import find_resume_checkpoint, load_checkpoint
from megatron_logra.checkpoint.meta import optimizer_sharding
from megatron_logra.checkpoint.state import ResumableState
from megatron_logra.config import RunConfig
from megatron_logra.convert.hf_checkpoint import load_hf_weights
from megatron_logra.data.tokenizer import load_tokenizer
from megatron_logra.model.arch import load_arch
from megatron_logra.model.provider import ModelBuildConfig, transformer_engine_available
from megatron_logra.runtime import parallel
from megatron_logra.runtime.device import init_runtime
from megatron_logra.training.build import TrainingObjects, build_training_objects


def _checkpoint_meta(cfg: RunConfig, arch) -> dict:
    """The ``CheckpointMeta`` fields of this run's checkpoints, less the step."""
    return {"arch": arch.to_dict(), "config": cfg.to_dict(),
            "optimizer_sharding": optimizer_sharding(cfg.optimizer.use_distributed_optimizer)}


@dataclass
class Prepared:
    """What every stage starts from: the built (and loaded) training objects, and the
    resumable state (the scheduler registered; a stage registers its own parts, which a
    resumed run restores as they register)."""

    objs: TrainingObjects
    tokenizer: object
    start_step: int
    resumable: ResumableState
    checkpoint_meta: dict

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id


def restarted_by_torchrun() -> bool:
    """torchrun --max-restarts: the workers of a restarted job see a count above 0."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def _resume_checkpoint(ck, is_logger: bool) -> Path | None:
    """The checkpoint to resume from under --auto-resume or a torchrun restart: the newest
    in --save that verifies (collective), or None (then --load as given)."""
    if not ck.save or not (ck.auto_resume or restarted_by_torchrun()):
        return None
    found, passed_over = find_resume_checkpoint(ck.save)
    if is_logger:
        for why in passed_over:
            print(f"auto-resume: passing over a damaged checkpoint: {why}", flush=True)
        if found is None:
            print(f"auto-resume: no complete checkpoint in {ck.save}; starting from "
                  f"{ck.load or 'the initial weights'}", flush=True)
    return found


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
    rt = init_runtime()
    parallel.initialize(cfg.parallel, rt.world_size, cfg.training.seed)
    is_logger = rt.rank == 0
    arch = load_arch(cfg.model.model_dir)
    arch.check_parallel(cfg.parallel.tensor_model_parallel_size,
                        cfg.parallel.pipeline_model_parallel_size)
    tokenizer = load_tokenizer(cfg.model.model_dir, cfg.model.tokenizer_model)
    objs = build_training_objects(arch, model_build_config(cfg, announce=is_logger),
                                  cfg.optimizer, seed=cfg.training.seed,
                                  train_iters=cfg.training.train_iters)
    start_step, resumed = _load(cfg, objs, arch, is_logger)
    resumable = ResumableState(resumed)
    resumable.register("scheduler", objs.scheduler, required=True)
    out_dir = Path(cfg.output_dir)
    if is_logger:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(
            {"run": cfg.to_dict(), "arch": arch.to_dict(), "world_size": rt.world_size,
             "data_parallel_size": parallel_state.get_data_parallel_world_size(),
             "device": str(rt.device), "backend": rt.backend,
             "flags": cfg.flag_sources}, indent=1))
    return Prepared(objs, tokenizer, start_step, resumable, _checkpoint_meta(cfg, arch))


def _load(cfg: RunConfig, objs: TrainingObjects, arch, is_logger: bool) -> tuple[int, dict]:
    """Resume (``--auto-resume``, a torchrun restart, or ``--load`` of a training checkpoint)
    or load weights (HF, or ``--finetune``) -> (the step to start from, the resumable
    parts' states; {} when not resuming)."""
    ck = cfg.checkpoint
    sharding = optimizer_sharding(cfg.optimizer.use_distributed_optimizer)
    resume = _resume_checkpoint(ck, is_logger)
    if resume is not None:
        resumed, meta = load_checkpoint(resume, objs, weights_only=False, sharding=sharding)
        if is_logger:
            print(f"resumed from {resume} at step {meta.step}", flush=True)
        return meta.step, resumed
    if ck.load and ck.load_format == "hf":
        load_hf_weights(objs.model, arch, ck.load)
        objs.reload_main_params()
        if is_logger:
            print(f"loaded HF weights from {ck.load} (each rank read its own slices)", flush=True)
        return 0, {}
    if ck.load:
        resumed, meta = load_checkpoint(ck.load, objs, weights_only=ck.finetune,
                                        sharding=sharding)
        start = 0 if ck.finetune else meta.step
        if is_logger:
            print(f"loaded {resolve_load_dir(ck.load)} "
                  f"({'weights only' if ck.finetune else f'resuming at step {start}'})",
                  flush=True)
        return start, resumed
    return 0, {}
