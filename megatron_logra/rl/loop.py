"""The RL stage (``--stage rl``): rollouts -> rewards -> advantages -> update -> weight sync.

Rank 0 drives the rollout engine (vLLM's own server, through ``rollout.engine_link.EngineLink``)
and the verifier;
every rank trains. Per update:

1. rank 0 samples P prompts x G responses from the engine (which serves exactly the
   trainer's current weights, version = updates done), scores them and computes the
   advantages (with --dynamic-sampling, groups without reward spread are replaced by
   more generations); the rollouts are broadcast to all ranks;
2. the trainer takes one policy-gradient step (dense Adam or LoGRA) on them, with
   truncated importance weights against the rollout logprobs, or --ppo-epochs x
   --ppo-minibatches steps against the logprobs the update started from
   (``rl.objective``: clipping, GSPO, loss aggregation);
3. the new weights are pushed to the engine and committed (``weight_sync``: full,
   sparse-delta or sketch-delta).

If the engine dies or fails a request, rank 0 restarts it, the job pushes the weights
again, and the update goes on. Evaluations (pass@1,
pass@k on held-out prompts) run before training, every ``--eval-interval`` updates
and at the end. Checkpoints hold the policy, the optimizer, the scheduler, the
baseline, the KL controller and the update index (prompts and sampling seeds are
functions of it), so a resumed run continues where it stopped.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_logra.rollout.engine_link import EngineLink
from megatron_logra.rollout.engine_memory import shared_gpu_utilization_measured
from megatron_logra.rollout.placement import EnginePlacement, plan_placement
from megatron_logra.rollout.types import EngineConfig
from megatron_logra.weight_sync.sync import WeightSync
from megatron_logra.config import RunConfig
from megatron_logra.data.sft import padded_length
from megatron_logra.data.tokenizer import load_tokenizer
from megatron_logra.kl.controller import PredictedKLStep
from megatron_logra.rl import advantages as adv
from megatron_logra.rl import rollouts
from megatron_logra.rl.policy_loss import (REPORT_KEYS, RolloutSample, collate_rollouts,
                                           logprobs_report, policy_gradient_loss)
from megatron_logra.data.tasks import generate_items
from megatron_logra.rl.verifiers import Verifier, VerifierConfig
from megatron_logra.runtime.collectives import from_rank0
from megatron_logra.runtime.device import (current_device, node_devices, peak_memory_bytes,
                                           synchronize)
from megatron_logra.runtime.faults import maybe_fail
from megatron_logra.training import checkpointing
from megatron_logra.training.log_sinks import open_metrics_log
from megatron_logra.training.metrics import MetricsLog
from megatron_logra.training.step import (SkippedUpdates, forward_backward, global_report_sums,
                                          train_step)
from megatron_logra.training.prepare import RunResult, prepare_training

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class _Driver:
    """Rank 0's engine, verifier and prompts (None elsewhere)."""

    engine_cfg: EngineConfig
    verifier: Verifier
    train_prompts: list
    eval_prompts: list
    tokenizer: object


