"""Model -> megatron DDP -> megatron optimizer -> LR scheduler (dense Adam or LoGRA).

LoGRA: the model is built with the sketched layer spec, the ``SketchSet`` takes the
sketched weights out of autograd *before* DDP is built (so DDP allocates no grad
buffer for them). The other parameters are frozen too by default (the paper's
reference: no grad buffers, no optimizer state; the embedding output is made
differentiable so the backward still runs), or trained by megatron's Adam
(``--logra-untargeted adam``), which ``LograOptimizer`` then wraps (with
``--use-distributed-optimizer`` it shards the sketched weights' row states and masters
over DP by whole rows). Megatron's ``finalize_model_grads`` is followed by the
sketches' TP/DP reduction and per-token scaling.

LoRA (``--peft lora``): the model is built with the LoRA layer spec, every base
parameter is frozen, and megatron's Adam (distributed optimizer included) trains the
adapters only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
from megatron.core.optimizer import MegatronOptimizer, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_logra.config import OptimizerConfig
from megatron_logra.logra.model_spec import SketchedLinears
from megatron_logra.logra.optimizer import LograOptimizer
from megatron_logra.logra.sketches import SketchSet, anchor_frozen_embeddings
from megatron_logra.lora.model_spec import LoraAdapters
from megatron_logra.model.arch import ModelArch
from megatron_logra.model.provider import (ModelBuildConfig, build_gpt_model,
                                          transformer_engine_available)
from megatron_logra.patches import apply_all as apply_megatron_patches
from megatron_logra.runtime.device import current_device
from megatron_logra.runtime.phase_times import PHASES
from megatron_logra.runtime.megatron_optimizer import reload_model_params


@dataclass
class TrainingObjects:
    """The live objects of one training run (mutable by nature)."""

    model: list[DistributedDataParallel]  # one chunk (no virtual pipeline)
    optimizer: MegatronOptimizer | LograOptimizer
    """What steps: megatron's optimizer (dense Adam; LoRA's adapters), or LoGRA's, which
    also steps megatron's optimizer over the unsketched params it trains."""
    scheduler: OptimizerParamScheduler
    arch: ModelArch

    @property
    def logra(self) -> LograOptimizer | None:
        """LoGRA's optimizer (None for dense Adam and LoRA)."""
        return self.optimizer if isinstance(self.optimizer, LograOptimizer) else None

    @property
    def dense_optimizer(self) -> MegatronOptimizer | None:
        """megatron's optimizer: every trained param (dense Adam, LoRA), or LoGRA's
        unsketched ones (None when LoGRA freezes them, the paper's setting)."""
        return self.optimizer.dense if self.logra is not None else self.optimizer

    def reload_main_params(self) -> None:
        """Refresh the optimizers' fp32 main copies (LoGRA's masters, megatron's main params)
        after the model weights changed underneath (a weights-only load)."""
        if self.logra is not None:
            self.logra.reload_masters()
        reload_model_params(self.dense_optimizer)

    def logra_stats(self) -> dict[str, float]:
        """LoGRA's figures of the last step, as metrics (``logra_*``; none without LoGRA)."""
        if self.logra is None:
            return {}
        return {f"logra_{k}": v for k, v in self.logra.last_stats.items() if k != "update"}


def wrap_ddp(model: torch.nn.Module, use_distributed_optimizer: bool) -> DistributedDataParallel:
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        average_in_collective=False,  # token-sum loss; finalize_model_grads divides by tokens
    )
    return DistributedDataParallel(model.config, ddp_config, module=model)


def build_optimizer(model: list[DistributedDataParallel], cfg: OptimizerConfig, bf16: bool):
    """megatron's Adam over every parameter that requires grad (all of them for dense Adam;
    the unsketched ones under LoGRA)."""
    return get_megatron_optimizer(megatron_optimizer_config(cfg, bf16), model)


