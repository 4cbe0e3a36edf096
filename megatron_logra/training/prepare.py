"""The supervised (``--stage sft``) training run: build -> (load) -> train -> save.

``run_sft(cfg)`` is what ``launch/pretrain_rl.py --stage sft`` executes; tests
call it in-process to run several layouts in one torchrun launch.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist
from megatron.core import parallel_state

from megatron_logra.config import RunConfig
from megatron_logra.convert.hf_checkpoint import load_hf_weights
from megatron_logra.data.sft import SFTBatches, encode_sft
from megatron_logra.data.tasks import generate_items
from megatron_logra.data.tokenizer import load_tokenizer
from megatron_logra.model.arch import load_arch
from megatron_logra.model.provider import ModelBuildConfig
from megatron_logra.runtime import parallel
from megatron_logra.runtime.device import init_runtime, peak_memory_bytes, synchronize
from megatron_logra.training import checkpointing
from megatron_logra.training.metrics import MetricsLog
from megatron_logra.training.setup import TrainingObjects, build_training_objects
from megatron_logra.training.step import train_step


@dataclass
class RunResult:
    records: list[dict] = field(default_factory=list)
    objects: TrainingObjects | None = None
    last_checkpoint: Path | None = None


def build_sft_batches(cfg: RunConfig, tokenizer) -> SFTBatches:
    data_seed = cfg.data.data_seed if cfg.data.data_seed is not None else cfg.training.seed
    items = generate_items(cfg.data.tasks, cfg.data.dataset_size, data_seed)
    samples = [encode_sft(tokenizer, item) for item in items]
    return SFTBatches(samples, global_batch_size=cfg.training.global_batch_size,
                      micro_batch_size=cfg.training.micro_batch_size,
                      seq_length=cfg.training.seq_length, pad_id=tokenizer.pad_token_id,
                      seed=data_seed)


def _checkpoint_meta(cfg: RunConfig, arch) -> dict:
    return {"arch": arch.to_dict(), "config": cfg.to_dict(),
            "optimizer_sharding": checkpointing.optimizer_sharding(
                cfg.optimizer.use_distributed_optimizer)}


@dataclass
class Prepared:
    """What every stage starts from: the built (and loaded) training objects."""

    objs: TrainingObjects
    tokenizer: object
    start_step: int
    extra_state: dict | None  # the checkpoint's extra state when resuming
    checkpoint_meta: dict

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id


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
    build = ModelBuildConfig(bf16=cfg.training.bf16,
                             recompute_activations=cfg.training.recompute_activations)
    objs = build_training_objects(arch, build, cfg.optimizer, seed=cfg.training.seed,
                                  train_iters=cfg.training.train_iters)
    start_step, extra = 0, None
    ck = cfg.checkpoint
    if ck.load and ck.load_format == "hf":
        load_hf_weights(objs.model, arch, ck.load)
        checkpointing.reload_main_params(objs.optimizer)
        if is_logger:
            print(f"loaded HF weights from {ck.load} (each rank read its own slices)", flush=True)
    elif ck.load:
        extra, meta = checkpointing.load_checkpoint(
            ck.load, objs, weights_only=ck.finetune,
            sharding=checkpointing.optimizer_sharding(cfg.optimizer.use_distributed_optimizer))
        if not ck.finetune:
            start_step = int(meta["step"])
            objs.scheduler.load_state_dict(extra["scheduler"])
        else:
            extra = None
        if is_logger:
            print(f"loaded {checkpointing.resolve_load_dir(ck.load)} "
                  f"({'weights only' if ck.finetune else f'resuming at step {start_step}'})",
                  flush=True)
    out_dir = Path(cfg.output_dir)
    if is_logger:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(
            {"run": cfg.to_dict(), "arch": arch.to_dict(), "world_size": rt.world_size,
             "data_parallel_size": parallel_state.get_data_parallel_world_size(),
             "device": str(rt.device), "backend": rt.backend}, indent=1))
    return Prepared(objs, tokenizer, start_step, extra, _checkpoint_meta(cfg, arch))


def run_sft(cfg: RunConfig) -> RunResult:
    prep = prepare_training(cfg)
    objs, tokenizer, start_step, ck = prep.objs, prep.tokenizer, prep.start_step, cfg.checkpoint
    is_logger = dist.get_rank() == 0
    out_dir = Path(cfg.output_dir)
    batches = build_sft_batches(cfg, tokenizer)
    log = MetricsLog(out_dir, enabled=is_logger, resume=start_step > 0)
    result = RunResult(objects=objs)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    t = cfg.training
    for step in range(start_step, t.train_iters):
        t0 = time.perf_counter()
        out = train_step(objs, batches.microbatches(step, dp_rank, dp_size),
                         seq_length=t.seq_length, micro_batch_size=t.micro_batch_size)
        synchronize()
        record = {"step": step + 1, "loss": out.loss, "lr": out.lr, "grad_norm": out.grad_norm,
                  "tokens": out.tokens, "step_time_s": time.perf_counter() - t0,
                  "peak_mem_bytes": peak_memory_bytes(),
                  "update_successful": out.update_successful}
        logra_stats = getattr(objs.optimizer, "last_stats", None)
        if logra_stats:
            record.update({f"logra_{k}": v for k, v in logra_stats.items() if k != "update"})
        result.records.append(record)
        log.write(record)
        if (step + 1) % t.log_interval == 0 or step + 1 == t.train_iters:
            log.progress(record, t.train_iters)
        last = step + 1 == t.train_iters
        if ck.save and ((ck.save_interval and (step + 1) % ck.save_interval == 0) or last):
            result.last_checkpoint = checkpointing.save_checkpoint(
                ck.save, step + 1, objs, {"scheduler": objs.scheduler.state_dict()},
                prep.checkpoint_meta)
            if is_logger:
                print(f"saved checkpoint {result.last_checkpoint}", flush=True)
    if is_logger:
        print(f"metrics: {log.path.resolve()}", flush=True)
    if dist.is_initialized():
        dist.barrier()
    return result