class RLRun:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.prep = prepare_training(cfg)
        self.objs = self.prep.objs
        self.rank = dist.get_rank()
        self.dtype = _DTYPES[cfg.rl.rollout_dtype]
        opt = cfg.optimizer
        self.placement = self._place_engine()
        self.weights = WeightSync(cfg.rl.weight_sync, self.objs.model, self.objs.arch,
                                  self.dtype, optimizer=self.objs.optimizer,
                                  lora=opt.lora if opt.peft == "lora" else None,
                                  engine_tp=cfg.rl.rollout_tensor_parallel_size,
                                  group_backend="gloo" if self.placement.shares_trainer_gpus
                                  else None)
        self.sync_stats = self.weights.stats
        self.baseline = adv.RunningBaseline(cfg.rl.baseline_decay)
        extra = self.prep.extra_state or {}
        kl = cfg.rl.kl
        self.kl_step = None if kl.control == "none" else PredictedKLStep(
            kl, temperature=cfg.rl.temperature, vocab_size=self.objs.arch.vocab_size)
        if "rl" in extra:
            self.baseline.load_state_dict(extra["rl"]["baseline"])
            if self.kl_step is not None and "kl" in extra["rl"]:
                self.kl_step.controller.load_state_dict(extra["rl"]["kl"])
        self.engine_gpu_utilization = shared_gpu_utilization_measured(
            cfg.rl, self.objs.arch, self.placement)
        self.driver = self._start_driver_everywhere()
        self.link = EngineLink(self.weights, self.driver.engine_cfg if self.driver else None,
                               sleep_mode=self.placement.sleep_mode)
        self.version = self.prep.start_step
        self.push_weights()  # the engine starts from the trainer's weights

    # --- rank 0: engine, verifier, prompts -------------------------------------------------
    def _place_engine(self) -> EnginePlacement:
        """Rank 0 plans where the engine runs on its node (``rollout.placement``; a refusal
        is raised on every rank), and node 0's trainer ranks keep off a dedicated
        engine's CPU cores."""
        rl = self.cfg.rl
        placement = from_rank0(lambda: plan_placement(
            rl.rollout_placement, rl.rollout_devices,
            engine_tp=rl.rollout_tensor_parallel_size,
            cuda=current_device().type == "cuda", node_devices=node_devices(),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
            remote_engine=bool(rl.rollout_engine_url)))
        if placement.trainer_cores and os.environ.get("GROUP_RANK", "0") == "0":
            os.sched_setaffinity(0, placement.trainer_cores)
        if self.rank == 0 and (placement.note or placement.devices):
            kind = "cores" if placement.trainer_cores else "GPUs"
            print(placement.note or f"rollout engine on {kind} {list(placement.devices)} of "
                  f"node 0, dedicated", flush=True)
        return placement

    def _start_driver_everywhere(self) -> _Driver | None:
        """Rank 0 builds the driver; a failure there (bad task data, no prompts fit) is
        raised on every rank, so no rank waits in a collective for a rank that died."""
        driver = None

        def start() -> None:  # rank 0 keeps the driver
            nonlocal driver
            try:
                driver = self._start_driver()
            except (ValueError, RuntimeError, OSError) as exc:
                raise RuntimeError(
                    f"RL set-up failed on rank 0: {type(exc).__name__}: {exc}") from exc
        from_rank0(start)
        return driver

    def _start_driver(self) -> _Driver:
        cfg, rl = self.cfg, self.cfg.rl
        tokenizer = load_tokenizer(cfg.model.model_dir, cfg.model.tokenizer_model)
        seed = self._data_seed()
        items = generate_items(cfg.data.tasks, cfg.data.dataset_size, seed)
        prompts = rollouts.encode_prompts(items, tokenizer,
                                          cfg.training.seq_length - rl.max_new_tokens)
        if len(prompts) <= rl.eval_prompts:
            raise ValueError(f"only {len(prompts)} prompts fit --seq-length - --max-new-tokens; "
                             f"raise --dataset-size or --seq-length (need > --eval-prompts)")
        engine_cfg = EngineConfig(
            str(self._engine_init_dir()), max_model_len=cfg.training.seq_length,
            dtype=rl.rollout_dtype, kv_cache_gib=rl.rollout_kv_cache_gib,
            tensor_parallel_size=rl.rollout_tensor_parallel_size, seed=rl.rollout_seed,
            lora_rank=self.weights.engine_lora_rank, env=tuple(self.placement.env.items()),
            cpu_cores=self.placement.engine_cores,
            sleep_mode=self.placement.sleep_mode,
            gpu_memory_utilization=self.engine_gpu_utilization,
            url=rl.rollout_engine_url)
        print(f"{len(prompts) - rl.eval_prompts} train / {rl.eval_prompts} eval prompts",
              flush=True)
        verifier = Verifier(VerifierConfig(reward=rl.reward, timeout_s=rl.verifier_timeout))
        return _Driver(engine_cfg, verifier, prompts[rl.eval_prompts:], prompts[:rl.eval_prompts],
                       tokenizer)

    def _data_seed(self) -> int:
        d = self.cfg.data
        return d.data_seed if d.data_seed is not None else self.cfg.training.seed

    def _engine_init_dir(self) -> Path:
        """config + tokenizer of the model folder; the weights come with the first push."""
        out = Path(self.cfg.output_dir) / "engine_init"
        out.mkdir(parents=True, exist_ok=True)
        for f in Path(self.cfg.model.model_dir).iterdir():
            if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".gguf")) \
                    and not f.name.endswith(".index.json"):
                shutil.copy2(f, out / f.name)
        return out

    # --- the engine (``rollout.engine_link.EngineLink``; collective) -------------------------------------
    @property
    def engine(self):
        """Rank 0's ``VllmServer`` (None elsewhere, and before the first push)."""
        return self.link.engine

    def push_weights(self, transport: str | None = None) -> None:
        """Push the trainer's weights as version ``self.version``; ``transport`` forces one
        (tests, benchmarks)."""
        self.link.push(self.version, transport)

    def generate(self, requests, phase: str = "rollouts") -> list | None:
        """Completions of ``requests`` from the engine at ``self.version`` (rank 0)."""
        return self.link.generate(requests, self.version, phase)

    # --- one update ------------------------------------------------------------------------
    def rollout_batch(self, update: int) -> tuple[list[RolloutSample] | None, dict]:
        groups, stats = self._generate_groups(update)
        samples, stats = from_rank0(lambda: self._samples(groups, stats))
        self.baseline.value = stats["baseline"]  # every rank checkpoints the same state
        return samples, stats

    def _samples(self, groups: list, stats: dict) -> tuple[list[RolloutSample], dict]:
        """Rank 0: the update's samples with their advantages, and ``stats`` with the
        rewards' and responses' figures."""
        rl = self.cfg.rl
        prompts = [p for p, _, _ in groups]
        completions = [c for _, group, _ in groups for c in group]
        r = torch.tensor([rewards for _, _, rewards in groups], dtype=torch.float32)
        if rl.algorithm == "grpo":
            a = adv.grpo_advantages(r, scale_by_std=rl.grpo_std_norm)
        else:
            failure = rl.failure_reward if rl.reward == "binary" else None
            a = self.baseline.advantages(adv.reinforce_outcomes(r, failure))
        samples = [RolloutSample(p.ids, c.token_ids, c.logprobs, float(a.flatten()[k]),
                                 truncated=c.truncated, reward=float(r.flatten()[k]))
                   for k, (p, c) in enumerate(zip(
                       [p for p in prompts for _ in range(rl.responses_per_prompt)],
                       completions))]
        length, truncated = rollouts.length_stats(completions)
        stats.update(reward_mean=float(r.mean()), response_len=length,
                     truncated_frac=truncated, baseline=self.baseline.value)
        return samples, stats

    def _generate_groups(self, update: int) -> tuple[list | None, dict]:
        """Rank 0: the update's P groups [(prompt, G completions, G rewards)]; None elsewhere.
        With --dynamic-sampling, groups whose rewards are all equal are set aside and more
        prompts generated (collective: every rank takes part in each round) until P groups
        have signal or --dynamic-sampling-max-rounds rounds are done; a batch still short
        is filled with set-aside groups."""
        rl = self.cfg.rl
        kept, dropped, rounds, seconds = [], [], 0, 0.0
        while True:
            prompts = requests = None
            if self.rank == 0:
                prompts, requests = rollouts.step_requests(
                    self.driver.train_prompts, rl, update, self._data_seed(), rounds)
            t0 = time.perf_counter()
            completions = self.generate(requests, f"rollouts {update + 1}" + (
                f" round {rounds + 1}" if rounds else ""))
            seconds += time.perf_counter() - t0
            more = from_rank0(lambda: self._sort_groups(prompts, completions, kept, dropped,
                                                        rounds))
            rounds += 1
            if not more:
                break
        stats: dict = {"rollout_time_s": seconds}
        groups = None
        if self.rank == 0:
            groups, with_signal = rollouts.fill_groups(kept, dropped, rl.prompts_per_step)
            if rl.dynamic_sampling:
                stats.update(dynamic_sampling_rounds=rounds,
                             dynamic_sampling_signal_groups=with_signal,
                             dynamic_sampling_dropped_groups=len(dropped))
        return groups, stats

    def _sort_groups(self, prompts, completions, kept: list, dropped: list,
                     rounds: int) -> bool:
        """Rank 0: each prompt's group scored and added to ``kept``, or to ``dropped``
        (no signal under --dynamic-sampling); whether another round is wanted (``rounds``:
        the rounds done before this one)."""
        rl = self.cfg.rl
        rewards = rollouts.score(self.driver.verifier, self.driver.tokenizer, prompts,
                                 completions, rl.responses_per_prompt)
        g = rl.responses_per_prompt
        for i, prompt in enumerate(prompts):
            group = (prompt, completions[i * g:(i + 1) * g], rewards[i])
            signal = not rl.dynamic_sampling or rollouts.has_signal(rewards[i])
            (kept if signal else dropped).append(group)
        return (rl.dynamic_sampling and len(kept) < rl.prompts_per_step
                and rounds + 1 < rl.dynamic_sampling_max_rounds)

    def batch_length(self, samples: list[RolloutSample]) -> int:
        """Padded length of this update's sequences: the longest rollout of the global batch
        (so the same on every rank, as the pipeline's p2p shapes need), rounded up to 16,
        at most --seq-length. Short rollouts do not pay for --seq-length of compute."""
        longest = max(len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples)
        return padded_length(longest, self.cfg.training.seq_length)

    def _my_samples(self, samples: list[RolloutSample]) -> list[RolloutSample]:
        dp_rank = parallel_state.get_data_parallel_rank()
        per_rank = len(samples) // parallel_state.get_data_parallel_world_size()
        return samples[dp_rank * per_rank:(dp_rank + 1) * per_rank]

    def microbatches(self, samples: list[RolloutSample], length: int) -> list[dict]:
        mbs = self.cfg.training.micro_batch_size
        mine, pad = self._my_samples(samples), self.prep.pad_id
        return [collate_rollouts(mine[j:j + mbs], length, pad) for j in range(0, len(mine), mbs)]

    def minibatches(self, samples: list[RolloutSample], length: int) -> list[list[dict]]:
        """This rank's microbatches of each PPO minibatch: minibatch k is the k-th of
        --ppo-minibatches equal slices of the global batch (the same responses at every
        data-parallel size), each split over the DP ranks."""
        n = self.cfg.rl.ppo_minibatches
        size = len(samples) // n
        return [self.microbatches(samples[k * size:(k + 1) * size], length) for k in range(n)]

    def old_logprobs(self, minibatches: list[list[dict]], length: int) -> None:
        """Several optimizer steps per batch: one forward pass first puts the logprobs the
        update starts from in each microbatch (``old_logprobs``, on the last stage, which
        alone computes the loss), so every step's ratio is against them."""
        flat = [mb for mbs in minibatches for mb in mbs]
        with torch.no_grad():
            reports = forward_backward(
                self.objs.model, flat, seq_length=length,
                micro_batch_size=self.cfg.training.micro_batch_size,
                vocab_size=self.objs.arch.vocab_size, forward_only=True,
                loss_fn=partial(logprobs_report, self.objs.arch.vocab_size,
                                self.cfg.rl.temperature))
        for mb, report in zip(flat, reports):
            mb["old_logprobs"] = report["logprobs"].float()

    def train(self, samples: list[RolloutSample], update: int) -> dict:
        """The update: --ppo-epochs passes over --ppo-minibatches minibatches, one
        optimizer step each (one step by default); the learning-rate schedule moves once."""
        t, rl = self.cfg.training, self.cfg.rl
        loss_fn = partial(policy_gradient_loss, self.objs.arch.vocab_size, rl.temperature,
                          rl.policy_objective())
        t0 = time.perf_counter()
        length = self.batch_length(samples)
        minibatches = self.minibatches(samples, length)
        if rl.steps_per_update > 1:
            self.old_logprobs(minibatches, length)
        sums = dict.fromkeys(REPORT_KEYS, 0.0)
        kl_record: dict = {}

        def optimizer_step(reports: list[dict]) -> tuple[bool, float | None]:
            step = dict(zip(REPORT_KEYS, global_report_sums(reports, len(REPORT_KEYS))))
            for key, value in step.items():
                sums[key] += value
            if self.kl_step is None:
                ok, grad_norm, _ = self.objs.optimizer.step()
                return ok, grad_norm
            probe = collate_rollouts(self._my_samples(samples)[:rl.kl.probe_responses],
                                     length, self.prep.pad_id)
            eos = step["eos_tokens"]
            mismatch = step["eos_mismatch_sum"] / eos if eos else None
            ok, grad_norm, record = self.kl_step.step(self.objs, update, probe, mismatch)
            kl_record.update(record)
            return ok, grad_norm

        outs = [train_step(self.objs, microbatches, seq_length=length,
                           micro_batch_size=t.micro_batch_size, loss_fn=loss_fn,
                           optimizer_step=optimizer_step, advance_schedule=not (epoch or k),
                           update=update + 1)
                for epoch in range(rl.ppo_epochs) for k, microbatches in enumerate(minibatches)]
        synchronize()
        n = max(sums["tokens"], 1.0)
        record = {"loss": sum(o.loss for o in outs) / len(outs), "lr": outs[0].lr,
                  "tokens": int(round(sums["tokens"] / rl.ppo_epochs)),
                  "grad_norm": outs[-1].grad_norm, **kl_record,
                  "logprob_mismatch": sums["abs_mismatch_sum"] / n,
                  "tis_weight_mean": sums["tis_weight_sum"] / n,
                  "tis_capped_frac": sums["tis_capped"] / n,
                  "train_time_s": time.perf_counter() - t0,
                  "update_successful": all(o.update_successful for o in outs)}
        if len(outs) > 1 or rl.clip_ratio_low is not None:
            record.update(optimizer_steps=len(outs), clip_frac=sums["clipped_tokens"] / n,
                          ppo_kl=sums["ppo_kl_sum"] / n,
                          steps_successful=sum(o.update_successful for o in outs))
        record.update(self.objs.logra_stats())
        return record

    def evaluate(self) -> dict:
        rl = self.cfg.rl
        requests = rollouts.eval_requests(self.driver.eval_prompts, rl) if self.rank == 0 else None
        completions = self.generate(requests, "eval")

        def score() -> dict:  # rank 0, which holds the verifier
            rewards = rollouts.score(self.driver.verifier, self.driver.tokenizer,
                                     self.driver.eval_prompts, completions, rl.eval_samples)
            p1, pk = rollouts.pass_at(rewards)
            length, truncated = rollouts.length_stats(completions)
            return {"eval_pass@1": p1, f"eval_pass@{rl.eval_samples}": pk,
                    "eval_response_len": length, "eval_truncated_frac": truncated,
                    # per eval prompt (fixed prompts and seeds): paired gains and their SE
                    "eval_prompt_pass": rollouts.prompt_pass_rates(rewards)}
        return from_rank0(score)

    def close(self) -> None:
        self.link.close()
        if self.driver is not None:
            self.driver.verifier.close()


