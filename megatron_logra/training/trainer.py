"""The one training loop: iteration, records, skips, progress, the checkpoint calls.

A stage (``training.sft.SFTStage``, ``rl.stage.RLStage``) supplies what one update does
(``step``) and what may follow it (``after``: RL's evaluations); ``run_stage`` owns the
rest, the same for every stage:

    for each update from the resumed step:
        record = stage.step(update)           # the update's own figures
        + step_time_s, peak_mem_bytes, LoGRA's stats, tokens/s (``training.throughput``)
        skipped-update count (stops the run at --max-skipped-updates in a row)
        + stage.after(update, last)           # e.g. an evaluation
        metrics.jsonl (and TensorBoard/W&B), progress line every --log-interval
        prep.checkpoints.save(step, last)     # when one is due, what it holds, how many
                                              # are kept: ``checkpoint.manager``
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from megatron_logra.config import TrainingConfig
from megatron_logra.runtime.collectives import barrier, rank_and_world
from megatron_logra.runtime.device import peak_memory_bytes
from megatron_logra.training.metrics import MetricsLog
from megatron_logra.training.step import SkippedUpdates
from megatron_logra.training.throughput import rates


@dataclass
class RunResult:
    records: list[dict] = field(default_factory=list)
    objects: object = None
    """The run's ``TrainingObjects``."""
    last_checkpoint: Path | None = None


class Stage(Protocol):
    def step(self, update: int) -> dict:
        """Update ``update`` (0-based): its record, with ``update_successful``."""

    def after(self, update: int, last: bool) -> dict:
        """Figures taken after update ``update`` (outside its step time), e.g. an eval."""


def run_stage(stage: Stage, prep, training: TrainingConfig, log: MetricsLog) -> RunResult:
    """Updates ``prep.start_step`` .. ``--train-iters`` of ``stage`` (collective); ``prep``:
    ``training.prepare.Prepared`` (its ``checkpoints`` save)."""
    objs, (rank, world) = prep.objs, rank_and_world()
    is_logger = rank == 0
    skipped = SkippedUpdates(training.max_skipped_updates)
    result = RunResult(objects=objs)
    for update in range(prep.start_step, training.train_iters):
        done, last = update + 1, update + 1 == training.train_iters
        t0 = time.perf_counter()
        record = {"step": done, **stage.step(update)}
        record.update(step_time_s=time.perf_counter() - t0, peak_mem_bytes=peak_memory_bytes(),
                      **objs.logra_stats())
        record.update(rates(record, world))
        skipped.record(record["update_successful"], done, announce=is_logger)
        record.update(stage.after(update, last))
        result.records.append(record)
        log.write(record)
        if done % training.log_interval == 0 or last:
            log.progress(record, training.train_iters)
        result.last_checkpoint = prep.checkpoints.save(done, last=last) or \
            result.last_checkpoint
    if is_logger:
        print(f"metrics: {log.path.resolve()}", flush=True)
    barrier()
    return result
