"""The supervised stage (``--stage sft``): prepare, then ``training.trainer.run_stage``
over ``SFTStage``'s steps.

``run_sft(cfg)`` is what ``launch/pretrain_rl.py --stage sft`` executes; tests call it
in-process to run several layouts in one torchrun launch.
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state

from megatron_logra.config import RunConfig
from megatron_logra.data.sft import SFTBatches, encode_sft
from megatron_logra.data.tasks import generate_items
from megatron_logra.data.tokenizer import load_tokenizer
from megatron_logra.runtime.device import init_runtime, synchronize
from megatron_logra.training.log_sinks import open_metrics_log
from megatron_logra.training.prepare import Prepared, prepare_training
from megatron_logra.training.step import train_step
from megatron_logra.training.trainer import RunResult, run_stage


def build_sft_batches(cfg: RunConfig, tokenizer) -> SFTBatches:
    items = generate_items(cfg.data.tasks, cfg.data.dataset_size, cfg.data_seed)
    samples = [encode_sft(tokenizer, item) for item in items]
    batches = SFTBatches(samples, global_batch_size=cfg.training.global_batch_size,
                         micro_batch_size=cfg.training.micro_batch_size,
                         seq_length=cfg.training.seq_length, pad_id=tokenizer.pad_token_id,
                         seed=cfg.data_seed)
    if batches.dropped and dist.get_rank() == 0:
        print(f"SFT: {batches.dropped} of {len(samples)} samples keep no answer token within "
              f"--seq-length {cfg.training.seq_length} and are left out", flush=True)
    return batches


class SFTStage:
    """One supervised update per step: this rank's microbatches of the step's batch."""

    def __init__(self, cfg: RunConfig, prep: Prepared, batches: SFTBatches):
        self.objs, self.batches, self.training = prep.objs, batches, cfg.training
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()

    def step(self, update: int) -> dict:
        out = train_step(self.objs, self.batches.microbatches(update, self.dp_rank, self.dp_size),
                         seq_length=self.batches.step_length(update),
                         micro_batch_size=self.training.micro_batch_size, update=update + 1)
        synchronize()
        return {"loss": out.loss, "lr": out.lr, "grad_norm": out.grad_norm, "tokens": out.tokens,
                "update_successful": out.update_successful}

    def after(self, update: int, last: bool) -> dict:
        return {}


def run_sft(cfg: RunConfig) -> RunResult:
    init_runtime(cfg.training.distributed_timeout_minutes)
    # the data first: a setting that leaves nothing to train on fails before the model is built
    batches = build_sft_batches(cfg, load_tokenizer(cfg.model.model_dir,
                                                    cfg.model.tokenizer_model))
    prep = prepare_training(cfg)
    with open_metrics_log(cfg, dist.get_rank() == 0, prep.start_step) as log:
        return run_stage(SFTStage(cfg, prep, batches), prep, cfg.training, log)