def megatron_optimizer_config(cfg: OptimizerConfig, bf16: bool) -> McoreOptimizerConfig:
    """megatron-core's optimizer settings for ``cfg`` (``--optimizer-cpu-offload``: its
    HybridDeviceOptimizer, CUDA only: on CPU the state is in host memory already). What
    depends on this machine is checked here; ``cfg`` checked its own settings."""
    if cfg.optimizer_cpu_offload and current_device().type != "cuda":
        raise ValueError("--optimizer-cpu-offload moves Adam's state from the GPU to the "
                         "host; this run is on CPU, where it is there already: drop it")
    if cfg.optimizer_cpu_offload and not transformer_engine_available():
        raise ValueError("--optimizer-cpu-offload needs Transformer Engine (megatron-core "
                         "0.16's precision-aware optimizer, which its offload runs in, reads "
                         "TE's version): install the gpu extra (pip install -e '.[gpu]')")
    # Megatron-LM requires the precision-aware optimizer with CPU offload: the hybrid
    # CPU/GPU optimizer then keeps the fp32 master params itself (param_update_in_fp32)
    offload = dict(optimizer_cpu_offload=True,
                   optimizer_offload_fraction=cfg.optimizer_offload_fraction,
                   use_precision_aware_optimizer=True,
                   ) if cfg.optimizer_cpu_offload else {}
    return McoreOptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=cfg.use_distributed_optimizer, **offload)


def build_scheduler(optimizer, cfg: OptimizerConfig, train_iters: int) -> OptimizerParamScheduler:
    decay = cfg.lr_decay_iters or train_iters
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_iters, lr_decay_steps=max(decay, cfg.lr_warmup_iters + 1),
        lr_decay_style=cfg.lr_decay_style, start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
        wd_incr_steps=decay, wd_incr_style="constant",
        # on resume the schedule follows the command line; its step count the checkpoint
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)


def _finalize_with_sketches(sketches, model, num_tokens, **kwargs):
    finalize_model_grads(model, num_tokens, **kwargs)  # leaves num_tokens global, in place
    with PHASES("sketch_reduce"):
        sketches.reduce(num_tokens)


def build_training_objects(arch: ModelArch, build: ModelBuildConfig, opt: OptimizerConfig,
                           *, seed: int, train_iters: int) -> TrainingObjects:
    apply_megatron_patches()
    logra, lora = opt.name == "logra", opt.peft == "lora"
    if logra:
        build = replace(build, customization=SketchedLinears(opt.logra.targets),
                        use_transformer_engine=False)
    if lora:
        build = replace(build, customization=LoraAdapters(opt.lora),
                        use_transformer_engine=False)
    gpt = build_gpt_model(arch, build, seed)
    if lora:  # the base is frozen: DDP and Adam see the adapters only
        for name, param in gpt.named_parameters():
            param.requires_grad_(name.endswith((".lora_a", ".lora_b")))
    sketches = None
    frozen = logra and opt.logra.untargeted == "frozen"
    if logra:
        sketches = SketchSet([gpt], opt.logra, arch, seed=seed)
    if frozen:
        for param in gpt.parameters():
            param.requires_grad_(False)
        anchor_frozen_embeddings([gpt])
    ddp = wrap_ddp(gpt, opt.use_distributed_optimizer)
    optimizer = None if frozen else build_optimizer([ddp], opt, build.bf16)
    config = gpt.config
    config.finalize_model_grads_func = finalize_model_grads
    if logra:
        optimizer = LograOptimizer(optimizer, sketches, opt.logra, lr=opt.lr,
                                   shard_over_dp=opt.use_distributed_optimizer)
        config.finalize_model_grads_func = partial(_finalize_with_sketches, sketches)
    config.no_sync_func = ddp.no_sync
    config.grad_scale_func = optimizer.scale_loss
    scheduler = build_scheduler(optimizer, opt, train_iters)
    return TrainingObjects([ddp], optimizer, scheduler, arch)
