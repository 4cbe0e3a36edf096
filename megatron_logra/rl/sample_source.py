"""Where an RL update's samples come from: prompts, generation, scoring, advantages and
evaluation (the engines' side is ``rl.synced_engines``).

``SampleSource`` starts rank 0's driver (tokenizer, prompts, verifier) and owns the
reward baseline. ``rollout_batch(update)`` samples P prompts x G responses at the
current version from the engines (``SyncedEngines.generate``), scores them and computes
the advantages (with --dynamic-sampling, groups without reward spread are replaced by
more generations), and broadcasts the samples to every rank; ``evaluate()`` scores the
held-out prompts (pass@1, pass@k). Collective: every rank calls every method.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_logra.config import RunConfig
from megatron_logra.data.tasks import generate_items
from megatron_logra.data.tokenizer import load_tokenizer
from megatron_logra.rl import advantages as adv
from megatron_logra.rl import prompts_and_scores as scores
from megatron_logra.rl.policy_loss import RolloutSample
from megatron_logra.rl.synced_engines import SyncedEngines
from megatron_logra.rl.verifiers import Verifier
from megatron_logra.runtime.collectives import from_rank0


@dataclass
class _Driver:
    """Rank 0's verifier, prompts and tokenizer (None elsewhere)."""

    verifier: Verifier
    train_prompts: list
    eval_prompts: list
    tokenizer: object