def run_rl(cfg: RunConfig) -> RunResult:
    run = RLRun(cfg)
    try:
        with open_metrics_log(cfg, run.rank == 0, run.prep.start_step) as log:
            return _loop(run, log)
    finally:
        run.close()


def _loop(run: RLRun, log: MetricsLog) -> RunResult:
    cfg, objs, prep = run.cfg, run.objs, run.prep
    t, rl, ck = cfg.training, cfg.rl, cfg.checkpoint
    start = prep.start_step
    result = RunResult(objects=objs)
    skipped = SkippedUpdates(t.max_skipped_updates)
    if start == 0:
        record = {"step": 0, **run.evaluate()}
        log.write(record)
        if run.rank == 0:
            print(f"eval before training: {json.dumps(record)}", flush=True)
    for update in range(start, t.train_iters):
        t0 = time.perf_counter()
        maybe_fail("rollout", update + 1)
        samples, record = run.rollout_batch(update)
        run.link.release()  # a colocated engine gives the devices to the trainer
        record.update(run.train(samples, update))
        skipped.record(record["update_successful"], update + 1, announce=run.rank == 0)
        run.version = update + 1
        sync_before = (run.sync_stats.bytes, run.sync_stats.seconds)
        maybe_fail("sync", update + 1)
        run.push_weights()
        record.update(step=update + 1, sync_bytes=run.sync_stats.bytes - sync_before[0],
                      sync_time_s=run.sync_stats.seconds - sync_before[1],
                      sync_transport=run.sync_stats.last_transport,
                      checksum_mismatches=run.sync_stats.checksum_mismatches,
                      engine_restarts=run.sync_stats.restarts, peak_mem_bytes=peak_memory_bytes(),
                      step_time_s=time.perf_counter() - t0)
        last = update + 1 == t.train_iters
        if last:  # the engine ends the run holding the trainer's weights (when it can tell)
            mismatches = run.weights.engine_mismatches(run.engine)
            if mismatches is not None:
                record["engine_weight_mismatches"] = mismatches
        if last or (rl.eval_interval and (update + 1) % rl.eval_interval == 0):
            record.update(run.evaluate())
        result.records.append(record)
        log.write(record)
        if (update + 1) % t.log_interval == 0 or last:
            log.progress(record, t.train_iters)
        if ck.save and ((ck.save_interval and (update + 1) % ck.save_interval == 0) or last):
            extra = {"scheduler": objs.scheduler.state_dict(),
                     "rl": {"baseline": run.baseline.state_dict()}}
            if run.kl_step is not None:
                extra["rl"]["kl"] = run.kl_step.controller.state_dict()
            saved = checkpointing.save_or_report(ck, update + 1, objs, extra,
                                                 prep.checkpoint_meta, last=last)
            result.last_checkpoint = saved or result.last_checkpoint
    if run.rank == 0:
        print(f"metrics: {log.path.resolve()}", flush=True)
    dist.barrier()
    return result
