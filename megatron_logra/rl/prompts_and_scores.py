"""Prompts, sampling requests, scores and pass@k: the data side of the RL loop (rank 0).

The prompt order is a pure function of (seed, update index), like SFT's sample
order, so a resumed run draws the same prompts; every sample has its own sampling
seed (rollout seed, update, prompt, sample), so rollouts do not depend on batching.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_logra.data.sft import batch_indices
from megatron_logra.data.tokenizer import TextTokenizer
from megatron_logra.rl.config import RLConfig
from megatron_logra.rollout.types import Completion, SampleRequest
from megatron_logra.data.tasks import TaskItem
from megatron_logra.rl.verifiers import Verifier
from megatron_logra.runtime.progress import Progress


@dataclass(frozen=True)
class Prompt:
    item: TaskItem
    ids: list[int]


def encode_prompts(items: list[TaskItem], tokenizer: TextTokenizer, max_tokens: int) -> list[Prompt]:
    """Prompts in the SFT format (``tokenizer.prompt``); those over ``max_tokens`` are dropped
    (the caller refuses a run left with too few)."""
    out = [Prompt(it, tokenizer.encode(tokenizer.prompt(it.question))) for it in items]
    return [p for p in out if len(p.ids) <= max_tokens]


def sample_seed(rollout_seed: int, update: int, prompt: int, sample: int) -> int:
    return (((rollout_seed * 1_000_003 + update) * 100_003 + prompt) * 1_009 + sample) % 2**31


def step_requests(prompts: list[Prompt], cfg: RLConfig, update: int, seed: int,
                  round_: int = 0) -> tuple[list[Prompt], list[SampleRequest]]:
    """The prompts of update ``update`` and their P x G requests (prompt-major). Round
    ``round_`` > 0 (dynamic sampling's extra generations) draws another P prompts from
    its own order, with sampling seeds of its own."""
    order_seed = seed if not round_ else seed + 1_000_003 * round_
    chosen = [prompts[i] for i in batch_indices(len(prompts), cfg.prompts_per_step, update,
                                                order_seed)]
    first = round_ * cfg.prompts_per_step
    requests = [SampleRequest(p.ids, sample_seed(cfg.rollout.seed, update, first + i, j),
                              cfg.max_new_tokens, cfg.temperature)
                for i, p in enumerate(chosen) for j in range(cfg.responses_per_prompt)]
    return chosen, requests


def has_signal(group_rewards: list[float]) -> bool:
    """A group trains only if its rewards differ (all equal: GRPO advantage 0)."""
    return max(group_rewards) > min(group_rewards)


def fill_groups(kept: list, dropped: list, wanted: int) -> tuple[list, int]:
    """Dynamic sampling's batch: the first ``wanted`` groups with signal, topped up with
    dropped ones (in order) when too few had it -> (groups, groups with signal used)."""
    used = kept[:wanted]
    return used + dropped[:wanted - len(used)], len(used)


def score(verifier: Verifier, tokenizer: TextTokenizer, prompts: list[Prompt],
          completions: list[Completion], per_prompt: int) -> list[list[float]]:
    """Rewards [P][G] of prompt-major completions (a ``[scoring]`` progress line)."""
    rewards = []
    with Progress("scoring", len(completions), "answers") as progress:
        for i, p in enumerate(prompts):
            group = completions[i * per_prompt:(i + 1) * per_prompt]
            rewards.append([verifier.score(p.item, tokenizer.decode(c.token_ids)).reward
                            for c in group])
            progress.update((i + 1) * per_prompt)
    return rewards


def eval_requests(prompts: list[Prompt], cfg: RLConfig) -> list[SampleRequest]:
    return [SampleRequest(p.ids, sample_seed(cfg.rollout.seed + 7919, 0, i, j),
                          cfg.max_new_tokens, cfg.eval_temperature, cfg.eval_top_p)
            for i, p in enumerate(prompts) for j in range(cfg.eval_samples)]


def prompt_pass_rates(rewards: list[list[float]]) -> list[float]:
    """Per prompt, the fraction of its samples that are fully correct (reward >= 1)."""
    return [sum(r >= 1.0 for r in row) / len(row) for row in rewards]


def pass_at(rewards: list[list[float]]) -> tuple[float, float]:
    """(pass@1, pass@k) from k binary-or-partial rewards per prompt: pass@1 = mean correct
    fraction (the unbiased estimator with n = k samples), pass@k = fraction of prompts with
    at least one fully correct sample."""
    if not rewards:
        return float("nan"), float("nan")
    p1 = sum(prompt_pass_rates(rewards)) / len(rewards)
    pk = sum(any(r >= 1.0 for r in row) for row in rewards) / len(rewards)
    return p1, pk


def length_stats(completions: list[Completion]) -> tuple[float, float]:
    """(mean response length in tokens, fraction truncated at max_new_tokens)."""
    n = max(len(completions), 1)
    return (sum(len(c.token_ids) for c in completions) / n,
            sum(c.truncated for c in completions) / n)