class SampleSource:
    def __init__(self, cfg: RunConfig, engines: SyncedEngines):
        """``engines``: where the samples are generated, on the trainer's weights."""
        self.cfg, self.rank, self.engines = cfg, dist.get_rank(), engines
        self.baseline = adv.RunningBaseline(cfg.rl.baseline_decay)
        self.driver = self._start_driver_everywhere()

    def close(self) -> None:
        if self.driver is not None:
            self.driver.verifier.close()

    # --- set-up --------------------------------------------------------------------------
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
        items = generate_items(cfg.data.tasks, cfg.data.dataset_size, cfg.data_seed)
        prompts = scores.encode_prompts(items, tokenizer,
                                        cfg.training.seq_length - rl.max_new_tokens)
        if len(prompts) <= rl.eval_prompts:
            raise ValueError(f"only {len(prompts)} prompts fit --seq-length - --max-new-tokens; "
                             f"raise --dataset-size or --seq-length (need > --eval-prompts)")
        print(f"{len(prompts) - rl.eval_prompts} train / {rl.eval_prompts} eval prompts",
              flush=True)
        verifier = Verifier(rl.verifier)
        return _Driver(verifier, prompts[rl.eval_prompts:], prompts[:rl.eval_prompts],
                       tokenizer)

    # --- samples -------------------------------------------------------------------------
    def rollout_batch(self, update: int, version: int) -> tuple[list[RolloutSample], dict]:
        """Update ``update``'s samples (every rank) generated at weights ``version``, and
        the rollout's figures (collective: a failed engine is restarted and resynced),
        with this rank's ``time_generation_s`` and ``time_scoring_s``
        (``training.throughput.SPLIT``): the engines' part and the rest."""
        t0 = time.perf_counter()
        groups, stats = self._generate_groups(
            update, lambda requests, phase: self.engines.generate(requests, version, phase),
            from_rank0)
        generating = stats["rollout_time_s"]  # this rank's: every rank waited for it
        samples, stats = from_rank0(lambda: self._samples(groups, stats, version,
                                                          self.baseline))
        self.baseline.value = stats["baseline"]  # every rank checkpoints the same state
        stats["time_generation_s"] = generating
        stats["time_scoring_s"] = time.perf_counter() - t0 - generating
        return samples, stats

    def produce_here(self, update: int, version: int,
                     baseline: adv.RunningBaseline) -> tuple[list[RolloutSample], dict]:
        """Rank 0 alone (no collective: ``rl.samples_ahead`` runs it beside training):
        update ``update``'s samples from the engine serving ``version``, their advantages
        against ``baseline`` (which it advances); an engine failure raises EngineError."""
        groups, stats = self._generate_groups(
            update, lambda requests, phase: self.engines.generate_here(requests, version, phase),
            lambda decide: decide())
        return self._samples(groups, stats, version, baseline)

    def _samples(self, groups: list, stats: dict, version: int,
                 baseline: adv.RunningBaseline) -> tuple[list[RolloutSample], dict]:
        """Rank 0: the update's samples (generated at ``version``) with their advantages,
        and ``stats`` with the rewards' and responses' figures."""
        rl = self.cfg.rl
        prompts = [p for p, _, _ in groups]
        completions = [c for _, group, _ in groups for c in group]
        r = torch.tensor([rewards for _, _, rewards in groups], dtype=torch.float32)
        if rl.algorithm == "grpo":
            a = adv.grpo_advantages(r, scale_by_std=rl.grpo_std_norm)
        else:
            failure = rl.failure_reward if rl.verifier.reward == "binary" else None
            a = baseline.advantages(adv.reinforce_outcomes(r, failure))
        samples = [RolloutSample(p.ids, c.token_ids, c.logprobs, float(a.flatten()[k]),
                                 truncated=c.truncated, reward=float(r.flatten()[k]),
                                 version=version)
                   for k, (p, c) in enumerate(zip(
                       [p for p in prompts for _ in range(rl.responses_per_prompt)],
                       completions))]
        length, truncated = scores.length_stats(completions)
        stats.update(reward_mean=float(r.mean()), response_len=length,
                     truncated_frac=truncated, baseline=baseline.value)
        return samples, stats

    def _generate_groups(self, update: int, generate, decide) -> tuple[list | None, dict]:
        """Rank 0: the update's P groups [(prompt, G completions, G rewards)]; None elsewhere.
        With --dynamic-sampling, groups whose rewards are all equal are set aside and more
        prompts generated until P groups have signal or --dynamic-sampling-max-rounds
        rounds are done; a batch still short is filled with set-aside groups.
        ``generate(requests, phase)``: the completions (rank 0); ``decide(fn)``: rank 0's
        ``fn()`` where every rank learns it (``from_rank0``: every rank takes part in each
        round), or where rank 0 alone does."""
        rl = self.cfg.rl
        kept, dropped, rounds, seconds, tokens = [], [], 0, 0.0, 0
        while True:
            prompts = requests = None
            if self.rank == 0:
                prompts, requests = scores.step_requests(
                    self.driver.train_prompts, rl, update, self.cfg.data_seed, rounds)
            t0 = time.perf_counter()
            completions = generate(requests, f"rollouts {update + 1}" + (
                f" round {rounds + 1}" if rounds else ""))
            seconds += time.perf_counter() - t0
            if completions is not None:  # rank 0
                tokens += sum(len(c.token_ids) for c in completions)
            more = decide(lambda: self._sort_groups(prompts, completions, kept, dropped,
                                                    rounds))
            rounds += 1
            if not more:
                break
        stats: dict = {"rollout_time_s": seconds, "generated_tokens": tokens}
        groups = None
        if self.rank == 0:
            groups, with_signal = scores.fill_groups(kept, dropped, rl.prompts_per_step)
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
        rewards = scores.score(self.driver.verifier, self.driver.tokenizer, prompts,
                               completions, rl.responses_per_prompt)
        g = rl.responses_per_prompt
        for i, prompt in enumerate(prompts):
            group = (prompt, completions[i * g:(i + 1) * g], rewards[i])
            signal = not rl.dynamic_sampling or scores.has_signal(rewards[i])
            (kept if signal else dropped).append(group)
        return (rl.dynamic_sampling and len(kept) < rl.prompts_per_step
                and rounds + 1 < rl.dynamic_sampling_max_rounds)

    def evaluate(self, version: int) -> dict:
        """Held-out pass@1 and pass@k at weights ``version`` (every rank)."""
        rl = self.cfg.rl
        requests = scores.eval_requests(self.driver.eval_prompts, rl) if self.rank == 0 else None
        completions = self.engines.generate(requests, version, "eval")

        def score() -> dict:  # rank 0, which holds the verifier
            rewards = scores.score(self.driver.verifier, self.driver.tokenizer,
                                   self.driver.eval_prompts, completions, rl.eval_samples)
            p1, pk = scores.pass_at(rewards)
            length, truncated = scores.length_stats(completions)
            return {"eval_pass@1": p1, f"eval_pass@{rl.eval_samples}": pk,
                    "eval_response_len": length, "eval_truncated_frac": truncated,
                    # per eval prompt (fixed prompts and seeds): paired gains and their SE
                    "eval_prompt_pass": scores.prompt_pass_rates(rewards)}
        return from_rank0(score)
