"""The RL stage (``--stage rl``): rollouts -> rewards -> advantages -> update -> weight sync.

Rank 0 drives the rollout engine (vLLM's own server) and the verifier; every rank
trains. ``RLStage.step(update)`` is one update, in this order:

1. ``SampleSource.rollout_batch``: P prompts x G responses from the engines, which serve
   exactly the trainer's current weights (version = updates done), scored, with their
   advantages, on every rank;
2. ``PolicyUpdate.train``: the policy-gradient step(s) (dense Adam, LoRA or LoGRA);
3. the version moves on and the new weights are pushed to the engines
   (``SyncedEngines.push``, through ``weight_sync``: full, sparse-delta, sketch-delta or
   lora-adapter) and committed.

Each update's record splits its wall time into generation, scoring, training, push and
waiting (``time_<part>_s``, ``training.throughput.SPLIT``) and counts its
``generated_tokens`` and ``trained_tokens`` (the loop turns them into tokens/s).

With ``--async-rollouts`` step 1 takes the batch generated beside the previous update's
training and starts the next ones (``rl.samples_ahead``), and the staleness bounds
decide each sample's weight in the loss (``rl.staleness``); a batch with nothing left
trains nothing and pushes nothing.

If an engine dies or fails a request, rank 0 restarts it (``rollout.engines``), the job
pushes the weights again (``rl.synced_engines``), and the update goes on. Evaluations
(pass@1, pass@k on held-out prompts) run before training, every ``--eval-interval``
updates and at the end (``after``). ``training.trainer.run_stage`` runs the updates and
logs; the run's ``checkpoint.manager.CheckpointManager`` checkpoints the policy, the
optimizer and the resumable parts: the scheduler, the reward baseline and the KL
controller (prompts and sampling seeds are functions of the update index), so a resumed
run continues where it stopped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from megatron_logra.config import RunConfig
from megatron_logra.rl.policy_loss import RolloutSample
from megatron_logra.rl.policy_update import PolicyUpdate
from megatron_logra.rl.sample_source import SampleSource
from megatron_logra.rl.samples_ahead import SamplesAhead
from megatron_logra.rl.staleness import UpdateKL, apply_bound
from megatron_logra.rl.synced_engines import SyncedEngines
from megatron_logra.runtime.faults import maybe_fail
from megatron_logra.training.log_sinks import open_metrics_log
from megatron_logra.training.prepare import prepare_training
from megatron_logra.training.trainer import RunResult, run_stage

AdjustSamples = Callable[[list[RolloutSample]], list[RolloutSample]]


class RLStage:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.prep = prepare_training(cfg)
        self.objs = self.prep.objs
        self.engines = SyncedEngines.start(cfg, self.objs)
        self.source = SampleSource(cfg, self.engines)
        self.policy = PolicyUpdate(cfg, self.objs, self.prep.pad_id)
        self.prep.checkpoints.register("rl_baseline", self.source.baseline)
        if self.policy.kl_step is not None:
            self.prep.checkpoints.register("kl_controller", self.policy.kl_step.controller)
        self.rank = self.source.rank
        self.version = self.prep.start_step
        rl = cfg.rl
        self.ahead = SamplesAhead(self.source, cfg.training.train_iters) \
            if rl.staleness.async_rollouts else None
        self.bound = rl.staleness
        self.update_kl = UpdateKL()
        self.push_weights()  # the engines start from the trainer's weights

    @property
    def engine(self):
        """Rank 0's first ``VllmServer`` (None elsewhere)."""
        return self.engines.engines.server

    @property
    def sync(self):
        """The trainer's side of weight sync (``weight_sync.sync.WeightSync``)."""
        return self.engines.sync

    @property
    def sync_stats(self):
        """The weight pushes' running figures (``weight_sync.sync.SyncStats``)."""
        return self.engines.stats

    @property
    def engine_restarts(self) -> int:
        """The engines restarted after a failure so far."""
        return self.engines.engines.restarts

    def push_weights(self) -> None:
        """Push the trainer's weights as version ``self.version`` (a test or a benchmark
        forces a transport with ``self.sync.forcing``)."""
        self.engines.push(self.version)

    def rollout_batch(self, update: int) -> tuple[list[RolloutSample], dict]:
        return self.source.rollout_batch(update, self.version)

    def train(self, samples: list[RolloutSample], update: int) -> dict:
        return self.policy.train(samples, update)

    def evaluate(self) -> dict:
        return self.source.evaluate(self.version)

    def step(self, update: int, adjust_samples: AdjustSamples | None = None) -> dict:
        """One update (0-based ``update``); ``adjust_samples`` may change the samples
        between rollout and training (tests force advantages on an untrained model)."""
        maybe_fail("rollout", update + 1)
        if self.ahead is None:
            samples, record = self.rollout_batch(update)
            t0 = time.perf_counter()
            self.engines.release()  # colocated engines give the devices to the trainer
            record["time_generation_s"] += time.perf_counter() - t0
            record["time_waiting_s"] = 0.0
        else:
            samples, record = self._take_ahead(update)
        record.update(time_training_s=0.0, time_push_s=0.0)
        if adjust_samples is not None:
            samples = adjust_samples(samples)
        if any(s.weight > 0 for s in samples):
            t0 = time.perf_counter()
            record.update(self.train(samples, update))
            record["time_training_s"] = time.perf_counter() - t0
            record["trained_tokens"] = sum(len(s.prompt_ids) + len(s.response_ids)
                                           for s in samples)
            self.update_kl.record(self.version, record)
            self.version += 1
        else:  # every sample too stale: nothing trains, the engines keep their weights
            record.update(update_successful=True, stale_skipped_update=True, trained_tokens=0)
            return record
        if self.ahead is not None:
            waited = self.ahead.wait_idle()
            record["rollout_wait_s"] += waited
            record["time_waiting_s"] += waited
        stats = self.sync_stats
        before = (stats.bytes, stats.seconds)
        maybe_fail("sync", update + 1)
        t0 = time.perf_counter()
        self.push_weights()
        record["time_push_s"] = time.perf_counter() - t0
        record.update(sync_bytes=stats.bytes - before[0], sync_time_s=stats.seconds - before[1],
                      sync_transport=stats.last_transport,
                      checksum_mismatches=stats.checksum_mismatches,
                      engine_restarts=self.engine_restarts)
        return record

    def _take_ahead(self, update: int) -> tuple[list[RolloutSample], dict]:
        """--async-rollouts: this update's batch (generated beside the last update's
        training), the next --max-staleness batches started at the current weights, and
        the staleness bounds applied (``rl.staleness``)."""
        samples, record = self.ahead.take(update, self.version)
        for ahead in range(1, self.bound.max_staleness + 1):
            self.ahead.start(update + ahead, self.version)
        samples, stale = apply_bound(samples, self.version, self.update_kl, self.bound)
        record.update(stale)
        return samples, record

    def after(self, update: int, last: bool) -> dict:
        """At the end: the engine's weights checked against the trainer's (where it can
        tell) and an evaluation; every --eval-interval updates: an evaluation."""
        record: dict = {}
        if last:
            mismatches = self.engines.mismatches()
            if mismatches is not None:
                record["engine_weight_mismatches"] = mismatches
        interval = self.cfg.rl.eval_interval
        if last or (interval and (update + 1) % interval == 0):
            record.update(self.evaluate())
        return record

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()
        self.engines.close()
        self.source.close()


def run_rl(cfg: RunConfig) -> RunResult:
    stage = RLStage(cfg)
    try:
        with open_metrics_log(cfg, stage.rank == 0, stage.prep.start_step) as log:
            if stage.prep.start_step == 0:
                record = {"step": 0, **stage.evaluate()}
                log.write(record)
                if stage.rank == 0:
                    print(f"eval before training: {json.dumps(record)}", flush=True)
            return run_stage(stage, stage.prep, cfg.training, log)
    finally:
        stage.close()
