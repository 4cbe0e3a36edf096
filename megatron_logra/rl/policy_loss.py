"""Rollouts as trainer microbatches, and the policy-gradient loss over vocab-parallel logits.

A rollout sample is prompt + response. As in SFT, ``labels[t] = tokens[t + 1]``;
the response tokens are the labels at positions ``len(prompt) - 1 ...``, where
``loss_mask`` is 1 and ``rollout_logprobs`` holds the engine's log-probabilities.

Log-probs are computed per microbatch with megatron's vocab-parallel cross entropy
(each TP rank holds [b, s, V/TP] of one microbatch; the full batch x length x vocab
tensor never exists), at the sampling temperature: log softmax(z / T).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_logra.rl.config import PolicyObjective
from megatron_logra.rl.objective import objective_terms
from megatron_logra.training.loss import token_nll

# report layout: what the loss function sums per microbatch (the trainer adds them up)
REPORT_KEYS = ("loss_sum", "loss_denominator", "tokens", "abs_mismatch_sum", "tis_weight_sum",
               "tis_capped", "eos_mismatch_sum", "eos_tokens", "clipped_tokens", "ppo_kl_sum")
"""loss_sum / loss_denominator: the objective's aggregation (``rl.objective``); tokens:
generated tokens; abs_mismatch: |old - rollout| logprob; eos_*: sum of (rollout - old)
logprob over the tokens of EOS-terminated responses (not truncated), and their count: the
KL controller's mismatch m; clipped_tokens: tokens whose PPO-clipped term is active;
ppo_kl: sum of old - current logprob (k1 estimate of KL(old || current), 0 at the first
step of an update)."""


@dataclass(frozen=True)
class RolloutSample:
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]  # one per response token
    advantage: float
    truncated: bool = False  # the response hit --max-new-tokens (no EOS)
    reward: float = 0.0  # the verifier's score the advantage came from
    version: int = 0  # the weights version that generated it (its rollout_logprobs')
    weight: float = 1.0  # its tokens' weight in the loss (0: dropped as too stale)


def collate_rollouts(samples: list[RolloutSample], seq_length: int,
                     pad_id: int) -> dict[str, torch.Tensor]:
    """Microbatch tensors [b, s] (attention_mask [b, 1, s, s], advantages [b]). A sample longer
    than seq_length + 1 tokens is an error (the engine's max_model_len, --seq-length,
    prevents it)."""
    b = len(samples)
    tokens = torch.full((b, seq_length), pad_id, dtype=torch.long)
    labels = torch.full((b, seq_length), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((b, seq_length), dtype=torch.float32)
    rollout_lp = torch.zeros((b, seq_length), dtype=torch.float32)
    for i, s in enumerate(samples):
        ids = s.prompt_ids + s.response_ids
        if len(ids) > seq_length + 1:
            raise ValueError(f"rollout of {len(ids)} tokens exceeds --seq-length {seq_length} + 1: "
                             "lower --max-new-tokens or raise --seq-length")
        if len(s.rollout_logprobs) != len(s.response_ids):
            raise ValueError("one rollout logprob per response token expected")
        n = len(ids) - 1
        tokens[i, :n] = torch.tensor(ids[:-1])
        labels[i, :n] = torch.tensor(ids[1:])
        start = len(s.prompt_ids) - 1
        loss_mask[i, start:n] = s.weight
        rollout_lp[i, start:n] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    causal = torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool), diagonal=1)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
            "rollout_logprobs": rollout_lp,
            "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32),
            "eos_terminated": torch.tensor([not s.truncated for s in samples],
                                           dtype=torch.float32),
            "position_ids": torch.arange(seq_length).unsqueeze(0).expand(b, -1).contiguous(),
            "attention_mask": causal.expand(b, 1, seq_length, seq_length).contiguous()}


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   temperature: float) -> torch.Tensor:
    """log pi(labels) at temperature T from vocab-parallel logits [b, s, Vp/TP] -> [b, s] fp32."""
    return -token_nll(logits.float() / temperature, labels, vocab_size)


def policy_gradient_loss(vocab_size: int, temperature: float, objective: PolicyObjective,
                         max_new_tokens: int, batch: dict[str, torch.Tensor],
                         logits: torch.Tensor):
    """The trainer's loss function (``training.step.LossFn``): ``rl.objective`` over the
    microbatch's generated tokens. ``batch["old_logprobs"]`` holds the logprobs the update
    started from when it takes several optimizer steps (``PolicyUpdate.old_logprobs``); without
    it the current ones are the old ones (one step per rollout batch)."""
    mask = batch["loss_mask"]
    logp = token_logprobs(logits, batch["labels"], vocab_size, temperature)
    old = batch["old_logprobs"] if "old_logprobs" in batch else logp.detach()
    rollout = batch["rollout_logprobs"]
    terms = objective_terms(objective, logp, old, rollout, batch["advantages"], mask,
                            max_new_tokens)
    w = terms.weights
    capped = (w >= objective.tis_cap) * mask if objective.tis_cap else mask.new_zeros(())
    eos_mask = mask * batch["eos_terminated"][:, None]
    report = torch.stack([
        terms.numerator.detach(), terms.denominator, mask.sum(),
        ((old - rollout).abs() * mask).sum(), (w * mask).sum(), capped.sum(),
        ((rollout - old) * eos_mask).sum(), eos_mask.sum(), terms.clipped.sum(),
        ((old - logp.detach()) * mask).sum()])
    return (terms.numerator, terms.denominator.round().to(torch.int),
            {"lm loss": report.float()})


def logprobs_report(vocab_size: int, temperature: float, batch: dict[str, torch.Tensor],
                    logits: torch.Tensor):
    """Forward-only loss function: the microbatch's token logprobs [b, s] as its report
    (``PolicyUpdate.old_logprobs``)."""
    logp = token_logprobs(logits, batch["labels"], vocab_size, temperature)
    return logp.sum() * 0, batch["loss_mask"].sum().to(torch.int), {"logprobs": logp.detach()}
