"""Model -> megatron DDP -> megatron optimizer -> LR scheduler, for dense Adam."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_logra.config import OptimizerConfig
from megatron_logra.model.arch import ModelArch
from megatron_logra.model.provider import ModelBuildConfig, build_gpt_model
from megatron_logra.patches import apply_all as apply_megatron_patches


@dataclass
class TrainingObjects:
    """The live objects of one training run (mutable by nature)."""

    model: list[DistributedDataParallel]  # one chunk (no virtual pipeline)
    optimizer: object  # megatron MegatronOptimizer
    scheduler: OptimizerParamScheduler
    arch: ModelArch


def wrap_ddp(model: torch.nn.Module, use_distributed_optimizer: bool) -> DistributedDataParallel:
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        average_in_collective=False,  # token-sum loss; finalize_model_grads divides by tokens
    )
    return DistributedDataParallel(model.config, ddp_config, module=model)


def build_optimizer(model: list[DistributedDataParallel], cfg: OptimizerConfig, bf16: bool):
    if cfg.name != "adam":
        raise ValueError(f"optimizer {cfg.name!r} is not built here")
    mcfg = McoreOptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=cfg.use_distributed_optimizer)
    return get_megatron_optimizer(mcfg, model)


def build_scheduler(optimizer, cfg: OptimizerConfig, train_iters: int) -> OptimizerParamScheduler:
    decay = cfg.lr_decay_iters or train_iters
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_iters, lr_decay_steps=max(decay, cfg.lr_warmup_iters + 1),
        lr_decay_style=cfg.lr_decay_style, start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
        wd_incr_steps=decay, wd_incr_style="constant",
        # on resume the schedule follows the command line; its step count the checkpoint
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)


def build_training_objects(arch: ModelArch, build: ModelBuildConfig, opt: OptimizerConfig,
                           *, seed: int, train_iters: int) -> TrainingObjects:
    apply_megatron_patches()
    gpt = build_gpt_model(arch, build, seed)
    ddp = wrap_ddp(gpt, opt.use_distributed_optimizer)
    optimizer = build_optimizer([ddp], opt, build.bf16)
    config = gpt.config
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    config.grad_scale_func = optimizer.scale_loss
    scheduler = build_scheduler(optimizer, opt, train_iters)
    return TrainingObjects([ddp], optimizer, scheduler, arch)
