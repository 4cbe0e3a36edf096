"""The supervised stage (``--stage sft``): prepare -> train -> save.

``run_sft(cfg)`` is what ``launch/pretrain_rl.py --stage sft`` executes; tests call it
in-process to run several layouts in one torchrun launch.
"""

from __future__ import annotations

import time

import torch.distributed as dist
from megatron.core import parallel_state

from megatron_logra.config import RunConfig
from megatron_logra.data.sft import SFTBatches, encode_sft
from megatron_logra.data.tasks import generate_items
from megatron_logra.data.tokenizer import load_tokenizer
from megatron_logra.runtime.device import init_runtime, peak_memory_bytes, synchronize
from megatron_logra.training import checkpointing
from megatron_logra.training.log_sinks import open_metrics_log
from megatron_logra.training.metrics import MetricsLog
from megatron_logra.training.prepare import RunResult, prepare_training
from megatron_logra.training.step import SkippedUpdates, train_step


def build_sft_batches(cfg: RunConfig, tokenizer) -> SFTBatches:
    data_seed = cfg.data.data_seed if cfg.data.data_seed is not None else cfg.training.seed
    items = generate_items(cfg.data.tasks, cfg.data.dataset_size, data_seed)
    samples = [encode_sft(tokenizer, item) for item in items]
    batches = SFTBatches(samples, global_batch_size=cfg.training.global_batch_size,
                         micro_batch_size=cfg.training.micro_batch_size,
                         seq_length=cfg.training.seq_length, pad_id=tokenizer.pad_token_id,
                         seed=data_seed)
    if batches.dropped and dist.get_rank() == 0:
        print(f"SFT: {batches.dropped} of {len(samples)} samples keep no answer token within "
              f"--seq-length {cfg.training.seq_length} and are left out", flush=True)
    return batches


def run_sft(cfg: RunConfig) -> RunResult:
    init_runtime()
    # the data first: a setting that leaves nothing to train on fails before the model is built
    batches = build_sft_batches(cfg, load_tokenizer(cfg.model.model_dir,
                                                    cfg.model.tokenizer_model))
    prep = prepare_training(cfg)
    with open_metrics_log(cfg, dist.get_rank() == 0, prep.start_step) as log:
        return _train(cfg, prep, batches, log)


def _train(cfg: RunConfig, prep, batches: SFTBatches, log: MetricsLog) -> RunResult:
    objs, start_step, ck = prep.objs, prep.start_step, cfg.checkpoint
    is_logger = dist.get_rank() == 0
    skipped = SkippedUpdates(cfg.training.max_skipped_updates)
    result = RunResult(objects=objs)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    t = cfg.training
    for step in range(start_step, t.train_iters):
        t0 = time.perf_counter()
        out = train_step(objs, batches.microbatches(step, dp_rank, dp_size),
                         seq_length=batches.step_length(step),
                         micro_batch_size=t.micro_batch_size, update=step + 1)
        synchronize()
        skipped.record(out.update_successful, step + 1, announce=is_logger)
        record = {"step": step + 1, "loss": out.loss, "lr": out.lr, "grad_norm": out.grad_norm,
                  "tokens": out.tokens, "step_time_s": time.perf_counter() - t0,
                  "peak_mem_bytes": peak_memory_bytes(),
                  "update_successful": out.update_successful}
        record.update(objs.logra_stats())
        result.records.append(record)
        log.write(record)
        if (step + 1) % t.log_interval == 0 or step + 1 == t.train_iters:
            log.progress(record, t.train_iters)
        last = step + 1 == t.train_iters
        if ck.save and ((ck.save_interval and (step + 1) % ck.save_interval == 0) or last):
            saved = checkpointing.save_or_report(
                ck, step + 1, objs, {"scheduler": objs.scheduler.state_dict()},
                prep.checkpoint_meta, last=last)
            result.last_checkpoint = saved or result.last_checkpoint
    if is_logger:
        print(f"metrics: {log.path.resolve()}", flush=True)
    if dist.is_initialized():
        dist.barrier()
    return result
