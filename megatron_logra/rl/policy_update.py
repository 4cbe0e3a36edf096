"""One RL update on the trainer: batching, the policy-gradient loss, the optimizer steps.

``PolicyUpdate.train(samples, update)`` lays the global batch's samples out for this
rank (padded to the batch's longest sequence, split over the data-parallel ranks and
into --ppo-minibatches), then takes --ppo-epochs x --ppo-minibatches optimizer steps
(one by default) with truncated importance weights against the rollout logprobs, or
against the logprobs the update started from when it takes several steps
(``rl.objective``: clipping, GSPO, loss aggregation). Under predicted-KL control every
step is scaled before it is applied (``kl.controller.PredictedKLStep``). Collective.
"""

from __future__ import annotations

import time
from functools import partial

import torch
from megatron.core import parallel_state

from megatron_logra.config import RunConfig
from megatron_logra.data.sft import padded_length
from megatron_logra.kl.controller import PredictedKLStep
from megatron_logra.rl.policy_loss import (REPORT_KEYS, RolloutSample, collate_rollouts,
                                           logprobs_report, policy_gradient_loss)
from megatron_logra.runtime.device import synchronize
from megatron_logra.training.adam_cosine import AdamCosine
from megatron_logra.training.build import TrainingObjects
from megatron_logra.training.step import forward_backward, global_report_sums, train_step


class PolicyUpdate:
    def __init__(self, cfg: RunConfig, objs: TrainingObjects, pad_id: int):
        self.objs, self.pad_id = objs, pad_id
        self.training, self.rl = cfg.training, cfg.rl
        kl = cfg.rl.kl
        self.kl_step = None if kl.control == "none" else PredictedKLStep(
            kl, temperature=cfg.rl.temperature, vocab_size=objs.arch.vocab_size,
            max_response_tokens=cfg.rl.max_new_tokens)
        opt = cfg.optimizer
        self.adam_cosine = AdamCosine(objs.model, beta1=opt.adam_beta1, beta2=opt.adam_beta2,
                                      eps=opt.adam_eps) if cfg.training.log_adam_cosine else None

    def batch_length(self, samples: list[RolloutSample]) -> int:
        """Padded length of this update's sequences: the longest rollout of the global batch
        (so the same on every rank, as the pipeline's p2p shapes need), rounded up to 16,
        at most --seq-length. Short rollouts do not pay for --seq-length of compute."""
        longest = max(len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples)
        return padded_length(longest, self.training.seq_length)

    def _my_samples(self, samples: list[RolloutSample]) -> list[RolloutSample]:
        dp_rank = parallel_state.get_data_parallel_rank()
        per_rank = len(samples) // parallel_state.get_data_parallel_world_size()
        return samples[dp_rank * per_rank:(dp_rank + 1) * per_rank]

    def microbatches(self, samples: list[RolloutSample], length: int) -> list[dict]:
        mbs = self.training.micro_batch_size
        mine, pad = self._my_samples(samples), self.pad_id
        return [collate_rollouts(mine[j:j + mbs], length, pad) for j in range(0, len(mine), mbs)]

    def minibatches(self, samples: list[RolloutSample], length: int) -> list[list[dict]]:
        """This rank's microbatches of each PPO minibatch: minibatch k is the k-th of
        --ppo-minibatches equal slices of the global batch (the same responses at every
        data-parallel size), each split over the DP ranks."""
        n = self.rl.ppo_minibatches
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
                micro_batch_size=self.training.micro_batch_size,
                vocab_size=self.objs.arch.vocab_size, forward_only=True,
                loss_fn=partial(logprobs_report, self.objs.arch.vocab_size,
                                self.rl.temperature))
        for mb, report in zip(flat, reports):
            mb["old_logprobs"] = report["logprobs"].float()

    def train(self, samples: list[RolloutSample], update: int) -> dict:
        """The update: --ppo-epochs passes over --ppo-minibatches minibatches, one
        optimizer step each (one step by default); the learning-rate schedule moves once."""
        t, rl = self.training, self.rl
        loss_fn = partial(policy_gradient_loss, self.objs.arch.vocab_size, rl.temperature,
                          rl.objective, rl.max_new_tokens)
        t0 = time.perf_counter()
        length = self.batch_length(samples)
        minibatches = self.minibatches(samples, length)
        if rl.steps_per_update > 1:
            self.old_logprobs(minibatches, length)
        sums = dict.fromkeys(REPORT_KEYS, 0.0)
        kl_record: dict = {}

        def scaled_step(reports: list[dict]) -> tuple[bool, float | None]:
            step = dict(zip(REPORT_KEYS, global_report_sums(reports, len(REPORT_KEYS))))
            for key, value in step.items():
                sums[key] += value
            if self.kl_step is None:
                ok, grad_norm, _ = self.objs.optimizer.step()
                return ok, grad_norm
            probe = collate_rollouts(self._my_samples(samples)[:rl.kl.probe_responses],
                                     length, self.pad_id)
            eos = step["eos_tokens"]
            mismatch = step["eos_mismatch_sum"] / eos if eos else None
            ok, grad_norm, record = self.kl_step.step(self.objs, update, probe, mismatch)
            kl_record.update(record)
            return ok, grad_norm

        def optimizer_step(reports: list[dict]) -> tuple[bool, float | None]:
            if self.adam_cosine is None:
                return scaled_step(reports)
            self.adam_cosine.before_step()
            ok, grad_norm = scaled_step(reports)
            kl_record.update(self.adam_cosine.after_step(ok))
            return ok, grad_norm

        outs = []
        for epoch in range(rl.ppo_epochs):
            for k, microbatches in enumerate(minibatches):
                if self.adam_cosine is not None:
                    self.adam_cosine.begin()
                outs.append(train_step(self.objs, microbatches, seq_length=length,
                                       micro_batch_size=t.micro_batch_size, loss_fn=loss_fn,
                                       optimizer_step=optimizer_step,
                                       advance_schedule=not (epoch or k), update=update + 1))
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
        if len(outs) > 1 or rl.objective.clip_ratio_low is not None:
            record.update(optimizer_steps=len(outs), clip_frac=sums["clipped_tokens"] / n,
                          ppo_kl=sums["ppo_kl_sum"] / n,
                          steps_successful=sum(o.update_successful for o in outs))
        record.update(self.objs.logra_stats())
        return record
